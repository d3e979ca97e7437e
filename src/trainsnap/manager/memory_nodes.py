"""Where the memory tier lives: nodes, their directories, partners, writer records.

Pure of torch.distributed: the ranks' placement is gathered once over the control plane
(:func:`gather_topology`) and everything else is derived from it alike on every rank.

A node's directory is ``<root>/<job>/node-<n>``: ``job`` is a digest of the durable root's URL,
so two jobs sharing a tmpfs never see each other's snapshots, and each node directory is a
complete trainsnap root (``objects/``, ``snapshots/<id>/manifest.bin`` and ``COMMITTED``), which
the ordinary load path reads. A rank reads and writes its own node's directory only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainsnap.errors import CommitFailedError, RankErrors, TrainsnapError
from trainsnap.manager.placement import node_from_environment
from trainsnap.protocol import commit
from trainsnap.protocol.collective import all_reduce
from trainsnap.protocol.control_plane import Comm
from trainsnap.storage.base import Storage

log = logging.getLogger(__name__)

RECORD_KEY = "memory/writer"
"""A node directory's writer record: the newest writer generation that took the node's memory
tier over, and the snapshots present when it did."""


def job_of(durable_url: str) -> str:
    """The job's name in the memory tier: a digest of its durable root's URL."""
    return hashlib.blake2b(durable_url.encode(), digest_size=8).hexdigest()


def node_directory(root: str | os.PathLike[str], job: str, node: int) -> Path:
    return Path(root) / job / f"node-{node}"


def this_node(node: int | None) -> int:
    """The node of this process: ``node`` if given, else
    :func:`~trainsnap.manager.placement.node_from_environment`."""
    if node is not None:
        return node
    return node_from_environment("MemoryTier(node=...)")


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


@dataclass(frozen=True, slots=True)
class Topology:
    """Every rank's node and local rank, and the partner rule. Derived tables are built once:
    a rank's exchanges cost O(nodes + its node's ranks), not O(world)."""

    nodes: tuple[int, ...]
    """Node of each rank."""
    locals: tuple[int, ...]
    """Local rank of each rank."""
    replicas: int
    domains: tuple[int, ...] | None = None
    coordinator: int = 0
    _by_node: dict[int, list[int]] = field(init=False, repr=False, compare=False)
    _ring: list[int] = field(init=False, repr=False, compare=False)
    _partners: dict[int, list[int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_node: dict[int, list[int]] = {}
        for rank, node in enumerate(self.nodes):
            by_node.setdefault(node, []).append(rank)
        for ranks in by_node.values():
            ranks.sort(key=self.locals.__getitem__)
        object.__setattr__(self, "_by_node", by_node)
        object.__setattr__(self, "_ring", sorted(by_node))
        object.__setattr__(self, "_partners", {})

    @property
    def ring(self) -> list[int]:
        """The nodes, in ring order."""
        return self._ring

    def ranks_on(self, node: int) -> list[int]:
        """The ranks of ``node``, by local rank."""
        return self._by_node[node]

    def leader(self, node: int) -> int:
        """The rank that writes a node's manifest and marker: the coordinator on its node."""
        if self.nodes[self.coordinator] == node:
            return self.coordinator
        return self._by_node[node][0]

    def _domain(self, node: int) -> int:
        if self.domains is None or node >= len(self.domains):
            return node
        return self.domains[node]

    def partners(self, node: int) -> list[int]:
        """The nodes that keep copies of ``node``'s objects: the next ``replicas`` nodes in
        ring order outside its failure domain, then (where too few are) the next ones in it."""
        found = self._partners.get(node)
        if found is None:
            ring = self._ring
            start = ring.index(node)
            apart: list[int] = []
            near: list[int] = []
            for i in range(1, len(ring)):
                other = ring[(start + i) % len(ring)]
                same = self._domain(other) == self._domain(node)
                (near if same else apart).append(other)
                if len(apart) == self.replicas:
                    break
            found = self._partners[node] = (apart + near)[: self.replicas]
        return found

    def peer(self, rank: int, node: int) -> int:
        """The rank of ``node`` that exchanges with ``rank``: the same local rank (modulo the
        node's size)."""
        ranks = self._by_node[node]
        return ranks[self.locals[rank] % len(ranks)]

    @property
    def copies(self) -> int:
        return min(1 + self.replicas, len(self._ring))

    def targets(self, rank: int) -> list[int]:
        """The ranks ``rank`` sends its objects to."""
        return [self.peer(rank, p) for p in self.partners(self.nodes[rank])]

    def sources(self, rank: int) -> list[int]:
        """The ranks that send their objects to ``rank``."""
        mine = self.nodes[rank]
        return [
            s
            for node in self._ring
            if mine in self.partners(node)
            for s in self._by_node[node]
            if self.peer(s, mine) == rank
        ]


def gather_topology(
    comm: Comm, node: int, replicas: int, domains: Sequence[int] | None, generation: int | None
) -> tuple[Topology, int]:
    """(all ranks, at the same point) every rank's node and local rank; the coordinator's
    writer generation. One gather and one broadcast on the control plane."""
    mine = (node, local_rank())

    def decided(said: list[tuple[int, int]]) -> tuple[list[int], list[int], int]:
        return [n for n, _ in said], [lr for _, lr in said], generation or 0

    def failed(ranks: RankErrors) -> TrainsnapError:
        return CommitFailedError(
            f"the memory tier's topology could not be learned: {len(ranks)} rank(s) failed",
            rank_errors=ranks,
        )

    session = comm.session("memory-topology")
    try:
        nodes, locals_, gen = all_reduce(comm, session, "where", lambda: mine, decided, failed)
    finally:
        session.close()
    doms = tuple(domains) if domains is not None else None
    topology = Topology(tuple(nodes), tuple(locals_), replicas, doms, comm.coordinator)
    return topology, int(gen)


# -- the writer record -----------------------------------------------------------------------------


def read_record(storage: Storage) -> dict[str, Any] | None:
    try:
        doc = json.loads(storage.get(RECORD_KEY))
    except FileNotFoundError:
        return None
    except ValueError:
        log.warning("the memory tier's writer record in %s is unreadable: replaced", storage.url)
        return None
    return doc if isinstance(doc, dict) else None


def take_over(storage: Storage, job: str, generation: int) -> set[str]:
    """(one rank per node, at start) Record that ``generation`` now writes this node's memory
    tier, with the committed snapshots present; returns them. ``CommitFailedError`` when a newer
    generation has taken it over (this job was superseded)."""
    record = read_record(storage)
    if record is not None and int(record.get("generation", 0)) > generation:
        raise CommitFailedError(
            f"the memory tier {storage.url} was taken over by writer generation "
            f"{record.get('generation')}, newer than this job's ({generation}): a newer job "
            "runs; stop this process"
        )
    committed = commit.list_committed(storage)
    present = {c.snapshot_id for c in committed}
    if record is not None:
        # Only what the previous generation could restore: a superseded writer's marker that
        # landed after that generation took over stays refused by every later one.
        previous, trusted = int(record.get("generation", 0)), set(record.get("present", ()))
        present = {
            c.snapshot_id
            for c in committed
            if not refusal(c.marker.writer, job, previous, trusted, c.snapshot_id)
        }
        if previous == generation:
            present |= trusted
    doc = {"job": job, "generation": generation, "present": sorted(present)}
    storage.put(RECORD_KEY, json.dumps(doc).encode())
    return present


def check_writer(storage: Storage, generation: int) -> None:
    """Raise ``CommitFailedError`` unless ``generation`` is still the newest writer of this node's
    memory tier (asked before each marker)."""
    record = read_record(storage)
    newest = int(record.get("generation", 0)) if record else 0
    if newest > generation:
        raise CommitFailedError(
            f"this writer (generation {generation}) was superseded by generation {newest} on the "
            f"memory tier {storage.url}: the snapshot is not committed there; stop this process"
        )


def refusal(marker_writer: Any, job: str, generation: int, present: set[str], sid: str) -> str:
    """Why a memory snapshot must not be restored ('' when it may be): another job's, or an
    older writer generation's written after a newer one took over (not among ``present``)."""
    writer = marker_writer if isinstance(marker_writer, dict) else {}
    if writer.get("job") != job:
        return f"written by another job ({writer.get('job')!r}, this job is {job!r})"
    written_by = writer.get("generation")
    if not isinstance(written_by, int) or isinstance(written_by, bool):
        return "its marker names no writer generation"
    if written_by > generation:
        return f"written by writer generation {written_by}, newer than this job's {generation}"
    if written_by < generation and sid not in present:
        return (
            f"written by writer generation {written_by} after generation {generation} took the "
            "memory tier over (a superseded job kept writing)"
        )
    return ""


def shortfall(topology: Topology, said: list[Any], keep: int, directory: str) -> str:
    """(coordinator) '' when every node's tmpfs holds its footprint, else the refusal.
    ``said``: (bytes this rank writes, bytes free or held in its node's directory) by rank. The
    footprint of a node: its ranks' bytes plus the copies it keeps of its partners', times
    ``keep + 1`` (the kept snapshots and the one in flight)."""
    own: dict[int, int] = {}
    room: dict[int, int] = {}
    for rank, (nbytes, free) in enumerate(said):
        node = topology.nodes[rank]
        own[node] = own.get(node, 0) + int(nbytes)
        room[node] = int(free)
    for node in topology.ring:
        copies = sum(own[n] for n in topology.ring if node in topology.partners(n))
        need = (own[node] + copies) * (keep + 1)
        if need > room[node]:
            return (
                f"the memory tier of node {node} cannot hold its snapshots: it needs {need} "
                f"bytes ({own[node]} of its ranks' state + {copies} of its partners' copies, "
                f"x {keep + 1} for keep={keep} plus one in flight) and {room[node]} are free "
                f"or held by the snapshots they replace in its directory (this node's: "
                f"{directory}). Fix: give the tmpfs more room (mount -o remount,size=...), "
                "lower MemoryTier(keep=) or (replicas=), or point MemoryTier(root=) at a "
                "larger RAM-backed directory"
            )
    return ""
