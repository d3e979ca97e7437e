"""The memory tier as a :class:`~trainsnap.manager.tiers.Tier`: each node's ranks save into the
node's tmpfs directory, copies go to partner nodes, and only then is the snapshot committed
there (:mod:`trainsnap.manager.memory_commit`).

A memory save is an ordinary save of the manager (one capture, one staging into the manager's
staging pool, on the manager's one saver) whose committer is the tier's
:class:`~trainsnap.manager.memory_commit.ReplicatedCommit` and whose storage is this node's
directory. The saver runs it alone (no other save in flight), so the checkpoint-data group
carries one save at a time, in the same order on every rank.

What the tier adds to a disk tier:

* a topology (which node each rank is on, its partners: :mod:`trainsnap.manager.memory_nodes`)
  and a writer generation, learned once by :meth:`MemorySaves.start`;
* a writer record per node directory: a newer job takes the node over, a superseded one can no
  longer commit there, and another job's snapshots are never restored;
* retention per node, by its leader once a snapshot is committed on every node: the ordinary
  retention policies (``KeepLast(keep)``) with the snapshots waiting for promotion pinned;
* a restore that first fetches from partner nodes what this node lacks
  (:mod:`trainsnap.manager.memory_restore`).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from typing import Any

from trainsnap.errors import TrainsnapError
from trainsnap.format.manifest import object_key
from trainsnap.manager import collection, lease
from trainsnap.manager.memory_commit import ReplicatedCommit
from trainsnap.manager.memory_nodes import (
    Topology,
    check_writer,
    gather_topology,
    job_of,
    node_directory,
    refusal,
    take_over,
    this_node,
)
from trainsnap.manager.options import MemoryTier
from trainsnap.manager.placement import check_copies
from trainsnap.manager.policies import KeepLast, Retention, SavePolicy, as_save_policies, to_delete
from trainsnap.manager.tiers import candidate
from trainsnap.protocol import commit
from trainsnap.protocol.collective import all_reduce
from trainsnap.protocol.commit import Committer
from trainsnap.protocol.control_plane import Comm, LocalComm, PeerLost, StoreComm
from trainsnap.storage import open_storage
from trainsnap.storage.base import Storage

log = logging.getLogger(__name__)

_seq = itertools.count(1)


def _side_comm(comm: Comm, name: str) -> Comm:
    """A control plane of its own (own session numbering) for a thread of the memory tier."""
    if isinstance(comm, StoreComm):
        return StoreComm(
            comm.store,
            comm.rank,
            comm.world_size,
            coordinator=comm.coordinator,
            timeouts=comm.timeouts,
            namespace=name,
        )
    return LocalComm()


class MemorySaves:
    """One rank's memory tier (module docstring): a :class:`~trainsnap.manager.tiers.Tier`."""

    name = "memory"

    def __init__(self, options: MemoryTier, durable: Storage, comm: Comm) -> None:
        self.options = options
        self.comm = comm
        self.job = job_of(durable.url)
        self.node = this_node(options.node)
        self.directory = node_directory(options.root, self.job, self.node)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.storage: Storage = open_storage(str(self.directory))
        self.policies: list[SavePolicy] = as_save_policies(options.interval)
        self.retention: list[Retention] = [KeepLast(options.keep)]
        self.lease: lease.Lease | None = None
        """None: a node directory is taken over through its writer record, not a lease."""
        prefix = f"trainsnap-memory-{next(_seq)}"
        self.save_comm = _side_comm(comm, f"{prefix}/save")
        """The control plane of the save thread's steps (the commit's votes)."""
        self.promote_comm = _side_comm(comm, f"{prefix}/promote")
        """The control plane of the background worker's steps (promotions)."""
        self.committer: Committer = ReplicatedCommit(self)
        self.topology: Topology | None = None
        self.generation = 0
        self.present: set[str] = set()
        self.newest: str | None = None
        self.newest_step: int | None = None
        self.skipped = 0
        """Memory steps whose save was skipped because the previous one was in flight."""
        self.saved = 0
        self._pinned: set[str] = set()
        self._objects: OrderedDict[str, dict[str, int]] = OrderedDict()
        self._lock = threading.Lock()

    # -- start ------------------------------------------------------------------------------

    def start(self, generation: int | None) -> None:
        """(all ranks, once, before the first restore or save) learn the placement of every
        rank and the writer generation; take this node's directory over."""
        if self.topology is not None:
            return
        o = self.options
        self.topology, self.generation = gather_topology(
            self.comm, self.node, o.replicas, o.domains, generation
        )
        nodes = len(set(self.topology.nodes))
        check_copies(nodes, o.replicas, allow_fewer_copies=o.allow_fewer_copies)
        if self.is_leader:
            self.present = take_over(self.storage, self.job, self.generation)

    @property
    def is_leader(self) -> bool:
        assert self.topology is not None
        return self.topology.leader(self.node) == self.comm.rank

    def fence(self) -> None:
        return None  # the writer record is checked before each marker: check_writer

    def check_writer(self) -> None:
        """(node leader) ``CommitFailedError`` unless this job's generation still writes this
        node's directory (asked by the commit before the marker)."""
        check_writer(self.storage, self.generation)

    def release(self) -> None:
        return None

    # -- the objects of this rank's snapshots -----------------------------------------------

    def wrote(self, snapshot_id: str, objects: dict[str, int]) -> None:
        """(all ranks, at each commit) what this rank wrote or reused for the snapshot, kept
        for its promotion (the newest few only)."""
        with self._lock:
            self._objects[snapshot_id] = objects
            while len(self._objects) > 2 * self.options.keep + 8:
                self._objects.popitem(last=False)
        self.saved += 1

    def objects(self, snapshot_id: str) -> dict[str, int]:
        with self._lock:
            return dict(self._objects.get(snapshot_id, {}))

    def pin(self, snapshot_id: str) -> None:
        """Keep ``snapshot_id`` from retention until :meth:`unpin` (a promotion waits)."""
        with self._lock:
            self._pinned.add(snapshot_id)

    def unpin(self, snapshot_id: str) -> None:
        with self._lock:
            self._pinned.discard(snapshot_id)

    def has(self, name: str, size: int) -> bool:
        try:
            return self.storage.stat(object_key(name)) == size
        except FileNotFoundError:
            return False

    def read(self, name: str) -> bytes:
        return self.storage.get(object_key(name))

    def write(self, name: str, data: memoryview) -> None:
        self.storage.put(object_key(name), data)

    # -- retention ----------------------------------------------------------------------------

    def apply_retention(self, protected: frozenset[str] = frozenset()) -> list[str]:
        """(node leader) What the retention policies do not keep, never the newest nor a
        pinned snapshot; then what no kept snapshot references. Costs one marker read per
        committed snapshot of the node (``keep + 1``), and the collection of what was deleted."""
        if self.topology is None or not self.is_leader:
            return []
        with self._lock:
            pinned = self._pinned | protected
        cands = [candidate(c) for c in commit.list_committed(self.storage)]
        doomed = to_delete(cands, self.retention, protected=set(pinned))
        for c in doomed:
            commit.delete_snapshot(self.storage, c.id)
        if doomed:
            collection.collect(self.storage, grace=None)
        return [c.id for c in doomed]

    def retain(self) -> None:
        """(node leader, no save in flight anywhere, from the commit) :meth:`apply_retention`;
        a failure is logged: it costs room, not a snapshot."""
        try:
            self.apply_retention()
        except (OSError, TrainsnapError) as e:
            log.warning("retention of the memory tier %s failed: %s", self.storage.url, e)

    # -- restore ------------------------------------------------------------------------------

    def candidates(self) -> list[tuple[str, tuple[int, str]]]:
        """(all ranks) The memory snapshots committed on some node that this job may restore,
        newest first, as (id, (step, created)); the same list on every rank."""
        mine: list[tuple[str, int, str]] = []
        if self.is_leader:
            for c in commit.list_committed(self.storage):
                why = refusal(
                    c.marker.writer, self.job, self.generation, self.present, c.snapshot_id
                )
                if why:
                    log.warning("memory snapshot %s is not restored: %s", c.snapshot_id, why)
                    continue
                mine.append((c.snapshot_id, c.step, str(c.marker.summary.get("created", ""))))

        def newest_first(said: list[list[tuple[str, int, str]]]) -> list[Any]:
            by_id = {sid: (step, created) for held in said for sid, step, created in held}
            return sorted(by_id.items(), key=lambda kv: kv[1], reverse=True)

        session = self.comm.session("memory-candidates")
        try:
            decided = all_reduce(
                self.comm,
                session,
                "held",
                lambda: mine,
                newest_first,
                lambda ranks: PeerLost("listing the memory snapshots failed", ranks),
            )
        finally:
            session.close()
        return [(sid, (int(key[0]), str(key[1]))) for sid, key in decided]

    def prepare_restore(self, snapshot_id: str) -> Storage:
        """The node directory: :mod:`trainsnap.manager.memory_restore` fetches into it."""
        return self.storage
