"""The load protocol across ranks (one process is the case of a world of one).

Every rank calls :func:`run_load`:

1. (coordinator) resolve which snapshot, so that ``"latest"`` means the same snapshot everywhere;
   broadcast it (or why there is none).
2. (all ranks) open the snapshot, plan the level (a :class:`~trainsnap.TrainState` decides what
   it can restore), read and verify what this rank's state needs, straight into it.
3. (coordinator) gather every rank's result; (all ranks) learn it: a load that failed anywhere
   raises everywhere, and step 4 is not run. Tensors were filled in place while reading, so a
   failed load leaves them partly or wholly filled: load again before using the state.
4. (all ranks) apply what was read (RNG, sampler cursors, objects with ``load_state_dict``).
"""

from __future__ import annotations

import logging
from typing import Any

from trainsnap import errors, trace
from trainsnap.errors import CommitFailedError, TrainsnapError
from trainsnap.format.manifest import Manifest
from trainsnap.format.values import PickleKeys
from trainsnap.protocol import commit, tree_load
from trainsnap.protocol.control_plane import Comm, Session
from trainsnap.protocol.outcome import describe_error
from trainsnap.protocol.rank_load import fill, read_value
from trainsnap.state.capture import targets
from trainsnap.state.train_state import TrainState
from trainsnap.storage.base import Storage

log = logging.getLogger("trainsnap.save")
load_log = logging.getLogger("trainsnap.load")


def run_load(
    state: Any,
    storage: Storage,
    snapshot: str,
    comm: Comm,
    *,
    level: str,
    allow_downgrade: bool,
    allow_pickle: PickleKeys,
) -> tuple[Manifest, str, int]:
    """Load on every rank; returns (manifest, level reached, bytes read on this rank)."""
    session = comm.session("load")
    try:
        return _load(state, storage, snapshot, comm, session, level, allow_downgrade, allow_pickle)
    finally:
        session.close()


def _resolve(storage: Storage, snapshot: str, comm: Comm, session: Session) -> str:
    """(coordinator) which snapshot: "latest" must mean the same snapshot on every rank."""
    chosen: tuple[str | None, str, str] = (None, "", "")
    if comm.is_coordinator:
        try:
            chosen = (commit.resolve(storage, snapshot), "", "")
        except TrainsnapError as e:
            if comm.world_size == 1:
                raise
            chosen = (None, type(e).__name__, e.message)
    sid, kind, why = session.broadcast("snapshot", chosen)
    if sid is None:
        cls = getattr(errors, kind, TrainsnapError)
        raise cls(f"{why} (decided by the coordinator, rank {comm.coordinator})")
    return str(sid)


def _load_outcome(comm: Comm, session: Session, report: tuple[str | None, str]) -> dict[int, str]:
    """Every rank's (error, level reached) gathered on the coordinator; the ranks that failed
    (or disagree on the level), the same on every rank."""
    results = session.gather("loaded", report)
    failed: dict[int, str] = {}
    if comm.is_coordinator:
        assert results is not None
        failed = {r: why for r, (why, _) in enumerate(results) if why is not None}
        levels = {lvl for why, lvl in results if why is None}
        if len(levels) > 1:
            failed[comm.rank] = f"ranks reached different resume levels: {sorted(levels)}"
    out: dict[int, str] = session.broadcast("load-outcome", failed)
    return out


def _load(
    state: Any,
    storage: Storage,
    snapshot: str,
    comm: Comm,
    session: Session,
    level: str,
    allow_downgrade: bool,
    allow_pickle: PickleKeys,
) -> tuple[Manifest, str, int]:
    with trace.span("resolve"):
        sid = _resolve(storage, snapshot, comm, session)
    error: TrainsnapError | None = None
    m: Manifest | None = None
    tree: Any = state
    reached, nread = level, 0
    try:
        with trace.span("open"):
            m = commit.open_snapshot(storage, sid)
        if isinstance(state, TrainState):
            plan = state.plan_load(
                m,
                level,
                world_size=comm.world_size,
                allow_downgrade=allow_downgrade,
                read_value=lambda key: read_value(storage, m, key, comm.rank),
            )
            tree, reached = plan.tree, plan.level
        world = m.world_size
        with trace.span("read") as ev:
            same = world == comm.world_size
            wanted = targets(tree) if m.tree is None else tree_load.plan(tree, m, comm.rank, same)
            reader = fill(
                storage,
                m,
                wanted,
                comm.rank,
                allow_pickle=allow_pickle,
                same_world=same,
            )
            nread = ev["bytes"] = reader.bytes_read
        if isinstance(state, TrainState):
            state.check_loaded(tree)
    except TrainsnapError as e:
        if comm.world_size == 1:
            raise
        error = e
    report = (None if error is None else describe_error(error), reached)
    with trace.span("agree"):
        failed = _load_outcome(comm, session, report)
    if error is not None:
        raise error
    if failed:
        raise CommitFailedError(
            f"loading snapshot {sid} failed on {len(failed)} rank(s); the state of every rank "
            "is unusable until a load succeeds",
            snapshot_id=sid,
            rank_errors=failed,
        )
    assert m is not None
    if isinstance(state, TrainState):
        state.apply(tree)
    return m, reached, nread
