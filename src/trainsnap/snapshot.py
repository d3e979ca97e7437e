"""The public save / load / list functions and :class:`SnapshotInfo`."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from . import commit, tunables
from .asyncsave import AsyncSaver, default_saver
from .collective import run_load, run_save
from .comm import Comm, Timeouts, default_comm
from .errors import InvalidArgumentError, NotFoundError
from .manifest import LEVELS, Manifest
from .marker import Marker
from .saving import SaveOptions
from .storage import Storage, open_storage
from .trainstate import TrainState

log = logging.getLogger("trainsnap.load")

Root = str | os.PathLike[str] | Storage


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """A committed snapshot, as listed, saved or loaded.

    ``level`` is what the snapshot offers when listed or saved, and what was reached when
    returned by a load. ``nbytes`` is the bytes its objects occupy.
    """

    id: str
    step: int
    created: datetime
    level: str
    nbytes: int
    root: str
    tokens_seen: int | None = None

    def wait(self) -> SnapshotInfo:
        """A synchronous save is complete when it returns: this is the snapshot itself."""
        return self

    def done(self) -> bool:
        return True

    @staticmethod
    def from_manifest(m: Manifest, root: str, level: str | None = None) -> SnapshotInfo:
        return SnapshotInfo(
            id=m.snapshot_id,
            step=m.step,
            created=_parse_time(m.created),
            level=level or m.level,
            nbytes=m.nbytes,
            root=root,
            tokens_seen=m.tokens_seen,
        )

    @staticmethod
    def from_marker(mk: Marker, root: str) -> SnapshotInfo:
        return SnapshotInfo.from_summary(mk.snapshot_id, mk.summary, root)

    @staticmethod
    def from_summary(snapshot_id: str, s: Mapping[str, Any], root: str) -> SnapshotInfo:
        return SnapshotInfo(
            id=snapshot_id,
            step=int(s.get("step", -1)),
            created=_parse_time(str(s.get("created", ""))),
            level=str(s.get("level", "weights")),
            nbytes=int(s.get("nbytes", 0)),
            root=root,
            tokens_seen=s.get("tokens_seen"),
        )


def _parse_time(s: str) -> datetime:
    try:
        return datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        return datetime.fromtimestamp(0).astimezone()


def save_options(
    state: Any,
    *,
    step: int,
    level: str = "strict",
    tokens_seen: int | None = None,
    samples_seen: int | None = None,
    data_cursor: Any = None,
    versions: Mapping[str, Any] | None = None,
    meta: Mapping[str, Any] | None = None,
    allow_pickle: bool = False,
    checksum: str = "xxh3-128",
    parts: Collection[str] | None = None,
    compression: str | Mapping[str, str | None] | None = None,
) -> tuple[Any, SaveOptions]:
    """The tree to save and its options; a :class:`TrainState` gives its tree, kinds, level,
    versions and counters."""
    tree, kinds = state, {}
    user_versions = dict(versions or {})
    if isinstance(state, TrainState):
        tree = state.save_tree(parts)
        kinds, level = state.kinds(parts), state.offered_level(parts)
        user_versions = {**state.versions, **user_versions}
        tokens, samples = state.counters()
        tokens_seen = tokens if tokens_seen is None else tokens_seen
        samples_seen = samples if samples_seen is None else samples_seen
        data_cursor = state.data_cursor() if data_cursor is None else data_cursor
    opts = SaveOptions(
        step=step,
        level=level,
        tokens_seen=tokens_seen,
        samples_seen=samples_seen,
        data_cursor=data_cursor,
        state_kinds=kinds,
        user_versions=user_versions,
        meta=dict(meta or {}),
        allow_pickle=allow_pickle,
        checksum=checksum,
        compression=compression,
    )
    return tree, opts


def save(
    state: Any,
    root: Root,
    *,
    step: int,
    async_save: bool = False,
    level: str = "strict",
    tokens_seen: int | None = None,
    samples_seen: int | None = None,
    data_cursor: Any = None,
    versions: Mapping[str, Any] | None = None,
    meta: Mapping[str, Any] | None = None,
    allow_pickle: bool = False,
    checksum: str = "xxh3-128",
    storage_options: Mapping[str, Any] | None = None,
    coordinator: int = 0,
    timeout: float | None = None,
    saver: AsyncSaver | None = None,
    compression: str | Mapping[str, str | None] | None = None,
) -> SnapshotInfo:
    """Save ``state`` (a mapping of tensors, plain data and stateful objects) as a new snapshot
    of ``root`` at ``step``, and commit it. Returns the committed snapshot.

    With an initialised ``torch.distributed`` process group every rank calls ``save`` with its
    own part of the state (``DTensor``, ``ts.Sharded``, plain tensors); ``coordinator`` plans and
    commits, and ``timeout`` (seconds) bounds how long ranks wait for each other. ``versions``
    (model, tokenizer, code, data...) are recorded for resume checks; ``meta`` is free-form plain
    data kept in the manifest. Values that are not plain data are refused unless ``allow_pickle``.

    With ``async_save=True`` the call returns once the state is staged (copied into reused host
    buffers) with a :class:`~trainsnap.asyncsave.SaveHandle`: ``wait()`` gives the snapshot or
    raises. Writing and the commit continue in the background; at most one save per ``saver``
    (default: the process's) is in flight, and a failure is raised by the next save or wait.

    ``compression`` ("zstd", "bytegroup+zstd", or a mapping from top-level key to either)
    stores tensor data compressed losslessly, block by block.
    """
    storage = open_storage(root, **dict(storage_options or {}))
    tree, opts = save_options(
        state, step=step, level=level, tokens_seen=tokens_seen, samples_seen=samples_seen,
        data_cursor=data_cursor, versions=versions, meta=meta, allow_pickle=allow_pickle,
        checksum=checksum, compression=compression,
    )  # fmt: skip
    if async_save:
        handle = (saver or default_saver()).save(tree, storage, opts, _comm(coordinator, timeout))
        return handle  # type: ignore[return-value]  # a SaveHandle: .wait() -> SnapshotInfo
    result = run_save(tree, storage, opts, _comm(coordinator, timeout))
    if result.manifest is not None:
        return SnapshotInfo.from_manifest(result.manifest, storage.url)
    return SnapshotInfo.from_summary(
        result.outcome.snapshot_id, result.outcome.manifest_summary, storage.url
    )


def _comm(coordinator: int, timeout: float | None) -> Comm:
    t = tunables.get()
    beat = float(t.heartbeat_seconds)
    if timeout is None:
        timeouts = Timeouts(heartbeat=beat)
    else:
        timeouts = Timeouts(exchange=timeout, heartbeat=min(beat, timeout))
    return default_comm(coordinator=coordinator, timeouts=timeouts)


def resolve(storage: Storage, snapshot: str) -> str:
    """The id ``snapshot`` names: ``"latest"`` is the newest committed snapshot."""
    if snapshot != "latest":
        return snapshot
    found = commit.list_committed(storage)
    if not found:
        raise NotFoundError(
            f"no committed snapshot in {storage.url}; save one first, or check the root",
            path=storage.url,
        )
    return found[-1].snapshot_id


def load(
    state: Any,
    root: Root,
    *,
    snapshot: str = "latest",
    level: str = "strict",
    allow_downgrade: bool = False,
    allow_pickle: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    coordinator: int = 0,
    timeout: float | None = None,
) -> SnapshotInfo:
    """Fill ``state`` in place from a committed snapshot of ``root`` (``"latest"`` or an id).

    Exactly the keys ``state`` holds are filled: tensors in place, plain values into their
    containers; a key the snapshot lacks is an error, keys it does not ask for are ignored.
    ``level`` is the resume level required; a snapshot that cannot give it is refused unless
    ``allow_downgrade``, and the returned info's ``level`` is the level reached.
    """
    if level not in LEVELS:
        raise InvalidArgumentError(f"level must be one of {LEVELS}, got {level!r}")
    t0 = time.perf_counter()
    storage = open_storage(root, **dict(storage_options or {}))

    m, reached, nread = run_load(
        state, storage, snapshot, _comm(coordinator, timeout),
        level=level, allow_downgrade=allow_downgrade, allow_pickle=allow_pickle,
    )  # fmt: skip
    dt = time.perf_counter() - t0
    log.info(
        "loaded snapshot %s step=%d level=%s bytes_read=%d seconds=%.3f MBps=%.1f root=%s",
        m.snapshot_id, m.step, reached, nread, dt, nread / max(dt, 1e-9) / 1e6, storage.url,
    )  # fmt: skip
    return SnapshotInfo.from_manifest(m, storage.url, level=reached)


def list_snapshots(root: Root, **storage_options: Any) -> list[SnapshotInfo]:
    """Committed snapshots of ``root``, oldest step first."""
    storage = open_storage(root, **storage_options)
    return [SnapshotInfo.from_marker(c.marker, storage.url) for c in commit.list_committed(storage)]
