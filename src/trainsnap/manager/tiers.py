"""Tiers: the roots a manager saves to, one protocol for all of them (:class:`Tier`), and the
local tier that survives the loss of one node.

A manager composes a list of tiers, fastest first: the memory tier
(:class:`~trainsnap.manager.memory_tier.MemorySaves`), the local disk tier and the durable root
(:class:`DiskTier`). Each has its storage, its save interval, its retention policies, its lease
and its committer (:class:`~trainsnap.protocol.commit.Committer`: direct for a disk tier,
replicated for the memory tier), and says what a restore from it needs first
(:meth:`Tier.prepare_restore`). Which tier saves a step and which get it by promotion is
:mod:`trainsnap.manager.schedule`'s rule; promotion is :func:`trainsnap.manager.promotion.promote`.

:class:`NodeTier` is the local tier of a job whose nodes each have their own root. A rank writes
its objects to its node's root and, with ``partner=True``, to the next node's root too;
snapshot files (manifest, marker), leases and events go to every node's root. Reads look in this
node's root first, then in the others; listings are the union. So after losing one node, the
surviving roots still hold every object and every manifest: the local tier still restores.

"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from trainsnap.errors import InvalidArgumentError
from trainsnap.manager import lease
from trainsnap.manager.placement import node_from_environment
from trainsnap.manager.policies import Candidate, Retention, SavePolicy, to_delete
from trainsnap.protocol import commit
from trainsnap.protocol.commit import DIRECT, Committer
from trainsnap.storage import open_storage
from trainsnap.storage.base import Buffer, Storage

log = logging.getLogger(__name__)


class NodeTier:
    """One node's view of a local tier spread over per-node roots."""

    readinto_is_zero_copy = False

    def __init__(self, roots: Sequence[Storage], node: int, *, partner: bool = True) -> None:
        if not roots or not 0 <= node < len(roots):
            raise InvalidArgumentError(
                f"node {node} outside the {len(roots)} node roots: LocalTier(node=) must be "
                f"0 to {len(roots) - 1}, or unset to take GROUP_RANK, else NODE_RANK"
            )
        self.roots = list(roots)
        self.node = node
        self.partner = partner and len(roots) > 1
        self.url = roots[node].url

    def __repr__(self) -> str:
        return f"NodeTier(node={self.node}, roots={[r.url for r in self.roots]})"

    def _writes(self, key: str) -> list[Storage]:
        if key.startswith("objects/"):
            mine = [self.roots[self.node]]
            if self.partner:
                mine.append(self.roots[(self.node + 1) % len(self.roots)])
            return mine
        return self.roots  # small and needed by whoever restores: everywhere

    def _reads(self) -> list[Storage]:
        return [self.roots[self.node], *(r for i, r in enumerate(self.roots) if i != self.node)]

    def _first(self, operation: str, key: str, fn: object) -> object:
        missing: Exception | None = None
        for root in self._reads():
            try:
                return fn(root)  # type: ignore[operator]
            except FileNotFoundError as e:
                missing = e
            except OSError as e:  # a lost node: its root is gone or unreachable
                missing = e
        raise FileNotFoundError(f"{operation} {key}: not in any node root ({missing})")

    def put(self, key: str, data: Buffer | Sequence[Buffer]) -> None:
        for root in self._writes(key):
            root.put(key, data)

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        out: bytes = self._first("get", key, lambda r: r.get(key, start, end))  # type: ignore[assignment]
        return out

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        self._first("read", key, lambda r: r.read_into(key, start, out))

    def stat(self, key: str) -> int:
        size: int = self._first("stat", key, lambda r: r.stat(key))  # type: ignore[assignment]
        return size

    def mtime(self, key: str) -> float:
        t: float = self._first("mtime", key, lambda r: r.mtime(key))  # type: ignore[assignment]
        return t

    def list(self, prefix: str) -> Iterator[str]:
        seen: set[str] = set()
        for root in self._reads():
            try:
                keys = list(root.list(prefix))
            except OSError:
                continue
            for k in keys:
                if k not in seen:
                    seen.add(k)
                    yield k

    def delete(self, key: str) -> None:
        for root in self.roots:
            try:
                root.delete(key)
            except OSError:
                continue

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        if not self.roots[0].put_if_absent(key, data):
            return False
        for root in self.roots[1:]:
            root.put(key, data)
        return True

    def refresh(self, key: str, data: Buffer | Sequence[Buffer]) -> None:
        for root in self._writes(key):
            try:
                root.refresh(key, data)
            except FileNotFoundError:
                root.put(key, data)  # the partner lost its copy: restore it


# -- the tiers a manager writes -------------------------------------------------------------------


def candidate(cap: commit.Committed) -> Candidate:
    s = cap.marker.summary
    return Candidate(
        cap.snapshot_id, cap.step, dict(s.get("metrics", {})), tuple(s.get("tags", ()))
    )


class Tier(Protocol):
    """One root the manager saves to (module docstring)."""

    name: str
    """``"memory"``, ``"local"`` or ``"durable"``: what the restart log and history say."""
    storage: Storage
    """Where this rank reads and writes the tier (a node's view of it for a per-node tier)."""
    policies: list[SavePolicy]
    """When the tier wants a snapshot (its interval)."""
    retention: list[Retention]
    committer: Committer
    lease: lease.Lease | None
    newest: str | None
    newest_step: int | None

    def start(self, generation: int | None) -> None:
        """(all ranks, once, before the first save or restore) take the tier over."""

    def fence(self) -> None:
        """Raise when this job may no longer commit to the tier."""

    def apply_retention(self, protected: frozenset[str] = frozenset()) -> list[str]:
        """Delete what no retention policy keeps, never the newest nor ``protected``."""
        ...

    def candidates(self) -> list[tuple[str, tuple[int, str]]]:
        """(all ranks) The snapshots this job may restore from the tier, as
        (id, (step, created)), the same on every rank."""
        ...

    def prepare_restore(self, snapshot_id: str) -> Storage:
        """(all ranks) Make ``snapshot_id`` loadable from this rank and return the storage the
        ordinary load reads it from."""
        ...

    def release(self) -> None:
        """(coordinator, at close) Give the tier back."""


@dataclass(slots=True)
class DiskTier:
    """The durable root or the local disk tier: a :class:`Tier` whose commit is direct and
    whose restore needs nothing first."""

    name: str
    storage: Storage
    retention: list[Retention]
    policies: list[SavePolicy] = field(default_factory=list)
    lease: lease.Lease | None = None
    newest: str | None = None
    newest_step: int | None = None
    single_writer: bool = False
    committer: Committer = DIRECT

    def start(self, generation: int | None = None) -> None:
        self.lease = lease.Lease.take(self.storage, single_writer=self.single_writer)
        found = commit.list_committed(self.storage)
        if found:
            self.newest_step = found[-1].step

    def candidates(self) -> list[tuple[str, tuple[int, str]]]:
        """(coordinator) Every committed snapshot, newest first."""
        found = commit.list_committed(self.storage)
        return [
            (c.snapshot_id, (c.step, str(c.marker.summary.get("created", ""))))
            for c in reversed(found)
        ]

    def prepare_restore(self, snapshot_id: str) -> Storage:
        return self.storage

    def fence(self) -> None:
        if self.lease is not None:
            self.lease.check()

    def apply_retention(self, protected: frozenset[str] = frozenset()) -> list[str]:
        """Delete the committed snapshots no policy keeps, never the newest nor ``protected``
        (e.g. snapshots waiting to be promoted); returns their ids."""
        if not self.retention:
            return []
        cands = [candidate(c) for c in commit.list_committed(self.storage)]
        doomed = to_delete(cands, self.retention, protected=set(protected))
        for c in doomed:
            commit.delete_snapshot(self.storage, c.id)
        if doomed:
            log.info(
                "retention deleted %d snapshot(s) from %s: steps %s",
                len(doomed),
                self.name,
                [c.step for c in doomed],
            )
        return [c.id for c in doomed]

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release(newest=self.newest)


def open_local(
    root: Any, node: int | None, partner: bool, options: Mapping[str, Any] | None
) -> Storage:
    """The local tier (:attr:`LocalTier.root`): one root, or this node's view of one root per
    node."""
    if isinstance(root, str | os.PathLike) or hasattr(root, "put"):
        return open_storage(root, **dict(options or {}))
    roots = [open_storage(r, **dict(options or {})) for r in root]
    if node is None:
        node = node_from_environment("LocalTier(node=...)")
    return open_storage(NodeTier(roots, node, partner=partner))
