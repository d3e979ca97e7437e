"""Lightning's checkpoints as trainsnap snapshots: ``Trainer(plugins=[TrainsnapCheckpointIO()])``.

Lightning hands its checkpoint backend the whole checkpoint dict on global rank 0 (model state,
optimizer and scheduler states, loops, callbacks, hyper-parameters) and asks for it back by path
on every rank. :class:`TrainsnapCheckpointIO` saves the dict as a committed snapshot of a
trainsnap root (checksummed, content-addressed: an unchanged tensor is stored once however many
checkpoints hold it) and writes, at the ``.ckpt`` path Lightning chose, a small JSON *pointer*
to that snapshot -- only after the commit, so a pointer never names an uncommitted snapshot.
``fit(ckpt_path="last")``, ``ModelCheckpoint`` top-k and ``save_last`` work unchanged; a removed
top-k checkpoint deletes its snapshot and collects the objects no other snapshot uses.

    trainer = lightning.Trainer(plugins=[TrainsnapCheckpointIO()], ...)  # root: <dir>/trainsnap
    model = load_from_checkpoint(MyModule, "checkpoints/last.ckpt")

Hyper-parameters that are not plain data (an ``argparse.Namespace``, a dataclass) need
``allow_pickle=("hyper_parameters",)``; trainsnap never unpickles anything else.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch

from trainsnap.api.async_saver import AsyncSaver, SaveHandle
from trainsnap.api.options import SaveOptions
from trainsnap.api.snapshots import async_save, delete, load, read, save
from trainsnap.errors import IncompatibleError, NotFoundError
from trainsnap.format import tree
from trainsnap.format.values import PickleKeys
from trainsnap.manager import collection
from trainsnap.protocol import commit
from trainsnap.storage import Root, open_storage

try:
    from lightning.pytorch.plugins.io import CheckpointIO
    from lightning.pytorch.strategies import ModelParallelStrategy as _ModelParallelStrategy
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError(
        "trainsnap.integrations.lightning needs Lightning: pip install 'trainsnap[lightning]'"
    ) from e

log = logging.getLogger("trainsnap.integrations.lightning")

POINTER_FORMAT = "trainsnap.pointer"
DEFAULT_ROOT = "trainsnap"
"""The root's folder next to the checkpoints when no root is given."""


class TrainsnapCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that stores checkpoints as trainsnap snapshots.

    Args:
        root: the trainsnap root (a directory, ``s3://...``); default: a ``trainsnap`` folder
            in the directory of the first checkpoint path Lightning gives.
        async_save: return once the checkpoint is staged (copied); writing and the commit go
            on in the background and the pointer is written by a done callback.
        allow_pickle: keys whose non-plain values may be pickled on save and unpickled on load
            (``("hyper_parameters",)``), or True for all; off by default.
        storage_options: options for the root's storage (``endpoint_url`` ...).
    """

    def __init__(
        self,
        root: Root | None = None,
        *,
        async_save: bool = False,
        allow_pickle: PickleKeys = False,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.root = root
        self.async_save = async_save
        self.allow_pickle = allow_pickle
        self.storage_options = dict(storage_options or {})
        self._saver: AsyncSaver | None = None
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []

    # -- Lightning's interface ----------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        self._raise_background_error()
        pointer = Path(path)
        root = self._root_for(pointer)
        step = int(checkpoint.get("global_step", 0))
        options = SaveOptions(
            allow_pickle=self.allow_pickle,
            meta={"lightning_path": pointer.name, "epoch": checkpoint.get("epoch")},
        )
        kwargs: dict[str, Any] = {"step": step, "options": options, "no_dist": True}
        kwargs["storage_options"] = self.storage_options
        if not self.async_save:
            info = save(checkpoint, root, **kwargs)
            self._point(pointer, root, info.id, step)
            return
        if self._saver is None:
            self._saver = AsyncSaver()
        handle = async_save(checkpoint, root, saver=self._saver, **kwargs)
        handle.add_done_callback(lambda h: self._committed(h, pointer, root, step))

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        self.wait()
        root, snapshot_id = read_pointer(Path(path))
        tree = read(
            root,
            snapshot_id,
            allow_pickle=self.allow_pickle,
            storage_options=self.storage_options,
        )
        out: dict[str, Any] = tree if map_location is None else _map_location(tree, map_location)
        return out

    def remove_checkpoint(self, path: Any) -> None:
        self.wait()  # the save of this path may still be in flight
        pointer = Path(path)
        if not pointer.exists():
            return
        root, snapshot_id = read_pointer(pointer)
        pointer.unlink()
        self._drop(root, snapshot_id, pointer)

    def teardown(self) -> None:
        """Wait for the save in flight (Lightning calls this at the end of fit)."""
        if self._saver is not None:
            self._saver.close()
            self._saver = None
        self._raise_background_error()

    # -- helpers ------------------------------------------------------------------------------

    def wait(self) -> None:
        """Wait until no save is in flight; raise the error of a failed background save."""
        if self._saver is not None:
            self._saver.wait()
        self._raise_background_error()

    def _point(self, pointer: Path, root: Root, snapshot_id: str, step: int) -> None:
        """Point ``pointer`` at the committed snapshot; the snapshot it named before (Lightning
        overwrites ``last.ckpt``) is deleted."""
        previous = read_pointer(pointer) if pointer.exists() else None
        _write_pointer(pointer, root, snapshot_id, step)
        if previous is not None and previous[1] != snapshot_id:
            self._drop(previous[0], previous[1], pointer)

    def _drop(self, root: Root, snapshot_id: str, pointer: Path) -> None:
        try:
            delete(root, snapshot_id, **self.storage_options)
        except NotFoundError:
            log.warning("%s named snapshot %s, which is already gone", pointer, snapshot_id)
        # A save of another path may be in flight: objects younger than the grace period stay.
        collection.collect(open_storage(root, **self.storage_options), grace=600.0)

    def _root_for(self, pointer: Path) -> Root:
        if self.root is None:
            self.root = str(pointer.parent / DEFAULT_ROOT)
        return self.root

    def _committed(self, handle: SaveHandle, pointer: Path, root: Root, step: int) -> None:
        try:
            info = handle.wait()
            self._point(pointer, root, info.id, step)
        except BaseException as e:  # raised by the next save, load or teardown
            with self._lock:
                self._errors.append(e)

    def _raise_background_error(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]


def _write_pointer(pointer: Path, root: Root, snapshot_id: str, step: int) -> None:
    """The pointer, atomically: a reader sees the old one, the new one, or none."""
    root_text = str(root)
    if not root_text.startswith(("s3://", "file://", "memory://")):
        # Kept relative to the pointer when the root is next to it: the folder can move.
        absolute = Path(root_text).resolve()
        if absolute.is_relative_to(pointer.parent.resolve()):
            root_text = str(absolute.relative_to(pointer.parent.resolve()))
    doc = {"format": POINTER_FORMAT, "root": root_text, "snapshot": snapshot_id, "step": step}
    pointer.parent.mkdir(parents=True, exist_ok=True)
    tmp = pointer.with_name(f".{pointer.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(doc) + "\n")
    os.replace(tmp, pointer)


def read_pointer(pointer: Path) -> tuple[str, str]:
    """(root, snapshot id) a checkpoint path points to."""
    try:
        doc = json.loads(pointer.read_text())
    except FileNotFoundError:
        raise NotFoundError(f"no checkpoint at {pointer}", path=str(pointer)) from None
    except (UnicodeDecodeError, ValueError):
        doc = None
    if not (isinstance(doc, dict) and doc.get("format") == POINTER_FORMAT):
        raise IncompatibleError(
            f"{pointer} is not a trainsnap checkpoint pointer (a torch.save checkpoint?); load "
            "it with Lightning's default CheckpointIO, or save it again through "
            "TrainsnapCheckpointIO",
            path=str(pointer),
        )
    root = str(doc["root"])
    if not root.startswith(("/", "s3://", "file://", "memory://")):
        root = str(pointer.parent / root)
    return root, str(doc["snapshot"])


def _map_location(tree: Any, where: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        if callable(where):
            return where(tree, "cpu")
        if isinstance(where, dict):
            return tree.to(where.get("cpu", "cpu"))
        return tree.to(where)
    if isinstance(tree, dict):
        return type(tree)((k, _map_location(v, where)) for k, v in tree.items())
    if isinstance(tree, list | tuple):
        return type(tree)(_map_location(v, where) for v in tree)
    return tree


def load_from_checkpoint(
    cls: Any,
    path: Any,
    *,
    map_location: Any | None = None,
    strict: bool | None = None,
    allow_pickle: PickleKeys = False,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(path)`` for a trainsnap pointer (Lightning's own reads the
    file with ``torch.load``): the module built from the saved hyper-parameters (overridden by
    ``kwargs``), its weights loaded."""
    from lightning.pytorch.core.saving import _load_state

    checkpoint = TrainsnapCheckpointIO(allow_pickle=allow_pickle).load_checkpoint(
        path, map_location=map_location
    )
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    return _load_state(cls, checkpoint, strict=strict, **kwargs)


def _saved_keys(root: Root, snapshot_id: str, storage_options: dict[str, Any]) -> list[Any]:
    """The top-level keys a snapshot holds (from its manifest; no data is read)."""
    manifest = commit.open_snapshot(open_storage(root, **storage_options), snapshot_id)
    if manifest.tree is None:
        return sorted({key.split(".", 1)[0] for key in manifest.tensor_keys + manifest.value_keys})
    return [key for key, _ in tree.items(manifest.tree)]


class TrainsnapModelParallelStrategy(_ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 / tensor parallel over a device mesh),
    checkpointing through trainsnap: every rank saves its own shards collectively -- nothing is
    gathered to rank 0 -- and loads its shards of any saved layout, straight into its DTensors.
    Rank 0 writes the pointer after the commit, as :class:`TrainsnapCheckpointIO` does.

        strategy = TrainsnapModelParallelStrategy(root, data_parallel_size=2)
        trainer = lightning.Trainer(strategy=strategy, ...)
    """

    def __init__(
        self,
        root: Root | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.storage_options = dict(storage_options or {})
        self._trainsnap = TrainsnapCheckpointIO(root, storage_options=self.storage_options)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        pointer = Path(self.broadcast(str(filepath)))
        root = self.broadcast(str(self._trainsnap._root_for(pointer)))
        step = int(checkpoint.get("global_step", 0))
        # Every rank saves its own DTensor shards; the coordinator commits.
        info = save(checkpoint, root, step=step, storage_options=self.storage_options)
        if self.global_rank == 0:
            self._trainsnap._point(pointer, root, info.id, step)
        self.barrier("trainsnap.save_checkpoint")

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        root, snapshot_id = read_pointer(Path(self.broadcast(str(checkpoint_path))))
        model = self.model
        assert model is not None, "load_checkpoint runs after the strategy set the model up"
        # Everything saved, as placeholders; the model's and optimizers' own (sharded) state dicts
        # as destinations (torch initialises a fresh optimizer's moments to load into).
        template: dict[str, Any] = dict.fromkeys(
            _saved_keys(root, snapshot_id, self.storage_options)
        )
        template["state_dict"] = get_model_state_dict(model)
        template["optimizer_states"] = [get_optimizer_state_dict(model, o) for o in self.optimizers]
        load(template, root, snapshot=snapshot_id, storage_options=self.storage_options)
        set_model_state_dict(model, template.pop("state_dict"))
        for optimizer, state in zip(self.optimizers, template.pop("optimizer_states"), strict=True):
            set_optimizer_state_dict(
                model, optimizer, state, options=StateDictOptions(strict=False)
            )
        return template


__all__ = [
    "TrainsnapCheckpointIO",
    "TrainsnapModelParallelStrategy",
    "load_from_checkpoint",
    "read_pointer",
]
