"""The load protocol across ranks (one process is the case of a world of one).

Every rank calls :func:`run_load`:

1. (coordinator) resolve which snapshot, so that ``"latest"`` means the same snapshot everywhere;
   broadcast it (or why there is none).
2. (coordinator) read the manifest, once for the job; (all ranks) receive the part of it their
   state needs (:mod:`trainsnap.protocol.manifest_share`). With a ``prefetch`` hook, every rank
   then hands that part to it (the memory tier fetches the objects it names that its node
   lacks), before anything is read.
3. (all ranks) plan: the state's load target (:mod:`trainsnap.state.load_target`), given the
   manifest and the plain values it needs, says what it restores and at which level; read and
   verify what this rank's state needs, straight into it; the target checks what was read.
4. (coordinator) gather every rank's result; (all ranks) learn it: a load that failed anywhere
   raises everywhere, and step 5 is not run. Tensors were filled in place while reading, so a
   failed load leaves them partly or wholly filled: load again before using the state.
5. (all ranks) the target applies what was read (RNG, sampler cursors, objects with
   ``load_state_dict``).

The state is walked once for all of it (:class:`_Template`, :mod:`trainsnap.state.template`):
what a rank wants in step 2, the plan, the reads and the fill in step 3 read the walked nodes.
The protocol never asks what kind of state it holds: the target answers every such question.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

from trainsnap import trace
from trainsnap.engine.reader import Reader
from trainsnap.errors import LoadFailedError, RankErrors, TrainsnapError
from trainsnap.format.manifest import Manifest, keys_summary
from trainsnap.format.manifest_part import Wants
from trainsnap.format.values import PickleKeys
from trainsnap.protocol import commit, manifest_share, replica_reads, tree_load
from trainsnap.protocol.collective import all_reduce
from trainsnap.protocol.control_plane import Comm, Session
from trainsnap.protocol.rank_load import fill, read_value
from trainsnap.protocol.replica_reads import Replicas
from trainsnap.state.capture import check_root
from trainsnap.state.load_target import Component, LoadTarget
from trainsnap.state.template import Node, Walker, targets_of
from trainsnap.state.train_state import target_of
from trainsnap.storage.base import Storage

Prefetch = Callable[[Manifest], None]
"""A hook given the part of the manifest a rank's load needs, before it reads (see
:func:`run_load`)."""


class Loaded(NamedTuple):
    """What a load gave this rank."""

    manifest: Manifest
    level: str
    """The resume level reached."""
    bytes_read: int
    """Bytes this rank read (manifest parts not included)."""
    reasons: tuple[str, ...] = ()
    """Why the level reached is not higher."""
    components: tuple[Component, ...] = ()
    """Each component of the state, restored or not and why (the target's plan)."""


def run_load(
    state: Any,
    storage: Storage,
    snapshot: str,
    comm: Comm,
    *,
    level: str,
    allow_downgrade: bool,
    allow_pickle: PickleKeys,
    prefetch: Prefetch | None = None,
) -> Loaded:
    """Load on every rank; raises the load's failure on every rank when any rank failed.

    ``prefetch(part)``, when given, is called on every rank between steps 2 and 3 with the part
    of the manifest this rank's state needs (the whole manifest in a world of one): a tier
    that must bring objects to this rank's storage first does it there, from the manifest the
    load decoded and the wants its walk gave, so neither is done twice. It runs on every rank
    in the same order, so it may be collective; its failure must be raised alike on every rank
    (through :mod:`trainsnap.protocol.collective`), since no later step of the load is reached."""
    session = comm.session("load")
    try:
        return _load(
            state, storage, snapshot, comm, session, level, allow_downgrade, allow_pickle, prefetch
        )
    finally:
        session.close()


def _resolve(storage: Storage, snapshot: str, comm: Comm, session: Session) -> str:
    """(coordinator) which snapshot: "latest" must mean the same snapshot on every rank."""
    resolve = partial(_resolved, storage, snapshot)
    return str(all_reduce(comm, session, "snapshot", None, resolve, _lost_coordinator))


def _resolved(storage: Storage, snapshot: str, _parts: list[None]) -> str:
    return commit.resolve(storage, snapshot)


def _lost_coordinator(ranks: RankErrors) -> TrainsnapError:
    return LoadFailedError("the coordinator could not resolve the snapshot", rank_errors=ranks)


def _outcome(left_out: list[str], rank: int, results: list[_Loaded]) -> dict[int, str]:
    """(coordinator) The ranks that cannot finish the load, from every rank's level reached and
    what its exact templates admitted: none when all is well.

    A saved key that no rank admits -- no stage of a pipeline holds it: the model changed since
    the save -- fails the load on the coordinator. Such a key is among the coordinator's own
    ``left_out``; a rank that left nothing out reports nothing, any other the 8-byte digests of
    the keys it admitted (a pipeline stage: its own layers), not of those it left out (every
    other stage's)."""
    failed: dict[int, str] = {}
    levels = {r.level for r in results}
    if len(levels) > 1:
        failed[rank] = f"ranks reached different resume levels: {sorted(levels)}"
    names = _unadmitted(left_out, [r.admitted for r in results])
    if names and not failed:
        failed[rank] = (
            f"no rank loads {len(names)} key(s) the snapshot holds ({keys_summary(names)}): "
            "the model lacks them on every rank; load into the configuration that was "
            "saved, or take what you need with ts.read"
        )
    return failed


def _digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=8).digest()


def _unadmitted(left_out: list[str], reports: list[frozenset[bytes] | None]) -> list[str]:
    """The keys of ``left_out`` that no rank admitted (none when a rank left nothing out)."""
    if not left_out or any(r is None for r in reports):
        return []
    admitted = frozenset().union(*(r for r in reports if r is not None))
    return [k for k in left_out if _digest(k) not in admitted]


@dataclass(slots=True)
class _Loaded:
    """A rank's part of the load's outcome."""

    level: str
    """The resume level the rank's read reached."""
    admitted: frozenset[bytes] | None
    """Digests of the saved keys its exact templates admitted; None when it left none out."""


@dataclass(slots=True)
class _Template:
    """This rank's state as its load sees it, walked once: the nodes say what the rank wants
    (step 2) and are what the plan, the reads and the fill use (step 3)."""

    target: LoadTarget
    walker: Walker = field(default_factory=Walker)
    _walked: tuple[Any, Node] | None = None

    def walked(self, obj: Any) -> Node:
        """The node of ``obj`` (the state, or the tree its target plans), walked once."""
        if self._walked is None or self._walked[0] is not obj:
            check_root(obj)
            self._walked = (obj, self.walker.walk(obj))
        return self._walked[1]

    def wants(self) -> Wants | None:
        """Step 2: what this rank's state may read (None: it cannot say; its plan will)."""
        try:
            wanted = self.target.wants()
            return manifest_share.wants_of(self.walked(wanted.tree), wanted.tops)
        except TrainsnapError:
            return None


def state_wants(state: Any) -> Wants | None:
    """What a load of ``state`` may read, as its step 2 says it (None: it cannot say), for a
    caller that must know before the load. A walk of the state of its own: O(the state's
    nodes); a load with a ``prefetch`` hook is given the same without a second walk."""
    return _Template(target_of(state)).wants()


@dataclass(slots=True)
class _Read:
    """One rank's read: its reader, and what the read made."""

    template: _Template
    reader: Reader
    tree: Any = None
    reached: str = ""
    reasons: tuple[str, ...] = ()
    components: tuple[Component, ...] = ()
    nread: int = 0
    left_out: list[str] = field(default_factory=list)


def _read(
    read: _Read,
    comm: Comm,
    level: str,
    allow_downgrade: bool,
    allow_pickle: PickleKeys,
    replicas: Replicas | None,
) -> _Loaded:
    """Step 3 (all ranks): plan the level, read and verify straight into the state."""
    template, reader, m = read.template, read.reader, read.reader.m
    target = template.target
    needed = [k for k in target.needs(m) if m.find_value(k, comm.rank) is not None]
    values = {key: read_value(reader, key, comm.rank) for key in needed}
    plan = target.plan(
        m, level, values, world_size=comm.world_size, allow_downgrade=allow_downgrade
    )
    read.tree, read.reached = plan.tree, plan.level
    read.reasons, read.components = tuple(plan.reasons), tuple(plan.components)
    with trace.span("read") as ev:
        same = m.world_size == comm.world_size
        alone = comm.world_size == 1
        walked = template.walked(read.tree)
        wanted = (
            targets_of(walked)
            if m.tree is None
            else tree_load.plan(walked, m, comm.rank, same, alone=alone, skip=plan.left_out)
        )
        read.left_out = wanted.left_out
        fill(
            reader.storage,
            m,
            wanted,
            comm.rank,
            allow_pickle=allow_pickle,
            same_world=same,
            replicas=replicas,
            reader=reader,
        )
        read.nread = ev["bytes"] = reader.bytes_read
    target.check(read.tree)
    took = frozenset(map(_digest, wanted.admitted)) if wanted.left_out else None
    return _Loaded(read.reached, took)


def _load(
    state: Any,
    storage: Storage,
    snapshot: str,
    comm: Comm,
    session: Session,
    level: str,
    allow_downgrade: bool,
    allow_pickle: PickleKeys,
    prefetch: Prefetch | None,
) -> Loaded:
    with trace.span("resolve"):
        sid = _resolve(storage, snapshot, comm, session)
    with trace.span("open"):
        # Every rank raises the coordinator's failure here alike: no further agreement needed.
        template = _Template(target_of(state))
        m, sharing, share = manifest_share.manifest_for(storage, sid, template.wants, comm, session)
        replicas = None
        if share:  # every rank, in the same order: the data group is made collectively
            group = replica_reads.data_group()
            if sharing:
                replicas = Replicas(sharing, comm.rank, group)
    if prefetch is not None:
        with trace.span("prefetch"):
            prefetch(m)
    read = _Read(template, Reader(storage, m))  # one reader: each block read and verified once

    def local() -> _Loaded:
        try:
            return _read(read, comm, level, allow_downgrade, allow_pickle, replicas)
        except TrainsnapError as e:
            if comm.world_size > 1 and replicas is not None and not replicas.told:
                # Failed before reading: the replicas must not wait for this rank's share.
                with contextlib.suppress(TrainsnapError):  # a replica lost: its own error says so
                    replica_reads.tell(replicas, e)
            raise

    def failure(ranks: RankErrors) -> TrainsnapError:
        return LoadFailedError(
            f"loading snapshot {sid} failed on {len(ranks)} rank(s); the state of every rank "
            "is unusable until a load succeeds",
            snapshot_id=sid,
            rank_errors=ranks,
        )

    def reduce(results: list[_Loaded]) -> dict[int, str] | None:
        return _outcome(read.left_out, comm.rank, results) or None

    failed = all_reduce(comm, session, "loaded", local, reduce, failure)
    if failed:
        raise failure(failed)
    template.target.apply(read.tree)
    return Loaded(m, read.reached, read.nread, read.reasons, read.components)
