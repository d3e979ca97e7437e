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

import functools
import logging
import pickle
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, TypeVar, cast

from trainsnap import tunables
from trainsnap.errors import CommitFailedError, InvalidArgumentError, LoadFailedError
from trainsnap.protocol.planner import PlanMemory
from trainsnap.protocol.store_ops import (
    CLIENTS_LOCK,
    job_of,
    present,
    read_all,
    set_timeout,
)

log = logging.getLogger(__name__)


class PeerLost(CommitFailedError, LoadFailedError):
    """Ranks did not take part in an exchange in time (dead, hung or partitioned away): the
    save or the load the exchange was part of failed, so it is either kind."""

    def __init__(self, message: str, ranks: dict[int, str]) -> None:
        super().__init__(message, rank_errors=ranks)
        self.ranks = ranks


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
    beat_every: float | None = None
    """Seconds between two beats of a rank, and between two liveness scans of a waiting one.
    None: derived from ``heartbeat`` (see :attr:`beat_interval`)."""

    @property
    def beat_interval(self) -> float:
        """``beat_every``, or ``heartbeat / 12`` but at least 2 s (at most ``heartbeat / 4``):
        a beat every 5 s at the default 60 s, and while a rank waits one liveness scan with
        each beat, so at most 0.4 store operations per rank per second (4,000 a second for
        10,000 ranks on one store); a dead rank is named within the heartbeat timeout plus two
        beats."""
        if self.beat_every is not None:
            return self.beat_every
        return max(self.heartbeat / 12, min(2.0, self.heartbeat / 4))


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
        return StoreSession(self, f"{self.namespace}/{seq}-{name}")

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


# What a rank finds in a key it waits for: the first byte says what the rest is.
_INLINE = b"I"  # the pickled object follows
_SHARED = b"S"  # the object is in the exchange's shared key (too large to copy to every rank)
_READY = b"R"  # every rank has reported (the coordinator's wake-up of a gather)
_LOST = b"L"  # this rank's own monitor gave up waiting (see _Wait.lost)
INLINE_MAX = 512
"""A broadcast object up to this many pickled bytes is copied into every rank's key (one read
per rank); a larger one is read from a shared key."""


@dataclass(slots=True)
class _Wait:
    """One rank's wait in progress, as its monitor (the heartbeat thread) sees it."""

    key: str
    """The key whose appearance ends the wait."""
    what: str
    pending: Callable[[Any], list[int]]
    """The ranks that have not yet delivered, read with the given client."""
    started: float
    lost: dict[int, str] | None = None
    """Set by the monitor, which then writes ``_LOST`` into ``key`` if nothing is there yet."""


_Exchange = TypeVar("_Exchange", bound=Callable[..., Any])


def _marking(exchange: _Exchange) -> _Exchange:
    """A session's exchange: should it raise, the session's client is not kept for another
    session (a store operation may have been cut off midway)."""

    @functools.wraps(exchange)
    def run(self: StoreSession, *args: Any, **kwargs: Any) -> Any:
        try:
            return exchange(self, *args, **kwargs)
        except BaseException:
            self._sound = False
            raise

    return cast(_Exchange, run)


_live_sessions: weakref.WeakSet[StoreSession] = weakref.WeakSet()


def _stop_heartbeats_at_exit() -> None:
    """Before exit joins threads: a session left open must not keep the process alive."""
    for session in list(_live_sessions):
        session._stop.set()


threading._register_atexit(_stop_heartbeats_at_exit)  # type: ignore[attr-defined]


class StoreSession:
    """One save's or load's exchanges. Publishes this rank's heartbeat until closed.

    Waiting costs the store nothing while it lasts: a waiting rank blocks in the store's
    ``wait`` on one key of its own, which the event it waits for sets (the last report of a
    gather sets the coordinator's; a broadcast or scatter sets every rank's, a ``set`` each,
    sent without waiting for replies). Liveness is the heartbeat thread's job: once a beat
    interval, while its rank waits, it reads in bulk (``check``, ``multi_get``) the heartbeats
    of the ranks still awaited, and wakes its rank (writing ``_LOST`` into that key) when one
    has been silent for the heartbeat timeout, or the exchange timed out.
    """

    def __init__(self, comm: StoreComm, names: str) -> None:
        self.c = comm
        self.ns = names
        # A client of our own: the session may run on a background thread while the training
        # thread uses the original client.
        self.store = comm._client("wait")
        self._lock = threading.Lock()
        self._waiting: _Wait | None = None
        self._seen: dict[int, tuple[bytes, float]] = {}
        """Each awaited rank's heartbeat as last read, and for how long (see ``_silent``) it
        has had that value."""
        self._last_look: float | None = None
        """When the monitor last read the awaited heartbeats."""
        self._unread: list[str] = []
        """This rank's reports the coordinator may not have read yet: each rank removes its
        own once the coordinator answers (it answers only once it has read them), so that the
        coordinator does not spend an operation per rank on removing them."""
        self._unanswered: list[str] = []
        """(coordinator) The gathers read since it last answered: nobody has learnt that their
        reports were read, so the coordinator removes those itself when it closes."""
        self._closed = False
        self._sound = True
        """Whether every store operation of the session answered (its client may be reused)."""
        self._stop = threading.Event()
        self._beat_key = self._heartbeat_key(comm.rank)
        self.store.add(self._beat_key, 1)
        # Not a daemon: one in a store call (C++) at finalization is stopped by pthread_exit,
        # whose unwind through a noexcept GIL guard aborts (SIGABRT); exit stops and joins it.
        self._beater = threading.Thread(target=self._beat, name="trainsnap-heartbeat")
        _live_sessions.add(self)
        self._beater.start()

    def _heartbeat_key(self, rank: int) -> str:
        return f"{self.ns}/hb/{rank}"

    def close(self) -> None:
        """Stop beating and drop this rank's keys: nobody waits on a rank that has learnt the
        outcome, and a long job must not grow the store by a key per save."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._beater.join(timeout=5)
        # A report the coordinator may still read stays (its rank is leaving early; the
        # coordinator removes it at its own close if it never answered that gather).
        unanswered = [
            f"{base}/{r}"
            for base in self._unanswered
            for r in range(self.c.world_size)
            if r != self.c.rank
        ]
        try:
            for key in [*unanswered, self._beat_key]:
                self.store.delete_key(key)
        except Exception:
            self._sound = False
            log.debug("could not delete the keys of %s", self.ns, exc_info=True)
        self._unread = self._unanswered = []
        if self._sound:
            self.c._release("wait", self.store)

    # -- liveness (the heartbeat thread) ----------------------------------------------------

    def _beat(self) -> None:
        interval = self.c.timeouts.beat_interval
        store = self._beat_client()
        failing = False
        try:
            while not self._stop.wait(interval):
                try:
                    if store is None:
                        store = self.c._client("beat")
                    store.add(self._beat_key, 1)
                    self._scan(store)
                    failing = False
                except Exception:  # keep beating: the store may answer again
                    log.log(
                        logging.DEBUG if failing else logging.WARNING,
                        "trainsnap heartbeat of %s failed",
                        self._beat_key,
                        exc_info=True,
                    )
                    failing = True
                    # A client whose operation was cut off (timed out) may answer the next one
                    # with the reply to this one: it is never asked again; the next beat
                    # connects another.
                    store = None
        finally:
            if store is not None:
                self.c._release("beat", store)

    def _beat_client(self) -> Any:
        """The heartbeat's client, connected while the first interval passes; None if it could
        not be (the first beat tries again)."""
        try:
            return self.c._client("beat")
        except Exception:
            log.warning(
                "trainsnap heartbeat of %s could not connect", self._beat_key, exc_info=True
            )
            return None

    def _scan(self, store: Any) -> None:
        with self._lock:
            wait = self._waiting
        if wait is None:
            return
        now = time.monotonic()
        pending = wait.pending(store)
        if not pending:
            return  # the last of them is delivering: the waiter is about to wake
        lost = self._silent(store, pending, now, wait.what)
        t = self.c.timeouts
        if not lost and now - wait.started > t.exchange:
            lost = {r: f"no {wait.what} within the {t.exchange:.0f} s timeout" for r in pending}
        if lost:
            with self._lock:
                if self._waiting is wait:
                    wait.lost = lost
                    # Never over a real answer: compare_set writes only where nothing is yet.
                    store.compare_set(wait.key, "", _LOST)

    def _silent(self, store: Any, ranks: list[int], now: float, what: str) -> dict[int, str]:
        """The ranks among ``ranks`` whose heartbeat has not changed for the heartbeat timeout,
        counted in time the store answered this monitor: a gap between two looks longer than
        half the timeout (the store, or this process, stalled) counts as half the timeout --
        after a stall the first reads can come before the beats queued behind them, and every
        live rank would look silent for the length of the stall."""
        t = self.c.timeouts
        beats = read_all(store, [self._heartbeat_key(r) for r in ranks])
        last, self._last_look = self._last_look, now
        credit = 0.0 if last is None else min(now - last, max(2 * t.beat_interval, t.heartbeat / 2))
        lost: dict[int, str] = {}
        for rank, beat in zip(ranks, beats, strict=True):
            previous = self._seen.get(rank)
            if previous is None or previous[0] != beat:
                self._seen[rank] = (beat, 0.0)
                continue
            silent = previous[1] + credit
            self._seen[rank] = (beat, silent)
            if silent > t.heartbeat:
                lost[rank] = (
                    f"no sign of life for {silent:.0f} s while the others waited for "
                    f"its {what} (process killed, hung or unreachable)"
                )
        return lost

    # -- waiting ----------------------------------------------------------------------------

    def _await(self, key: str, what: str, pending: Callable[[Any], list[int]]) -> bytes:
        """The value ``key`` takes, once it is set; deletes it. Raises :class:`PeerLost` when
        the monitor finds a pending rank dead or the exchange timed out."""
        t = self.c.timeouts
        wait = _Wait(key, what, pending, time.monotonic())
        with self._lock:
            self._waiting = wait
        # The monitor normally ends the wait at the exchange timeout; this is the backstop.
        backstop = t.exchange + t.heartbeat + 4 * t.beat_interval
        try:
            self.store.wait([key], timedelta(seconds=backstop))
        except Exception as e:
            if time.monotonic() - wait.started < backstop:
                raise
            ranks = {
                r: f"no {what} within the {t.exchange:.0f} s timeout" for r in pending(self.store)
            }
            raise PeerLost(f"{len(ranks)} rank(s) did not deliver their {what}", ranks) from e
        finally:
            with self._lock:
                self._waiting = None
        value = bytes(self.store.get(key))
        self.store.delete_key(key)
        if value == _LOST:
            assert wait.lost
            raise PeerLost(f"{len(wait.lost)} rank(s) did not deliver their {what}", wait.lost)
        return value

    def _receive(self, tag: str) -> Any:
        """The coordinator's object for this rank under ``tag`` (broadcast or scatter)."""
        base = f"{self.ns}/{tag}"
        coordinator = self.c.coordinator
        value = self._await(
            f"{base}/to/{self.c.rank}", f"decision on {tag!r}", lambda _: [coordinator]
        )
        # The coordinator sends only after it has read every report before: they can go.
        for key in self._unread:
            self.store.delete_key(key)
        self._unread = []
        if value[:1] == _INLINE:
            return pickle.loads(value[1:])
        assert value == _SHARED, value[:16]
        shared = f"{base}/shared"
        data = self.store.get(shared)
        if int(self.store.add(f"{shared}/reads", 1)) == self.c.world_size - 1:
            self.store.delete_key(shared)  # the last reader removes it
            self.store.delete_key(f"{shared}/reads")
        return pickle.loads(data)

    def _send(self, keys: list[str], values: list[bytes]) -> None:
        """(coordinator) Answer: set every other rank's key, one ``set`` each (sent without
        waiting for a reply). Never ``multi_set``: torch's libuv store sets a multi_set's keys
        as it parses them and, when the command arrives in more than one read, parses it again
        from the start, so a key a rank has already read and removed is set again -- and read,
        stale, by the next exchange under that name."""
        for key, value in zip(keys, values, strict=True):
            self.store.set(key, value)
        self._unanswered = []

    def _others(self, base: str) -> tuple[list[int], list[str]]:
        ranks = [r for r in range(self.c.world_size) if r != self.c.rank]
        return ranks, [f"{base}/to/{r}" for r in ranks]

    # -- exchanges ----------------------------------------------------------------------------

    @_marking
    def gather(self, tag: str, obj: Any) -> list[Any] | None:
        base = f"{self.ns}/{tag}"
        world = self.c.world_size
        mine = f"{base}/{self.c.rank}"
        self.store.set(mine, pickle.dumps(obj))
        if int(self.store.add(f"{base}/count", 1)) == world:
            self.store.set(f"{base}/done", _READY)  # the last to report wakes the coordinator
        if not self.c.is_coordinator:
            self._unread.append(mine)
            return None
        keys = [f"{base}/{r}" for r in range(world)]
        awaited = list(range(world))

        def pending(store: Any) -> list[int]:
            nonlocal awaited
            here = present(store, [keys[r] for r in awaited])
            awaited = [r for r, there in zip(awaited, here, strict=True) if not there]
            return awaited

        self._await(f"{base}/done", f"report for {tag!r}", pending)
        out = [pickle.loads(v) for v in self.store.multi_get(keys)]
        self.store.delete_key(mine)
        self.store.delete_key(f"{base}/count")
        self._unanswered.append(base)
        return out

    @_marking
    def broadcast(self, tag: str, obj: Any = None) -> Any:
        if not self.c.is_coordinator:
            return self._receive(tag)
        base = f"{self.ns}/{tag}"
        _, keys = self._others(base)
        data = pickle.dumps(obj)
        if len(data) <= INLINE_MAX:
            self._send(keys, [_INLINE + data] * len(keys))
        else:
            self.store.set(f"{base}/shared", data)
            self._send(keys, [_SHARED] * len(keys))
        return obj

    @_marking
    def scatter(self, tag: str, objs: list[Any] | None = None) -> Any:
        if not self.c.is_coordinator:
            return self._receive(tag)
        assert objs is not None and len(objs) == self.c.world_size
        ranks, keys = self._others(f"{self.ns}/{tag}")
        self._send(keys, [_INLINE + pickle.dumps(objs[r]) for r in ranks])
        return objs[self.c.rank]

    @_marking
    def publish(self, tag: str, name: str, obj: Any, readers: int) -> None:
        if readers > 0:
            self.store.set(f"{self.ns}/{tag}/pub/{name}", pickle.dumps((readers, obj)))

    @_marking
    def fetch(self, tag: str, name: str) -> Any:
        key = f"{self.ns}/{tag}/pub/{name}"
        readers, value = pickle.loads(self.store.get(key))
        if int(self.store.add(f"{key}/reads", 1)) == readers:  # the last reader removes it
            self.store.delete_key(key)
            self.store.delete_key(f"{key}/reads")
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
