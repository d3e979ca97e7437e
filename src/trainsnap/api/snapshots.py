"""The public entry points: save, async_save, load, read, list_snapshots and delete.

The machinery behind them is in :mod:`trainsnap.protocol` (the cross-rank save and load
protocols) and :mod:`trainsnap.api.async_saver` (saves in the background).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from trainsnap.api.async_saver import AsyncSaver, SaveHandle, default_saver
from trainsnap.api.options import SaveOptions
from trainsnap.engine.gc_pause import paused_gc
from trainsnap.errors import (
    CommitFailedError,
    CorruptError,
    IncompleteError,
    InvalidArgumentError,
    LoadFailedError,
    NotFoundError,
    RankErrors,
    TrainsnapError,
)
from trainsnap.format.manifest import check_level
from trainsnap.format.values import PickleKeys
from trainsnap.protocol import commit, tree_load
from trainsnap.protocol.collective import decide, vote
from trainsnap.protocol.control_plane import Comm, LocalComm, PeerLost, comm_for
from trainsnap.protocol.load_protocol import Prefetch, run_load
from trainsnap.protocol.rank_load import fill
from trainsnap.protocol.save_protocol import run_save
from trainsnap.protocol.snapshot_info import SnapshotInfo
from trainsnap.state.load_target import describe
from trainsnap.storage import Root, open_storage
from trainsnap.storage.base import Storage

log = logging.getLogger(__name__)


def save(
    state: Any,
    root: Root,
    *,
    step: int,
    options: SaveOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
    coordinator: int = 0,
    timeout: float | None = None,
    no_dist: bool = False,
) -> SnapshotInfo:
    """Save ``state`` (a mapping of tensors, plain data and stateful objects, or a
    :class:`~trainsnap.TrainState`) as a new snapshot of ``root`` at ``step``, and commit it.
    Returns the committed snapshot.

    With an initialised ``torch.distributed`` process group every rank calls ``save`` with its
    own part of the state (``DTensor``, ``ts.Sharded``, plain tensors); ``coordinator`` plans and
    commits, and ``timeout`` (seconds) bounds how long ranks wait for each other. ``options``
    (:class:`SaveOptions`) says what else the snapshot records (versions, counters, metadata)
    and how it stores tensor data (compression, chunk size, pickle for non-plain values).

    ``no_dist=True`` saves this process's state alone, as a world of one, even inside an
    initialised process group (as DCP's ``no_dist``; e.g. a framework that saves on rank 0 only).
    """
    storage = open_storage(root, **dict(storage_options or {}))
    tree, request = (options or SaveOptions()).request(state, step)
    comm = LocalComm() if no_dist else comm_for(coordinator, timeout)
    result = run_save(tree, storage, request, comm)
    return result.info(storage.url)


def async_save(
    state: Any,
    root: Root,
    *,
    step: int,
    options: SaveOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
    coordinator: int = 0,
    timeout: float | None = None,
    saver: AsyncSaver | None = None,
    no_dist: bool = False,
) -> SaveHandle:
    """Like :func:`save`, but return once the state is staged (copied into reused host
    buffers): training may change the state right away. Writing and the commit continue in the
    background; the :class:`SaveHandle` gives the snapshot (``wait()``), tells whether it is
    finished (``done()``) and runs callbacks when it is (``add_done_callback(fn)``).

    At most one save per ``saver`` (default: the process's) is in flight: a new one waits for
    the previous one, and a background failure is raised by the next save or wait.
    ``no_dist`` as for :func:`save`.
    """
    storage = open_storage(root, **dict(storage_options or {}))
    tree, request = (options or SaveOptions()).request(state, step)
    comm = LocalComm() if no_dist else comm_for(coordinator, timeout)
    handle = (saver or default_saver()).save(tree, storage, request, comm)
    if handle is None:  # only a saver built with skip_if_busy skips
        raise TrainsnapError(
            f"the save of step {step} was skipped: its saver is busy and was built with "
            "skip_if_busy=True; use a saver without it to wait instead"
        )
    return handle


def load(
    state: Any,
    root: Root,
    *,
    snapshot: str = "latest",
    level: str = "strict",
    allow_downgrade: bool = False,
    allow_pickle: PickleKeys = False,
    storage_options: Mapping[str, Any] | None = None,
    coordinator: int = 0,
    timeout: float | None = None,
) -> SnapshotInfo:
    """Fill ``state`` in place from a committed snapshot of ``root`` (``"latest"`` or an id).

    Exactly the keys ``state`` holds are filled: tensors in place, plain values into their
    containers; a key the snapshot lacks is an error, keys it does not ask for are ignored.
    ``level`` is the resume level required; a snapshot that cannot give it is refused unless
    ``allow_downgrade``, and the returned info's ``level`` is the level reached, its
    ``reasons`` why it is not higher (a :class:`~trainsnap.TrainState` without a data cursor
    reaches ``training``: everything it holds is restored, the data order is not).

    ``"latest"`` is the newest committed snapshot that loads: when every rank's failure is
    damage to it (a corrupt or truncated object, a missing block: ``CorruptError``,
    ``IncompleteError``, or another rank's such failure), a warning names it and its damage and
    the previous one is loaded instead, and so on; a snapshot whose marker or manifest is broken
    is not committed and never tried. Damage is found before anything but tensors is touched
    (values and stateful objects are applied once every block verified), and the older snapshot
    fills every key the state asks for again, so nothing of the damaged one remains. A failure
    that is not damage (a state that does not fit, a level not given) is raised at once: an
    older snapshot would not fit either. When none loads, the newest one's error is raised and
    the state's tensors are unusable until a load succeeds. A named id never falls back.
    """
    check_level(level)
    storage = open_storage(root, **dict(storage_options or {}))
    comm = comm_for(coordinator, timeout)
    candidates = [snapshot] if snapshot != "latest" else _newest_first(storage, comm)
    first: Exception | None = None
    for i, sid in enumerate(candidates):
        try:
            return _load_one(state, storage, sid, comm, level, allow_downgrade, allow_pickle)
        except Exception as e:  # every rank votes, whatever failed on it
            if snapshot != "latest" or not agree_damage(comm, e):
                raise
            if i == len(candidates) - 1:
                if first is None:
                    raise
                raise first from e  # the newest snapshot's damage; e: the oldest one's
            first = first or e
            log.warning(
                "the latest snapshot %s of %s is damaged, loading the previous one (%s): %s",
                sid,
                storage.url,
                candidates[i + 1],
                e,
            )
    raise AssertionError("unreachable: the last candidate raises")


def is_damage(error: TrainsnapError) -> bool:
    """Whether a load failure on this rank is damage to the snapshot (or another rank's
    failure), the failures after which a load may fall back to an older snapshot. A lost rank
    is not: an older snapshot cannot load without it either."""
    if _lost_a_rank(error):
        return False
    return isinstance(error, CorruptError | IncompleteError | LoadFailedError)


def _lost_a_rank(error: BaseException | None) -> bool:
    """Whether ``error`` (or its cause chain) says a rank was lost: a ``PeerLost`` here, or a
    peer's failure record of that kind (the error of a step another rank saw fail)."""
    seen = 0
    while error is not None and seen < 16:  # the cause chain, bounded
        if isinstance(error, PeerLost):
            return True
        if isinstance(error, CommitFailedError | LoadFailedError) and any(
            f.kind == "PeerLost" for f in error.failures.values()
        ):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def agree_damage(comm: Comm, error: BaseException) -> bool:
    """Whether every rank's load failure is damage to the snapshot (corrupt or incomplete
    data, another rank's failure), decided alike on every rank: only then may a load fall back
    to an older snapshot. One vote (:func:`~trainsnap.protocol.collective.vote`); no vote when
    this rank saw a rank lost (the vote would wait for it in vain), and a vote that fails
    decides no fallback, so the load's own error is what every rank raises."""
    if _lost_a_rank(error):
        return False
    damage = isinstance(error, TrainsnapError) and is_damage(error)
    session = comm.session("fallback")
    try:
        return vote(comm, session, "damage", damage, _no_verdict)
    except TrainsnapError:
        return False
    finally:
        session.close()


def _no_verdict(ranks: RankErrors) -> TrainsnapError:
    return LoadFailedError("the ranks could not agree whether to fall back", rank_errors=ranks)


def _newest_first(storage: Storage, comm: Comm) -> list[str]:
    """(coordinator, shared) the committed snapshots' ids, newest first; NotFoundError when
    none."""

    def newest_first() -> list[str]:
        return [c.snapshot_id for c in reversed(commit.list_committed(storage))]

    def not_listed(ranks: RankErrors) -> TrainsnapError:
        return LoadFailedError(
            f"the coordinator could not list the snapshots of {storage.url}",
            path=storage.url,
            rank_errors=ranks,
        )

    session = comm.session("latest")
    try:
        ids = decide(comm, session, "candidates", newest_first, not_listed)
    finally:
        session.close()
    if not ids:
        by = comm.coordinator
        where = "" if comm.is_coordinator else f" (found by the coordinator, rank {by})"
        raise NotFoundError(
            f"no committed snapshot in {storage.url}; save one first, or check the root{where}",
            path=storage.url,
        )
    return ids


def _load_one(
    state: Any,
    storage: Storage,
    snapshot: str,
    comm: Comm,
    level: str,
    allow_downgrade: bool,
    allow_pickle: PickleKeys,
    prefetch: Prefetch | None = None,
) -> SnapshotInfo:
    """One snapshot's load on every rank, with its log line; ``prefetch`` as for
    :func:`~trainsnap.protocol.load_protocol.run_load`."""
    started = time.perf_counter()
    with paused_gc():  # tens of thousands of short-lived objects: see trainsnap.engine.gc_pause
        loaded = run_load(
            state,
            storage,
            snapshot,
            comm,
            level=level,
            allow_downgrade=allow_downgrade,
            allow_pickle=allow_pickle,
            prefetch=prefetch,
        )
    seconds = time.perf_counter() - started
    manifest, reached = loaded.manifest, loaded.level
    reasons = loaded.reasons if reached != "strict" else ()
    log.info(
        "loaded snapshot %s step=%d level=%s bytes_read=%d seconds=%.3f MBps=%.1f root=%s %s%s",
        manifest.snapshot_id,
        manifest.step,
        reached,
        loaded.bytes_read,
        seconds,
        loaded.bytes_read / max(seconds, 1e-9) / 1e6,
        storage.url,
        describe(loaded.components),
        f" not_higher_because={'; '.join(reasons)!r}" if reasons else "",
    )
    return SnapshotInfo.from_manifest(
        manifest, storage.url, level=reached, reasons=reasons, components=loaded.components
    )


def read(
    root: Root,
    snapshot: str = "latest",
    *,
    keys: str | Sequence[str] | None = None,
    rank: int | None = None,
    allow_pickle: PickleKeys = False,
    storage_options: Mapping[str, Any] | None = None,
) -> Any:
    """The saved state tree of a committed snapshot, exactly as it was saved, with no template:
    dicts, ``OrderedDict``s, lists and tuples with their key types and order, empty containers,
    None, plain values, and tensors on CPU assembled whole from their shards (a saved stateful
    object comes back as its ``state_dict()`` tree).

    ``keys`` limits the read to saved keys and everything under them (dotted prefixes, e.g.
    ``"model"`` or ``"optim.state"``): memory is what is asked. Per-rank entries (RNG, per-rank
    data state) are those of ``rank`` (default 0). One process reads; no process group is used.
    Snapshots older than format 4 (or imported) have no saved structure and read as a flat dict
    of dotted keys.
    """
    storage = open_storage(root, **dict(storage_options or {}))
    manifest = commit.open_snapshot(storage, commit.resolve(storage, snapshot))
    who = 0 if rank is None else rank
    if isinstance(who, bool) or not isinstance(who, int) or not 0 <= who < manifest.world_size:
        raise InvalidArgumentError(
            f"rank={rank!r}: snapshot {manifest.snapshot_id} was saved by "
            f"{manifest.world_size} rank(s); pass a rank in [0, {manifest.world_size})",
            snapshot_id=manifest.snapshot_id,
        )
    wanted = [keys] if isinstance(keys, str) else None if keys is None else list(keys)
    targets, out = tree_load.read_plan(manifest, wanted, who)
    reader = fill(storage, manifest, targets, who, allow_pickle=allow_pickle)
    log.info(
        "read snapshot %s step=%d keys=%s bytes_read=%d root=%s",
        manifest.snapshot_id,
        manifest.step,
        "all" if wanted is None else ",".join(wanted),
        reader.bytes_read,
        storage.url,
    )
    return out["tree"]


def delete(
    root: Root, snapshot_id: str, *, storage_options: Mapping[str, Any] | None = None
) -> None:
    """Delete a snapshot of ``root``: its marker first (from then on it is not committed and is
    never read), then its manifest. Its objects stay until a collection (``trainsnap gc``, or a
    manager's) finds them unreferenced, so deleting never breaks another snapshot that shares
    them. ``NotFoundError`` if ``root`` holds no such snapshot, committed or not.
    ``storage_options`` go to the store as for :func:`save`."""
    storage = open_storage(root, **dict(storage_options or {}))
    if snapshot_id not in commit.snapshot_ids(storage):
        raise NotFoundError(
            f"snapshot {snapshot_id} does not exist in {storage.url}; `trainsnap ls` lists the "
            "committed ones",
            snapshot_id=snapshot_id,
            path=storage.url,
        )
    commit.delete_snapshot(storage, snapshot_id)
    log.info("deleted snapshot %s of %s", snapshot_id, storage.url)


def list_snapshots(
    root: Root, *, storage_options: Mapping[str, Any] | None = None
) -> list[SnapshotInfo]:
    """Committed snapshots of ``root``, oldest step first. ``storage_options`` go to the store
    as for :func:`save`."""
    storage = open_storage(root, **dict(storage_options or {}))
    return [SnapshotInfo.from_marker(c.marker, storage.url) for c in commit.list_committed(storage)]
