"""The manager's options, grouped by concern: :class:`ManagerOptions` (saving in the background,
collection, preemption, the control plane), :class:`LocalTier` (a fast tier in front of the
durable root) and :class:`MemoryTier` (snapshots in the nodes' memory, replicated to partners)."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from os import PathLike
from typing import Any

from trainsnap.errors import InvalidArgumentError
from trainsnap.manager.policies import Every, KeepLast
from trainsnap.storage import Root


@dataclass(kw_only=True, slots=True)
class ManagerOptions:
    """How a :class:`~trainsnap.CheckpointManager` runs its saves."""

    max_in_flight: int = 1
    """Saves in flight at most; a new one waits for the oldest (or is skipped)."""
    skip_if_busy: bool = False
    """Skip a save, with a log line, instead of waiting when ``max_in_flight`` are running."""
    staging_budget: int | None = None
    """Most host bytes the staging pool may hold (None: no limit); a save that does not fit is
    saved synchronously."""
    gc_grace: float = 3600.0
    """Seconds an unreferenced object is left alone where another writer may exist (this
    manager no longer holds the root's lease): a save in flight may be about to reference it;
    should exceed the longest save. While the manager holds the lease it is the only writer
    and collects at once after retention, pausing while its own saves are in flight."""
    preemption_signals: Sequence[int] = (signal.SIGTERM, signal.SIGUSR1)
    """Signals that request a save at the next step (handlers chain to the previous ones);
    ``()`` installs none."""
    weights_interval: Any = None
    """When to save the model alone (a ``weights``-level snapshot) between full saves."""
    quantize_history: bool = False
    """Keep the optimizer state of retained snapshots other than the newest at bfloat16
    precision (recorded as approximate: they restore at ``training``)."""
    progress_seconds: float | None = None
    """How often the coordinator records how far the run got (one small object per run,
    overwritten): the resolution of the lost work a crash's restart reports. 0: before every
    ``step()`` returns (exact lost work, one store write a step on the training thread); None:
    every step in the background on a file-system root, every 30 s on an object store
    (:mod:`trainsnap.manager.progress`)."""
    decision_seconds: float = 1.0
    """How often, in seconds of training, the ranks of a multi-process job look for a shared
    decision (a clock or measured interval, a preemption signal): the coordinator publishes
    each decision at a step of a sequence it announces ahead, sized from the measured step
    time, and the steps between cost no operation on the control plane. A shared decision
    takes effect up to this long after it is due; steps named by step-based policies
    (``Every(steps=N)``, predicates) are never late."""
    after_commit_queue: int = 4
    """Commits whose after-commit work (promotion, retention, collection) may wait for the
    background worker; the next commit waits for room beyond that."""
    coordinator: int = 0
    """The rank that plans and commits."""
    timeout: float | None = None
    """Longest wait, in seconds, for the other ranks in an exchange (None: the default)."""
    single_writer: bool = False
    """Accept a store that ignores conditional creates (the manager refuses one otherwise):
    a superseded writer is then not fenced off, so only set it when no two jobs ever write
    the root at once."""

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise InvalidArgumentError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.gc_grace < 0:
            raise InvalidArgumentError(f"gc_grace must be >= 0 seconds, got {self.gc_grace}")
        if not self.decision_seconds > 0:
            raise InvalidArgumentError(f"decision_seconds must be > 0, got {self.decision_seconds}")
        if self.after_commit_queue < 1:
            raise InvalidArgumentError(
                f"after_commit_queue must be >= 1, got {self.after_commit_queue}"
            )


@dataclass(kw_only=True, slots=True)
class LocalTier:
    """A fast local tier (node NVMe, RAM disk) in front of the manager's durable root.

    Frequent snapshots (``interval``) go to it alone; durable saves are saved there too and then
    promoted to the durable root in the background. Beside a :class:`MemoryTier`, its steps are
    promoted from the memory snapshot of the step (:mod:`trainsnap.manager.schedule`).
    """

    root: Root | Sequence[Root]
    """One root, or one root per node (``[node0, node1, ...]``) of which this process uses
    ``node``."""
    interval: Any = None
    """When to save to the local tier only (same forms as the manager's ``interval``)."""
    retention: Any = field(default_factory=lambda: KeepLast(2))
    """What the local tier keeps."""
    partner: bool = True
    """With per-node roots, also keep each node's objects on the next node, so the local tier
    survives the loss of one node."""
    node: int | None = None
    """This process's node (default: ``GROUP_RANK``, else ``NODE_RANK``, from the environment:
    :mod:`trainsnap.manager.placement`)."""


@dataclass(kw_only=True, slots=True)
class MemoryTier:
    """Snapshots in the nodes' own memory (a tmpfs), replicated to partner nodes: a restart
    after a crash of the training processes, or after losing ``replicas`` nodes, loses at most
    one memory interval (see the README's "Memory tier").

    Each node keeps its ranks' objects in ``<root>/<job>/node-<n>`` (``job`` derived from the
    durable root), a complete trainsnap root layout; a snapshot is committed there only once
    every object has ``1 + replicas`` copies on distinct nodes. Durable and local saves (the
    manager's and the local tier's ``interval``) promote the memory snapshot of that step
    without capturing the state again.
    """

    root: str = "/dev/shm/trainsnap"
    """A directory on a RAM-backed file system (tmpfs) of every node: it outlives the training
    processes (not the node)."""
    replicas: int = 1
    """Copies of each node's objects kept on other nodes (0: none; a node loss then loses the
    memory tier). A job on fewer nodes than ``1 + replicas`` is refused (an
    ``InvalidArgumentError`` at the first restore or save) unless ``allow_fewer_copies``."""
    allow_fewer_copies: bool = False
    """On fewer nodes than ``1 + replicas``, keep one copy on each node instead of refusing
    (e.g. one node: the memory tier then survives a crash of the processes, not of the node)."""
    keep: int = 2
    """Committed memory snapshots kept per node: the newest one stays complete while the next
    is written."""
    interval: Any = field(default_factory=lambda: Every(steps=1))
    """When to take a memory snapshot (the forms of the manager's ``interval``)."""
    node: int | None = None
    """This process's node (default: ``GROUP_RANK``, else ``NODE_RANK``, from the environment:
    :mod:`trainsnap.manager.placement`)."""
    domains: Sequence[int] | None = None
    """The failure domain (rack, power feed) of each node, by node id: a node's partners are the
    next nodes in ring order outside its domain where there are such nodes."""
    wait_if_busy: bool = False
    """Wait at a memory step for the previous memory snapshot still in flight instead of
    skipping this step's (the skips are counted and logged). Waiting bounds the work lost to
    one interval at the cost of stalling training when replication is slower than a step."""

    def __post_init__(self) -> None:
        if not isinstance(self.root, str | PathLike) or not str(self.root):
            raise InvalidArgumentError(f"MemoryTier(root=) must be a directory, got {self.root!r}")
        if "://" in str(self.root):
            raise InvalidArgumentError(
                f"MemoryTier(root={self.root!r}) must be a local directory (a tmpfs such as "
                "/dev/shm), not a URL"
            )
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int):
            raise InvalidArgumentError(
                f"MemoryTier(replicas=) must be an int, got {self.replicas!r}"
            )
        if self.replicas < 0:
            raise InvalidArgumentError(f"MemoryTier(replicas=) must be >= 0, got {self.replicas}")
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1:
            raise InvalidArgumentError(f"MemoryTier(keep=) must be an int >= 1, got {self.keep!r}")
        if self.node is not None and (
            isinstance(self.node, bool) or not isinstance(self.node, int) or self.node < 0
        ):
            raise InvalidArgumentError(f"MemoryTier(node=) must be an int >= 0, got {self.node!r}")
        if self.domains is not None:
            self.domains = tuple(self.domains)
            if not all(isinstance(d, int) and not isinstance(d, bool) for d in self.domains):
                raise InvalidArgumentError(
                    f"MemoryTier(domains=) must list one int per node, got {self.domains!r}"
                )
