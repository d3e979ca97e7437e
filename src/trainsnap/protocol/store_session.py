"""The control plane's exchanges over the rendezvous store: one save's or load's session.

A session of :class:`~trainsnap.protocol.control_plane.StoreComm`: gathers to the coordinator,
its broadcasts and scatters, objects it publishes, and the liveness of the ranks it waits for
(every rank beats while its session is open; a rank that leaves with an error says so; a process
that ended on this host is seen at once, :mod:`trainsnap.protocol.liveness`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import pickle
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, TypeVar, cast

from trainsnap.errors import CommitFailedError, LoadFailedError, RankErrors, RankFailure
from trainsnap.protocol import liveness
from trainsnap.protocol.store_ops import ABSENT, present, read_all

log = logging.getLogger(__name__)


class PeerLost(CommitFailedError, LoadFailedError):
    """Ranks did not take part in an exchange in time (dead, hung or partitioned away): the
    save or the load the exchange was part of failed, so it is either kind.

    Attributes:
        ranks: each lost rank and why it counts as lost (``rank_errors``); ``failures`` holds
            the record of a rank that left the session with an error of its own.
    """

    def __init__(self, message: str, ranks: RankErrors) -> None:
        super().__init__(message, rank_errors=ranks)
        self.ranks = self.rank_errors


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


class Owner(Protocol):
    """What a session needs of its control plane (:class:`~.control_plane.StoreComm`)."""

    rank: int
    world_size: int
    coordinator: int
    timeouts: Timeouts

    @property
    def is_coordinator(self) -> bool: ...

    def _client(self, role: str) -> Any: ...

    def _release(self, role: str, client: Any) -> None: ...


# What a rank finds in a key it waits for: the first byte says what the rest is.
_INLINE = b"I"  # the pickled object follows
_SHARED = b"S"  # the object is in the exchange's shared key (too large to copy to every rank)
_READY = b"R"  # every rank has reported (the coordinator's wake-up of a gather)
_LOST = b"L"  # this rank's own monitor gave up waiting (see _Wait.lost)
_LEFT = b"F"  # a rank awaited left the session with a failure (see StoreSession.abandon)
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
    lost: dict[int, str | RankFailure] | None = None
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

    def __init__(self, comm: Owner, names: str, name: str = "session") -> None:
        self.c = comm
        self.ns = names
        self.name = name
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
        self.failed = False
        self._gathers = 0
        """Gathers entered (every rank enters a session's exchanges in one order, so the n-th
        gather is the same exchange on every rank: a rank that leaves knows where the
        coordinator will wait for it)."""
        self._delivered = 0
        """The last gather this rank delivered its part to."""
        self._sends = 0
        """The coordinator's decisions (broadcasts, scatters) so far."""
        self._opened_while = sys.exc_info()[1]
        """The exception being handled when the session opened: not one leaving it."""
        self._told: list[str] = []
        """Keys :meth:`peer_lost` wrote for the step in progress."""
        self._gone: set[int] = set()
        """(coordinator) Ranks lost in a gather: no decision is sent to them any more."""
        self._counted = ""
        """The count of the last gather this rank reported to."""
        self._unbeaten = False
        """Whether the heartbeat thread removed the heartbeat as it stopped."""
        self._who: dict[int, str] = {}
        """Each awaited rank's process identity, once read (:mod:`~.liveness`)."""
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

    def _who_key(self, rank: int) -> str:
        return f"{self.ns}/hb/{rank}/who"

    def _left_key(self, rank: int) -> str:
        return f"{self.ns}/left/{rank}"

    def _wake_key(self, gather: int) -> str:
        """The key the coordinator waits on in the session's ``gather``-th gather."""
        return f"{self.ns}/wake/{gather}"

    def _decision_keys(self, send: int, ranks: list[int]) -> list[str]:
        """The keys ``ranks`` wait on for the coordinator's ``send``-th decision."""
        return [f"{self.ns}/to/{send}/{r}" for r in ranks]

    # -- leaving with a failure ---------------------------------------------------------------

    def abandon(self, failure: RankFailure) -> None:
        if self.failed or self._closed:
            return
        self.failed = True
        self._tell_left(failure, self.store.set)

    def peer_lost(self, failure: RankFailure) -> None:
        # Never over the peer's own word (compare_set writes only where nothing is yet). What
        # this writes, the coordinator may already have read and removed (another rank told
        # it first): this rank removes it again once the step's decision reached it.
        self._tell_left(failure, lambda key, value: self.store.compare_set(key, "", value))
        if failure.rank != self.c.coordinator:
            self._told.extend([self._left_key(failure.rank), self._wake_key(self._delivered + 1)])

    def _forget_told(self) -> None:
        """Remove what :meth:`peer_lost` wrote, once the step it was written for is decided."""
        told, self._told = self._told, []
        with contextlib.suppress(Exception):
            for key in told:
                self.store.delete_key(key)

    def _tell_left(self, failure: RankFailure, put: Callable[[str, bytes], Any]) -> None:
        """Record ``failure`` for its rank and wake who waits for that rank next. A rank other
        than the coordinator is awaited by the coordinator alone, in the gather this rank has
        not delivered to: its wake-up key is set (O(1) store operations), and removed again if
        the coordinator has already closed the session (it would never read it, and a later
        session of the same name would). The coordinator is awaited by every other rank, for
        decisions that may never come: they find its record at their next liveness scan
        (:meth:`_scan`), within a beat interval."""
        rank = failure.rank
        try:
            put(self._left_key(rank), pickle.dumps(failure))
            if rank == self.c.coordinator:
                return
            wake = self._wake_key(self._delivered + 1)
            self.store.compare_set(wake, "", _LEFT)
            if not self.store.check([self._heartbeat_key(self.c.coordinator)]):
                self.store.delete_key(wake)
                self.store.delete_key(self._left_key(rank))
        except Exception:
            self._sound = False
            log.warning("could not tell the others that rank %d left %s", rank, self.ns)

    def _left(self, ranks: list[int], what: str) -> PeerLost:
        """The error of a wait woken by ranks that left (:meth:`abandon`, :meth:`peer_lost`):
        those of ``ranks`` that did, each with its failure; the last reader of a record
        removes it."""
        keys = [self._left_key(r) for r in ranks]
        found: dict[int, str | RankFailure] = {}
        for rank, key, value in zip(ranks, keys, read_all(self.store, keys), strict=True):
            if value == ABSENT:
                continue
            found[rank] = pickle.loads(value)
            readers = self.c.world_size - 1 if rank == self.c.coordinator else 1
            if int(self.store.add(f"{key}/reads", 1)) >= readers:
                self.store.delete_key(key)
                self.store.delete_key(f"{key}/reads")
        if not found:
            found = dict.fromkeys(ranks, f"left the session before its {what}")
        return PeerLost(f"{len(found)} rank(s) left before their {what}", found)

    def close(self) -> None:
        """Stop beating and drop this rank's keys: nobody waits on a rank that has learnt the
        outcome, and a long job must not grow the store by a key per save."""
        if self._closed:
            return
        leaving = sys.exc_info()[1]  # called while an exception leaves the session: say so
        if leaving is not None and leaving is not self._opened_while and not self.failed:
            self.abandon(RankFailure.of(self.c.rank, leaving, self.name))
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
        # The heartbeat thread removes the heartbeat as it stops (see _beat); a thread that
        # did not stop in time leaves it to us.
        beat = [] if self._unbeaten else [self._beat_key]
        # A failed session may leave the count of a gather that never completed (the last
        # rank to add to it removes it after its own add) and reports never read.
        failed = [self._counted, *self._unread] if self.failed and self._counted else []
        try:
            for key in [*unanswered, *failed, *beat]:
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
        who = liveness.identity()  # published once a session, as soon as connected
        try:
            while who or not self._stop.wait(interval):
                try:
                    if store is None:
                        store = self.c._client("beat")
                    if who:
                        store.set(self._who_key(self.c.rank), who)
                        who = ""
                        continue
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
                    who = ""  # a process unknown to its peers is left to the heartbeat
                    # A client whose operation was cut off (timed out) may answer the next one
                    # with the reply to this one: it is never asked again; the next beat
                    # connects another.
                    store = None
        finally:
            if store is not None:
                self._unbeat(store)
                self._unbeaten = True
                self.c._release("beat", store)

    def _unbeat(self, store: Any) -> None:
        """(the heartbeat thread, stopping) Remove this rank's heartbeat and identity; then, on
        the coordinator, the wake-up of a gather it will not enter: a rank that leaves after
        that finds the heartbeat gone and removes its own (:meth:`_tell_left`)."""
        keys = [self._beat_key, self._who_key(self.c.rank)]
        if self.c.is_coordinator:
            keys.append(self._wake_key(self._gathers + 1))
        with contextlib.suppress(Exception):
            for key in keys:
                store.delete_key(key)

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
        what = wait.what
        lost: dict[int, str | RankFailure] = {}
        lost.update(self._ended(store, pending, what) or self._silent(store, pending, now, what))
        seen = [(r, self._seen.get(r)) for r in pending if r not in lost]
        quiet = [r for r, last in seen if last is not None and (last[0] == ABSENT or last[1] > 0)]
        if quiet:  # a rank that stopped beating may have said why (a coordinator that left)
            records = read_all(store, [self._left_key(r) for r in quiet])
            lost.update(
                {r: pickle.loads(v) for r, v in zip(quiet, records, strict=True) if v != ABSENT}
            )
        t = self.c.timeouts
        if not lost and now - wait.started > t.exchange:
            lost = {r: f"no {wait.what} within the {t.exchange:.0f} s timeout" for r in pending}
        if lost:
            with self._lock:
                if self._waiting is wait:
                    wait.lost = lost
                    # Never over a real answer: compare_set writes only where nothing is yet.
                    store.compare_set(wait.key, "", _LOST)

    def _ended(self, store: Any, ranks: list[int], what: str) -> dict[int, str]:
        """The ranks among ``ranks`` whose process is known to have ended (:mod:`~.liveness`:
        on this host), found at once rather than after the heartbeat timeout. An identity is
        read once per awaited rank and session."""
        unknown = [r for r in ranks if r not in self._who]
        if unknown:
            found = read_all(store, [self._who_key(r) for r in unknown])
            for rank, value in zip(unknown, found, strict=True):
                if value != ABSENT:
                    self._who[rank] = value.decode()
        return {
            rank: f"its process ended while the others waited for its {what} (killed, or it "
            "exited without leaving the session)"
            for rank in ranks
            if rank in self._who and liveness.ended(self._who[rank])
        }

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
        if value == _LEFT:
            raise self._left(pending(self.store), what)
        return value

    def _receive(self, tag: str) -> Any:
        """The coordinator's object for this rank under ``tag`` (broadcast or scatter)."""
        base = f"{self.ns}/{tag}"
        coordinator = self.c.coordinator
        self._sends += 1
        (key,) = self._decision_keys(self._sends, [self.c.rank])
        value = self._await(key, f"decision on {tag!r}", lambda _: [coordinator])
        # The coordinator answers only once it finished the gather before (and removed its
        # count): the count is no longer this rank's to remove. Removed at close instead, it
        # could be the next session's count under the same name, and lose a report.
        self._counted = ""
        if self._told:
            self._forget_told()
        # The coordinator sends only after it has read every report before: they can go.
        for key in self._unread:
            self.store.delete_key(key)
        self._unread = []
        if value[:1] == _INLINE:
            return pickle.loads(value[1:])
        assert value[:1] == _SHARED, value[:16]
        shared = f"{base}/shared"
        data = self.store.get(shared)
        if int(self.store.add(f"{shared}/reads", 1)) == int(value[1:]):
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

    def _others(self) -> tuple[list[int], list[str]]:
        """(coordinator) The other ranks, and their keys for this decision."""
        self._sends += 1
        ranks = [r for r in range(self.c.world_size) if r != self.c.rank and r not in self._gone]
        return ranks, self._decision_keys(self._sends, ranks)

    # -- exchanges ----------------------------------------------------------------------------

    @_marking
    def gather(self, tag: str, obj: Any) -> list[Any] | None:
        base = f"{self.ns}/{tag}"
        world = self.c.world_size
        mine = f"{base}/{self.c.rank}"
        self._gathers += 1
        wake = self._wake_key(self._gathers)
        self.store.set(mine, pickle.dumps(obj))
        self._delivered = self._gathers
        self._counted = f"{base}/count"
        if int(self.store.add(self._counted, 1)) == world:
            self.store.set(wake, _READY)  # the last to report wakes the coordinator
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

        try:
            self._await(wake, f"report for {tag!r}", pending)
            if self._told:
                self._forget_told()
        except PeerLost as e:
            if self._told:
                self._forget_told()  # nothing is sent to the lost; what was reported goes
            self._gone.update(e.ranks)
            self._unanswered.append(base)
            with contextlib.suppress(Exception):
                self.store.delete_key(mine)
                self.store.delete_key(f"{base}/count")
            raise
        out = [pickle.loads(v) for v in self.store.multi_get(keys)]
        self.store.delete_key(mine)
        self.store.delete_key(f"{base}/count")
        self._counted = ""  # removed here: see _receive
        self._unanswered.append(base)
        return out

    @_marking
    def broadcast(self, tag: str, obj: Any = None) -> Any:
        if not self.c.is_coordinator:
            return self._receive(tag)
        base = f"{self.ns}/{tag}"
        _, keys = self._others()
        data = pickle.dumps(obj)
        if len(data) <= INLINE_MAX:
            self._send(keys, [_INLINE + data] * len(keys))
        else:
            self.store.set(f"{base}/shared", data)
            self._send(keys, [_SHARED + str(len(keys)).encode()] * len(keys))
        return obj

    @_marking
    def scatter(self, tag: str, objs: list[Any] | None = None) -> Any:
        if not self.c.is_coordinator:
            return self._receive(tag)
        assert objs is not None and len(objs) == self.c.world_size
        ranks, keys = self._others()
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
