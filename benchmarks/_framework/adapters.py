"""The methods every benchmark compares: trainsnap, ``torch.save`` and DCP.

One adapter per library, each configured by its constructor (synchronous or asynchronous, in a
process group or not, which staging), so that every benchmark measures the same calls. The
disk's limit (``raw``) is in :mod:`benchmarks._framework.raw`.
"""

from __future__ import annotations

import inspect
import logging
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import trainsnap as ts
from benchmarks._framework.method import Method, Pending, State
from benchmarks._framework.system import fsync_dir
from trainsnap import trace

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load).*")
warnings.filterwarnings("ignore", message=".*Ignoring pin_memory flag.*")


def trace_seconds(step: int) -> dict[str, float]:
    """Seconds of the ``trainsnap.trace`` spans of the save of ``step``, by span name."""
    out: dict[str, float] = {}
    for event in trace.events():
        if event.get("args", {}).get("step") == step:
            out[event["name"]] = out.get(event["name"], 0.0) + event["dur"] / 1e6
    return out


class Trainsnap(Method):
    """``trainsnap.save`` / ``trainsnap.load`` (checksums on, the default; ``storage_options``
    to reach an object store); with
    ``asynchronous``, ``trainsnap.async_save`` on a dedicated ``AsyncSaver``, its pause
    ``handle.pause`` and its phases from ``trainsnap.trace``. Every save has a new step (unique
    steps name the trace spans)."""

    def __init__(
        self,
        *,
        name: str = "trainsnap",
        asynchronous: bool = False,
        options: ts.SaveOptions | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.name, self.label = name, name
        self.asynchronous = asynchronous
        self.options = options
        self.storage_options = storage_options
        self.saver: ts.AsyncSaver | None = None
        self.step = 0
        self.last_info: ts.SnapshotInfo | None = None
        """What the last synchronous save returned (its stored bytes: ``nbytes``)."""

    def setup(self) -> None:
        # trainsnap's public names load on first use (so that its CLI starts without torch),
        # and a first save imports what it needs (DTensor's modules among them): one untimed
        # save of a tiny state here, as a job has long done it before its first timed one
        for name in ts.__all__:
            getattr(ts, name)
        with tempfile.TemporaryDirectory(prefix="trainsnap-warmup-") as directory:
            ts.save({"warmup": torch.zeros(1)}, directory, step=0, no_dist=True)
        if self.asynchronous:
            self.saver = ts.AsyncSaver()

    def save(self, state: State, directory: Path) -> Pending | None:
        self.step += 1
        if self.saver is None:
            self.last_info = ts.save(
                state,
                directory,
                step=self.step,
                options=self.options,
                storage_options=self.storage_options,
            )
            return None
        start = time.perf_counter()
        handle: Any = ts.async_save(state, directory, step=self.step, saver=self.saver)
        call_s = time.perf_counter() - start
        step = self.step

        def wait() -> dict[str, float]:
            handle.wait()
            return trace_seconds(step)

        return Pending(handle.pause, wait, {"call": call_s})

    def load(self, destination: State, directory: Path) -> None:
        ts.load(destination, directory, storage_options=self.storage_options)

    def teardown(self) -> None:
        if self.saver is not None:
            self.saver.close()
            self.saver = None


class SaveLog(logging.Handler):
    """(referenced, written) of each ``saved snapshot ...`` line of the save protocol's logger."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.saves: list[tuple[int, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        arguments: Any = record.args
        if str(record.msg).startswith("saved snapshot") and isinstance(arguments, tuple):
            self.saves.append((int(arguments[2]), int(arguments[3])))  # bytes=, written=

    def __enter__(self) -> SaveLog:
        logger = logging.getLogger("trainsnap.protocol.save_protocol")
        self._level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logger = logging.getLogger("trainsnap.protocol.save_protocol")
        logger.removeHandler(self)
        logger.setLevel(self._level)


class TorchSave(Method):
    """``torch.save`` of the whole dict to one file, then fsync (file and directory) /
    ``torch.load(mmap=False, weights_only=True)`` then a copy into the destinations."""

    name = label = "torch"

    def save(self, state: State, directory: Path) -> None:
        with open(directory / "state.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(directory)

    def load(self, destination: State, directory: Path) -> None:
        path = directory / "state.pt"
        loaded = torch.load(path, map_location="cpu", mmap=False, weights_only=True)
        with torch.no_grad():
            for key, tensor in destination.items():
                tensor.copy_(loaded[key])
        del loaded


def _without_process_group(function: Any) -> dict[str, Any]:
    """``no_dist=True`` where this torch's DCP takes it (older versions need it without a
    process group; newer ones infer it)."""
    return {"no_dist": True} if "no_dist" in inspect.signature(function).parameters else {}


class Dcp(Method):
    """``torch.distributed.checkpoint.save`` with ``FileSystemWriter(thread_count=<threads>,
    sync_files=True)`` / ``dcp.load`` with ``FileSystemReader``; on the default process group
    with ``distributed``, else single process (``no_dist``).

    With ``asynchronous``: ``dcp.async_save``, its pause the time until it returns, or, with a
    stager that stages on a background thread, until ``staging_completion`` (the state may not
    change before). ``stager`` is passed as ``async_stager`` (and closed at teardown);
    ``writer_options`` go to the ``FileSystemWriter``.
    """

    def __init__(
        self,
        threads: int,
        *,
        name: str = "dcp",
        label: str = "",
        distributed: bool = False,
        asynchronous: bool = False,
        stager: Any = None,
        writer_options: dict[str, Any] | None = None,
    ) -> None:
        self.name, self.label = name, label or name
        self.threads = threads
        self.distributed = distributed
        self.asynchronous = asynchronous
        self.stager = stager
        self.writer_options = writer_options or {}

    def _options(self, function: Any) -> dict[str, Any]:
        return {} if self.distributed else _without_process_group(function)

    def _writer(self, directory: Path) -> Any:
        import torch.distributed.checkpoint as dcp

        return dcp.FileSystemWriter(
            directory, thread_count=self.threads, sync_files=True, **self.writer_options
        )

    def save(self, state: State, directory: Path) -> Pending | None:
        import torch.distributed.checkpoint as dcp

        if not self.asynchronous:
            dcp.save(state, storage_writer=self._writer(directory), **self._options(dcp.save))
            return None
        options = self._options(dcp.async_save)
        if self.stager is not None:
            options["async_stager"] = self.stager
        writer = self._writer(directory)
        start = time.perf_counter()
        future = dcp.async_save(state, storage_writer=writer, **options)
        returned_s = time.perf_counter() - start
        if not hasattr(future, "staging_completion"):
            return Pending(returned_s, lambda: _result(future))
        future.staging_completion.result()  # staging goes on in the background until then
        pause_s = time.perf_counter() - start
        return Pending(pause_s, lambda: _result(future.upload_completion), {"returned": returned_s})

    def load(self, destination: State, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp

        reader = dcp.FileSystemReader(directory)
        dcp.load(destination, storage_reader=reader, **self._options(dcp.load))

    def teardown(self) -> None:
        if self.stager is not None:
            self.stager.close()


def _result(future: Any) -> dict[str, float]:
    future.result()
    return {}
