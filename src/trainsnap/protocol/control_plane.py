"""The control plane: how ranks agree, report and learn outcomes.

It never uses the training process group. With an initialised ``torch.distributed`` default group
it runs over that group's key-value store (the TCPStore or FileStore of the rendezvous), which
needs no collective call ordering, is usable from a background thread, and can say *which* rank
failed to report: every rank publishes a heartbeat while it works, so a coordinator waiting for a
report tells a slow rank from a dead one. Without a process group everything is one process
(:class:`LocalComm`).

The only pattern used is gather-to-coordinator then broadcast (or scatter) from it, so the store
traffic is O(world size) per exchange, never O(world size^2).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from trainsnap import tunables
from trainsnap.errors import InvalidArgumentError, RankFailure
from trainsnap.protocol.planner import PlanMemory
from trainsnap.protocol.store_ops import CLIENTS_LOCK, job_of, set_timeout
from trainsnap.protocol.store_session import INLINE_MAX, PeerLost, StoreSession, Timeouts

__all__ = [
    "INLINE_MAX",
    "Comm",
    "LocalComm",
    "LocalSession",
    "PeerLost",
    "Session",
    "StoreComm",
    "StoreSession",
    "Timeouts",
    "comm_for",
    "default_comm",
]


class Comm(Protocol):
    rank: int
    world_size: int
    coordinator: int
    plans: PlanMemory

    @property
    def is_coordinator(self) -> bool: ...

    def session(self, name: str) -> Session:
        """A namespace for one save or load; every rank opens sessions in the same order."""
        ...


class Session(Protocol):
    name: str
    """What the session is for (``save``, ``load``, ...): the first part of a step's name."""

    def gather(self, tag: str, obj: Any) -> list[Any] | None:
        """Every rank's ``obj``, by rank, on the coordinator; ``None`` elsewhere."""
        ...

    def broadcast(self, tag: str, obj: Any = None) -> Any:
        """The coordinator's ``obj`` on every rank."""
        ...

    def scatter(self, tag: str, objs: list[Any] | None = None) -> Any:
        """``objs[rank]`` of the coordinator on each rank."""
        ...

    def publish(self, tag: str, name: str, obj: Any, readers: int) -> None:
        """(coordinator) Make ``obj`` fetchable under ``name`` by ``readers`` other ranks: one
        copy in the store however many ranks fetch it. Publish before a broadcast that tells
        the readers to fetch."""
        ...

    def fetch(self, tag: str, name: str) -> Any:
        """What the coordinator published under ``name``; call it only once a broadcast sent
        after the publish has been received (the object is then there)."""
        ...

    failed: bool
    """Whether a step of this session failed and every rank learnt it (the agreement primitive
    sets it): nobody waits for this rank in the session any more."""

    def abandon(self, failure: RankFailure) -> None:
        """This rank leaves the session with ``failure`` (raised outside a step): the rank
        that will wait for it next in the session -- the coordinator in its next gather, every
        rank for the coordinator's next decision -- stops waiting at once and names it, with
        its cause. :meth:`close` calls it when an exception is leaving the session."""
        ...

    def peer_lost(self, failure: RankFailure) -> None:
        """This rank found ``failure.rank`` lost (its connection broke): the ranks that would
        wait for it in this session's next exchange stop waiting and name it."""
        ...

    def close(self) -> None: ...


# -- one process ----------------------------------------------------------------------------------


class LocalComm:
    rank = 0
    world_size = 1
    coordinator = 0
    is_coordinator = True

    def __init__(self) -> None:
        self.plans = PlanMemory()  # a process alone plans afresh: nothing to remember

    def session(self, name: str) -> LocalSession:
        return LocalSession(name)


class LocalSession:
    def __init__(self, name: str = "local") -> None:
        self.name = name
        self.failed = False
        self._published: dict[tuple[str, str], Any] = {}

    def gather(self, tag: str, obj: Any) -> list[Any] | None:
        return [obj]

    def broadcast(self, tag: str, obj: Any = None) -> Any:
        return obj

    def scatter(self, tag: str, objs: list[Any] | None = None) -> Any:
        assert objs is not None
        return objs[0]

    def publish(self, tag: str, name: str, obj: Any, readers: int) -> None:
        self._published[(tag, name)] = obj

    def fetch(self, tag: str, name: str) -> Any:
        return self._published.pop((tag, name))

    def abandon(self, failure: RankFailure) -> None:
        pass  # nobody else waits

    def peer_lost(self, failure: RankFailure) -> None:
        pass

    def close(self) -> None:
        pass


# -- over the rendezvous store ---------------------------------------------------------------------


class StoreComm:
    """Control plane over a ``torch.distributed`` store, namespaced under ``trainsnap/``.

    Its sessions' store clients (two a session: one that waits, one that beats) are kept for
    the next session -- of any ``StoreComm`` over the same store in this process
    (``trainsnap.save`` makes one a call) -- so that a job connects them once, not twice a rank
    at every save (thousands of connections at once to one store at scale). A client whose
    session saw a store operation fail is dropped, not kept."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        *,
        coordinator: int = 0,
        timeouts: Timeouts | None = None,
        namespace: str = "trainsnap",
    ) -> None:
        if not 0 <= coordinator < world_size:
            raise InvalidArgumentError(
                f"coordinator {coordinator} outside world of {world_size}: pass coordinator= "
                f"a rank in 0..{world_size - 1}"
            )
        self.store = store
        self.rank, self.world_size, self.coordinator = rank, world_size, coordinator
        self.timeouts = timeouts or Timeouts()
        self.namespace = namespace
        self._seq = 0
        self._lock = threading.Lock()
        job = job_of(store)
        self._idle_clients = job.clients
        self.plans = job.plans
        """What this job's process remembers of save plans (:class:`PlanMemory`)."""

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self.coordinator

    def session(self, name: str) -> StoreSession:
        with self._lock:
            self._seq += 1
            seq = self._seq
        return StoreSession(self, f"{self.namespace}/{seq}-{name}", name)

    def _client(self, role: str) -> Any:
        """A store client of its own for ``role`` (``wait``: a session's exchanges; ``beat``:
        its heartbeat thread): the caller's may be in use on another thread. The caller's store
        where it cannot be cloned."""
        kind = self._kind(role)
        with CLIENTS_LOCK:
            if self._idle_clients.get(kind):
                return self._idle_clients[kind].pop()
        if not hasattr(self.store, "clone"):
            return self.store
        client = self.store.clone()
        if role == "beat":
            # A scan never blocks for long on a heartbeat key deleted under it (a rank closing).
            set_timeout(client, self._beat_timeout())
        return client

    def _release(self, role: str, client: Any) -> None:
        if client is not self.store:
            with CLIENTS_LOCK:
                self._idle_clients.setdefault(self._kind(role), []).append(client)

    def _beat_timeout(self) -> float:
        return max(5.0, 2 * self.timeouts.beat_interval)

    def _kind(self, role: str) -> str:
        """Clients are kept by role, and heartbeat clients by the timeout they were given."""
        return f"beat/{self._beat_timeout()}" if role == "beat" else role


# -- choosing -------------------------------------------------------------------------------------


def default_comm(*, coordinator: int = 0, timeouts: Timeouts | None = None) -> Comm:
    """Store-based control plane when a default process group exists, else one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return LocalComm()
    world = dist.get_world_size()
    if world == 1:
        return LocalComm()
    store = dist.distributed_c10d._get_default_store()
    return StoreComm(store, dist.get_rank(), world, coordinator=coordinator, timeouts=timeouts)


def comm_for(coordinator: int, timeout: float | None) -> Comm:
    """The default control plane with the heartbeat from the tunables and ``timeout`` (seconds,
    None: the default) as the longest wait for an exchange."""
    beat = float(tunables.get().heartbeat_seconds)
    if timeout is None:
        timeouts = Timeouts(heartbeat=beat)
    else:
        timeouts = Timeouts(exchange=timeout, heartbeat=min(beat, timeout))
    return default_comm(coordinator=coordinator, timeouts=timeouts)
