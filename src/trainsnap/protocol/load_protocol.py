"""The load protocol across ranks (one process is the case of a world of one).

Every rank calls :func:`run_load`:

1. (coordinator) resolve which snapshot, so that ``"latest"`` means the same snapshot everywhere;
   broadcast it (or why there is none).
2. (coordinator) read the manifest, once for the job; (all ranks) receive the part of it their
   state needs (:mod:`trainsnap.protocol.manifest_share`).
3. (all ranks) plan the level (a :class:`~trainsnap.TrainState` decides what
   it can restore), read and verify what this rank's state needs, straight into it.
4. (coordinator) gather every rank's result; (all ranks) learn it: a load that failed anywhere
   raises everywhere, and step 5 is not run. Tensors were filled in place while reading, so a
   failed load leaves them partly or wholly filled: load again before using the state.
5. (all ranks) apply what was read (RNG, sampler cursors, objects with ``load_state_dict``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from typing import Any

from trainsnap import trace
from trainsnap.engine.reader import Reader
from trainsnap.errors import CommitFailedError, TrainsnapError
from trainsnap.format.manifest import Manifest, keys_summary
from trainsnap.format.values import PickleKeys
from trainsnap.protocol import commit, manifest_share, replica_reads, tree_load
from trainsnap.protocol.control_plane import Comm, PeerLost, Session
from trainsnap.protocol.outcome import decided, describe_error, told
from trainsnap.protocol.rank_load import fill, read_value
from trainsnap.protocol.replica_reads import Replicas
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
    chosen: str | None = None
    error: TrainsnapError | None = None
    if comm.is_coordinator:
        try:
            chosen = commit.resolve(storage, snapshot)
        except TrainsnapError as e:
            if comm.world_size == 1:
                raise
            error = e
    return str(decided(session.broadcast("snapshot", told(chosen, error)), error, comm.coordinator))


def _load_outcome(
    comm: Comm, session: Session, report: tuple[str | None, str, Any], left_out: list[str]
) -> dict[int, str]:
    """Every rank's (error, level reached, what its exact templates admitted) gathered on the
    coordinator; the ranks that failed (or disagree on the level), the same on every rank.

    A saved key that no rank admits -- no stage of a pipeline holds it: the model changed since
    the save -- fails the load on the coordinator. Such a key is among the coordinator's own
    ``left_out``; a rank that left nothing out reports nothing, any other the 8-byte digests of
    the keys it admitted (a pipeline stage: its own layers), not of those it left out (every
    other stage's)."""
    try:
        results = session.gather("loaded", report)
    except PeerLost as e:
        if comm.is_coordinator:  # the others learn who was lost, not that the coordinator left
            session.broadcast("load-outcome", dict(e.ranks))
        raise
    failed: dict[int, str] = {}
    if comm.is_coordinator:
        assert results is not None
        failed = {r: why for r, (why, _, _) in enumerate(results) if why is not None}
        levels = {lvl for why, lvl, _ in results if why is None}
        if len(levels) > 1:
            failed[comm.rank] = f"ranks reached different resume levels: {sorted(levels)}"
        names = _unadmitted(left_out, [took for why, _, took in results if why is None])
        if names and not failed:
            failed[comm.rank] = (
                f"no rank loads {len(names)} key(s) the snapshot holds ({keys_summary(names)}): "
                "the model lacks them on every rank; load into the configuration that was "
                "saved, or take what you need with ts.read"
            )
    out: dict[int, str] = session.broadcast("load-outcome", failed)
    return out


def _digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=8).digest()


def _unadmitted(left_out: list[str], reports: list[frozenset[bytes] | None]) -> list[str]:
    """The keys of ``left_out`` that no rank admitted (none when a rank left nothing out)."""
    if not left_out or any(r is None for r in reports):
        return []
    admitted = frozenset().union(*(r for r in reports if r is not None))
    return [k for k in left_out if _digest(k) not in admitted]


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
    with trace.span("open"):
        # Every rank raises the coordinator's failure here alike: no further agreement needed.
        m, sharing, share = manifest_share.manifest_for(storage, sid, state, comm, session)
        replicas = None
        if share:  # every rank, in the same order: the data group is made collectively
            group = replica_reads.data_group()
            if sharing:
                replicas = Replicas(sharing, comm.rank, group)
    error: TrainsnapError | None = None
    tree: Any = state
    reached, nread = level, 0
    left_out: list[str] = []
    admitted: list[str] = []
    reader = Reader(storage, m)  # one per load: each block is read and verified once
    try:
        if isinstance(state, TrainState):
            plan = state.plan_load(
                m,
                level,
                world_size=comm.world_size,
                allow_downgrade=allow_downgrade,
                read_value=lambda key: read_value(reader, key, comm.rank),
            )
            tree, reached = plan.tree, plan.level
        world = m.world_size
        with trace.span("read") as ev:
            same = world == comm.world_size
            alone = comm.world_size == 1
            wanted = (
                targets(tree)
                if m.tree is None
                else tree_load.plan(tree, m, comm.rank, same, alone=alone)
            )
            left_out, admitted = wanted.left_out, wanted.admitted
            fill(
                storage,
                m,
                wanted,
                comm.rank,
                allow_pickle=allow_pickle,
                same_world=same,
                replicas=replicas,
                reader=reader,
            )
            nread = ev["bytes"] = reader.bytes_read
        if isinstance(state, TrainState):
            state.check_loaded(tree)
    except TrainsnapError as e:
        if comm.world_size == 1:
            raise
        error = e
        if replicas is not None and not replicas.told:
            # Failed before reading: the replicas must not wait for this rank's share.
            with contextlib.suppress(TrainsnapError):  # a replica lost: its own error says so
                replica_reads.tell(replicas, e)
    took = frozenset(map(_digest, admitted)) if left_out else None
    report = (None if error is None else describe_error(error), reached, took)
    with trace.span("agree"):
        failed = _load_outcome(comm, session, report, left_out)
    if error is not None:
        raise error
    if failed:
        raise CommitFailedError(
            f"loading snapshot {sid} failed on {len(failed)} rank(s); the state of every rank "
            "is unusable until a load succeeds",
            snapshot_id=sid,
            rank_errors=failed,
        )
    if isinstance(state, TrainState):
        state.apply(tree)
    return m, reached, nread
