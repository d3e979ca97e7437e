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

import logging
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from trainsnap import tunables
from trainsnap.errors import CommitFailedError

log = logging.getLogger(__name__)


class PeerLost(CommitFailedError):
    """Ranks did not take part in an exchange in time (dead, hung or partitioned away)."""

    def __init__(self, message: str, ranks: dict[int, str]) -> None:
        super().__init__(message, rank_errors=ranks)
        self.ranks = ranks


class Comm(Protocol):
    rank: int
    world_size: int
    coordinator: int

    @property
    def is_coordinator(self) -> bool: ...

    def session(self, name: str) -> Session:
        """A namespace for one save or load; every rank opens sessions in the same order."""
        ...


class Session(Protocol):
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
        """(coordinator) Make ``obj`` fetchable under ``name`` by ``readers`` other ranks:
        one copy in the store however many ranks fetch it."""
        ...

    def fetch(self, tag: str, name: str) -> Any:
        """What the coordinator published under ``name`` (waits for it, watching the
        coordinator's heartbeat)."""
        ...

    def close(self) -> None: ...


# -- one process ----------------------------------------------------------------------------------


class LocalComm:
    rank = 0
    world_size = 1
    coordinator = 0
    is_coordinator = True

    def session(self, name: str) -> LocalSession:
        return LocalSession()


class LocalSession:
    def __init__(self) -> None:
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

    def close(self) -> None:
        pass


# -- over the rendezvous store ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Timeouts:
    exchange: float = 1800.0
    """Longest a rank waits for an exchange to complete while its peers are alive (a large save
    can keep ranks writing for a long time)."""
    heartbeat: float = 60.0
    """A peer whose heartbeat did not change for this long is taken as dead."""
    beat_every: float = 1.0


class StoreComm:
    """Control plane over a ``torch.distributed`` store, namespaced under ``trainsnap/``."""

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
            raise ValueError(f"coordinator {coordinator} outside world of {world_size}")
        self.store = store
        self.rank, self.world_size, self.coordinator = rank, world_size, coordinator
        self.timeouts = timeouts or Timeouts()
        self.namespace = namespace
        self._seq = 0
        self._lock = threading.Lock()

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self.coordinator

    def session(self, name: str) -> StoreSession:
        with self._lock:
            self._seq += 1
            seq = self._seq
        return StoreSession(self, f"{self.namespace}/{seq}-{name}")


class StoreSession:
    """One save's or load's exchanges. Publishes this rank's heartbeat until closed."""

    def __init__(self, comm: StoreComm, names: str) -> None:
        self.c = comm
        self.ns = names
        # A client of our own: the session may run on a background thread while the training
        # thread uses the original client.
        self.store = comm.store.clone() if hasattr(comm.store, "clone") else comm.store
        self._stop = threading.Event()
        self._beat_key = f"{names}/hb/{comm.rank}"
        self.store.add(self._beat_key, 1)
        self._beater = threading.Thread(target=self._beat, name="trainsnap-heartbeat", daemon=True)
        self._beater.start()

    def _beat(self) -> None:
        store = self.c.store.clone() if hasattr(self.c.store, "clone") else self.store
        while not self._stop.wait(self.c.timeouts.beat_every):
            try:
                store.add(self._beat_key, 1)
            except Exception:  # the store is gone: waiting peers will notice our silence
                return

    def close(self) -> None:
        """Stop beating and drop this rank's heartbeat key: nobody waits on a rank that has
        learnt the outcome, and a long job must not grow the store by a key per save."""
        self._stop.set()
        self._beater.join(timeout=5)
        try:
            self.store.delete_key(self._beat_key)
        except Exception:
            log.debug("could not delete %s", self._beat_key, exc_info=True)

    # -- waiting with liveness --------------------------------------------------------------

    def _wait_for(self, ready: Callable[[], list[int]], ranks: list[int], what: str) -> None:
        """Wait until ``ready()`` returns no pending rank. Pending ranks whose heartbeat stops
        are declared lost; so is everyone pending when the exchange timeout expires."""
        t = self.c.timeouts
        start = time.monotonic()
        last_beat: dict[int, tuple[int, float]] = {}
        delay = 0.001
        pending = ready()
        while pending:
            now = time.monotonic()
            lost: dict[int, str] = {}
            for r in pending:
                beat = self._beat_of(r)
                prev = last_beat.get(r)
                if prev is None or prev[0] != beat:
                    last_beat[r] = (beat, now)
                elif now - prev[1] > t.heartbeat:
                    lost[r] = (
                        f"no sign of life for {now - prev[1]:.0f} s while the others waited for "
                        f"its {what} (process killed, hung or unreachable)"
                    )
            if not lost and now - start > t.exchange:
                lost = {r: f"no {what} within the {t.exchange:.0f} s timeout" for r in pending}
            if lost:
                raise PeerLost(f"{len(lost)} rank(s) did not deliver their {what}", lost)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
            pending = ready()

    def _beat_of(self, result: int) -> int:
        key = f"{self.ns}/hb/{result}"
        if not self.store.check([key]):
            return 0
        return int(self.store.add(key, 0))

    # -- exchanges ----------------------------------------------------------------------------

    def gather(self, tag: str, obj: Any) -> list[Any] | None:
        base = f"{self.ns}/{tag}"
        self.store.set(f"{base}/{self.c.rank}", pickle.dumps(obj))
        self.store.add(f"{base}/count", 1)
        if not self.c.is_coordinator:
            return None
        ranks = list(range(self.c.world_size))

        def pending() -> list[int]:
            if int(self.store.add(f"{base}/count", 0)) >= self.c.world_size:
                return []
            return [r for r in ranks if not self.store.check([f"{base}/{r}"])]

        self._wait_for(pending, ranks, f"report for {tag!r}")
        keys = [f"{base}/{r}" for r in ranks]
        out = [pickle.loads(v) for v in self.store.multi_get(keys)]
        for k in [*keys, f"{base}/count"]:
            self.store.delete_key(k)
        return out

    def broadcast(self, tag: str, obj: Any = None) -> Any:
        key = f"{self.ns}/{tag}/result"
        if self.c.is_coordinator:
            self.store.set(key, pickle.dumps(obj))
            return obj
        return self._receive(key, tag)

    def scatter(self, tag: str, objs: list[Any] | None = None) -> Any:
        base = f"{self.ns}/{tag}/to"
        if self.c.is_coordinator:
            assert objs is not None and len(objs) == self.c.world_size
            for r, o in enumerate(objs):
                if r != self.c.rank:
                    self.store.set(f"{base}/{r}", pickle.dumps(o))
            return objs[self.c.rank]
        return self._receive(f"{base}/{self.c.rank}", tag, delete=True)

    def publish(self, tag: str, name: str, obj: Any, readers: int) -> None:
        if readers > 0:
            self.store.set(f"{self.ns}/{tag}/pub/{name}", pickle.dumps((readers, obj)))

    def fetch(self, tag: str, name: str) -> Any:
        key = f"{self.ns}/{tag}/pub/{name}"
        coord = self.c.coordinator
        self._wait_for(
            lambda: [] if self.store.check([key]) else [coord], [coord], f"decision on {tag!r}"
        )
        readers, value = pickle.loads(self.store.get(key))
        if int(self.store.add(f"{key}/acks", 1)) == readers:  # the last reader removes it
            self.store.delete_key(key)
            self.store.delete_key(f"{key}/acks")
        return value

    def _receive(self, key: str, tag: str, delete: bool = False) -> Any:
        coord = self.c.coordinator
        self._wait_for(
            lambda: [] if self.store.check([key]) else [coord], [coord], f"decision on {tag!r}"
        )
        value = pickle.loads(self.store.get(key))
        if delete:
            self.store.delete_key(key)
        elif int(self.store.add(f"{key}/acks", 1)) == self.c.world_size - 1:
            # The last reader of a broadcast removes it.
            self.store.delete_key(key)
            self.store.delete_key(f"{key}/acks")
        return value


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
