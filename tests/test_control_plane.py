"""The control plane (``protocol/control_plane.py``) over a real ``torch.distributed.TCPStore``.

One master store on loopback; each logical rank is a thread with a store client of its own, as each
process of a job would have (and each session clones that client, as it does in a job). Timeouts
are short where a lost peer must be found, so that it is found in about a second.

Two precautions keep the timings honest on a loaded machine: the clients are made once per module
(and the master listens on IPv4, see ``trainsnap.testing.loopback``: a dual-stack one can stall
5 s at each connect where the resolver does not answer), and before a timed exchange every live
rank waits until its session's heartbeat thread has beaten (a session connects twice: a rank
still connecting has not started beating). Where every rank is
alive the heartbeat timeout is generous, so that a slow connect is not taken for a dead peer.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed import TCPStore

from trainsnap.errors import CommitFailedError, TrainsnapError
from trainsnap.protocol.control_plane import (
    INLINE_MAX,
    LocalComm,
    PeerLost,
    StoreComm,
    StoreSession,
    Timeouts,
)
from trainsnap.testing.counting_store import CountingStore
from trainsnap.testing.loopback import master_store

ALIVE = Timeouts(exchange=60.0, heartbeat=30.0, beat_every=0.05)
"""Every rank alive: nothing is declared lost, however slow a connect."""
FAST = Timeouts(exchange=60.0, heartbeat=0.6, beat_every=0.05)
"""A lost peer is found 0.6 s after the first look at it."""
STORE_TIMEOUT = timedelta(seconds=30)
MAX_WORLD = 4


@pytest.fixture(scope="module")
def store() -> Iterator[tuple[TCPStore, list[TCPStore]]]:
    """The master (the rendezvous store of a job) and one client per rank, made in parallel."""
    master = master_store(timeout=STORE_TIMEOUT)

    def client(_rank: int) -> TCPStore:
        return TCPStore("127.0.0.1", master.port, is_master=False, timeout=STORE_TIMEOUT)

    with ThreadPoolExecutor(max_workers=MAX_WORLD) as pool:
        clients = list(pool.map(client, range(MAX_WORLD)))
    yield master, clients


@pytest.fixture
def master(store: tuple[TCPStore, list[TCPStore]]) -> TCPStore:
    return store[0]


@pytest.fixture
def run(store: tuple[TCPStore, list[TCPStore]]) -> Callable[..., list[Any]]:
    """``run(world, body, **comm_kwargs)``: ``body(comm)`` on every rank at once, each on a thread
    with its own client, in a namespace of this test's own; each rank's result, or its exception."""
    master, clients = store
    namespace = f"test-{uuid.uuid4().hex[:8]}"

    def run_ranks(world: int, body: Callable[[StoreComm], Any], **kwargs: Any) -> list[Any]:
        kwargs.setdefault("timeouts", ALIVE)
        comms = [
            StoreComm(clients[r], r, world, namespace=namespace, **kwargs) for r in range(world)
        ]

        def guarded(c: StoreComm) -> Any:
            try:
                return body(c)
            except Exception as e:
                return e

        with ThreadPoolExecutor(max_workers=world) as pool:
            futures = [pool.submit(guarded, c) for c in comms]
            return [f.result(timeout=60) for f in futures]

    run_ranks.master = master  # type: ignore[attr-defined]
    return run_ranks


def in_session(c: StoreComm, body: Callable[[StoreSession], Any]) -> Any:
    session = c.session("save")
    try:
        return body(session)
    finally:
        session.close()


def beating(master: TCPStore, session: StoreSession) -> StoreSession:
    """Wait until the session's heartbeat thread is connected and has beaten once."""
    deadline = time.monotonic() + 30
    while int(master.add(session._beat_key, 0)) < 2:
        assert time.monotonic() < deadline, "the heartbeat thread never beat"
        time.sleep(0.01)
    return session


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(fn()'s result or the PeerLost it raised, seconds it took)."""
    start = time.monotonic()
    try:
        out = fn()
    except PeerLost as e:
        out = e
    return out, time.monotonic() - start


# -- exchanges deliver the right values to every rank ---------------------------------------------


def test_gather_gives_the_coordinator_every_rank_object_by_rank(run: Any) -> None:
    def body(c: StoreComm) -> Any:
        return in_session(c, lambda s: s.gather("meta", {"rank": c.rank, "sq": c.rank**2}))

    out = run(4, body)
    assert out[0] == [{"rank": r, "sq": r * r} for r in range(4)]
    assert out[1:] == [None, None, None]


def test_broadcast_gives_every_rank_the_coordinator_object(run: Any) -> None:
    plan = {"snapshot_id": "abc", "writers": [3, 1, 2, 0], "blob": b"\x00\xff" * 1000}

    def body(c: StoreComm) -> Any:
        mine = plan if c.is_coordinator else {"ignored": c.rank}
        return in_session(c, lambda s: s.broadcast("plan", mine))

    assert run(4, body) == [plan] * 4


def test_scatter_gives_each_rank_its_own_part(run: Any) -> None:
    parts = [f"assignment of rank {r}" for r in range(4)]

    def body(c: StoreComm) -> Any:
        return in_session(c, lambda s: s.scatter("assign", parts if c.is_coordinator else None))

    assert run(4, body) == parts


def test_a_whole_save_round_with_a_coordinator_other_than_rank_0(run: Any) -> None:
    """gather -> scatter -> gather -> broadcast, as a save runs them, led by rank 2."""

    def body(c: StoreComm) -> Any:
        def steps(s: StoreSession) -> Any:
            metas = s.gather("meta", 10 + c.rank)
            plan = [sum(metas) * (r + 1) for r in range(c.world_size)] if metas else None
            mine = s.scatter("plan", plan)
            reports = s.gather("report", (c.rank, mine))
            outcome = s.broadcast("outcome", {"committed": sorted(reports)} if reports else None)
            return metas, mine, outcome

        return in_session(c, steps)

    out = run(3, body, coordinator=2)
    total = 10 + 11 + 12
    expect_outcome = {"committed": [(r, total * (r + 1)) for r in range(3)]}
    for rank, (metas, mine, outcome) in enumerate(out):
        assert metas == ([10, 11, 12] if rank == 2 else None)
        assert mine == total * (rank + 1)
        assert outcome == expect_outcome


def test_sessions_keep_their_exchanges_apart_and_leave_no_keys_behind(run: Any) -> None:
    master = run.master
    before = master.num_keys()

    def body(c: StoreComm) -> Any:
        out = []
        for save in range(2):  # the same tags in every session: each save sees its own values
            out.append(
                in_session(
                    c,
                    lambda s, save=save: (
                        s.gather("meta", (save, c.rank)),
                        s.broadcast("plan", f"plan {save}"),
                        s.scatter("assign", [f"{save}/{r}" for r in range(3)]),
                    ),
                )
            )
        return out

    out = run(3, body)
    for rank, saves in enumerate(out):
        for save, (gathered, plan, assigned) in enumerate(saves):
            assert gathered == ([(save, r) for r in range(3)] if rank == 0 else None)
            assert plan == f"plan {save}"
            assert assigned == f"{save}/{rank}"
    # Every exchange's keys and every heartbeat are gone: a long job does not grow the store.
    assert master.num_keys() == before


def test_a_coordinator_outside_the_world_is_refused(master: TCPStore) -> None:
    with pytest.raises(ValueError, match="coordinator 3 outside world of 3"):
        StoreComm(master, 0, 3, coordinator=3)


# -- lost peers are found in time and named --------------------------------------------------------


def test_a_rank_that_never_takes_part_is_named_once_its_heartbeat_timeout_passes(
    run: Any,
) -> None:
    world, dead = 3, 2
    live = threading.Barrier(world - 1)

    def body(c: StoreComm) -> Any:
        if c.rank == dead:
            return "never started"
        session = beating(run.master, c.session("save"))
        try:
            live.wait(30)
            return timed(lambda: session.gather("meta", c.rank))
        finally:
            session.close()

    out = run(world, body, timeouts=FAST)
    err, seconds = out[0]
    assert isinstance(err, PeerLost) and isinstance(err, CommitFailedError)
    assert set(err.ranks) == {dead} and err.rank_errors == err.ranks
    assert "no sign of life" in err.ranks[dead] and "report for 'meta'" in err.ranks[dead]
    assert f"rank {dead}: no sign of life" in str(err)
    assert FAST.heartbeat * 0.9 <= seconds < FAST.heartbeat + 2.0
    assert out[1][0] is None  # a non-coordinator's gather returns at once


def test_a_rank_that_stops_beating_mid_session_is_named(run: Any) -> None:
    """A rank hung (or killed) after it joined: its heartbeat key stays, but stops changing."""
    world, hung = 4, 3
    joined = threading.Barrier(world)
    coordinator_done = threading.Event()

    def body(c: StoreComm) -> Any:
        session = beating(run.master, c.session("save"))
        try:
            if c.rank == hung:
                session._stop.set()  # what a killed process leaves: a heartbeat that stops
                session._beater.join()
                joined.wait(30)
                coordinator_done.wait(30)
                return "hung"
            joined.wait(30)
            return timed(lambda: session.gather("meta", c.rank))
        finally:
            if c.is_coordinator:
                coordinator_done.set()
            session.close()

    out = run(world, body, timeouts=FAST)
    err, seconds = out[0]
    assert isinstance(err, PeerLost), err
    assert list(err.ranks) == [hung] and "no sign of life" in err.ranks[hung]
    assert FAST.heartbeat * 0.9 <= seconds < FAST.heartbeat + 2.0
    assert [o[0] for o in out[1:hung]] == [None, None]


def test_a_dead_coordinator_is_named_by_the_ranks_waiting_for_its_decision(run: Any) -> None:
    world = 3
    live = threading.Barrier(world - 1)

    def body(c: StoreComm) -> Any:
        if c.is_coordinator:
            return "dead"
        session = beating(run.master, c.session("save"))
        try:
            live.wait(30)
            return timed(lambda: session.broadcast("plan"))
        finally:
            session.close()

    out = run(world, body, timeouts=FAST)
    for err, seconds in out[1:]:
        assert isinstance(err, PeerLost)
        assert list(err.ranks) == [0]
        assert "no sign of life" in err.ranks[0] and "decision on 'plan'" in err.ranks[0]
        assert FAST.heartbeat * 0.9 <= seconds < FAST.heartbeat + 2.0


def test_a_slow_rank_that_keeps_beating_is_waited_for(run: Any) -> None:
    """Slow is not dead: a rank that reports two heartbeat timeouts late is still heard."""
    world, slow = 3, 1
    joined = threading.Barrier(world)

    def body(c: StoreComm) -> Any:
        session = beating(run.master, c.session("save"))
        try:
            joined.wait(30)
            if c.rank == slow:
                time.sleep(2 * FAST.heartbeat)
            return timed(lambda: session.gather("report", f"report {c.rank}"))
        finally:
            session.close()

    out = run(world, body, timeouts=FAST)
    gathered, seconds = out[0]
    assert gathered == ["report 0", "report 1", "report 2"]
    assert seconds >= 2 * FAST.heartbeat * 0.9  # it did wait for the slow one


def test_a_live_rank_that_never_reports_is_named_when_the_exchange_times_out(run: Any) -> None:
    timeouts = Timeouts(exchange=1.0, heartbeat=30.0, beat_every=0.05)
    silent = 1
    done = threading.Event()

    def body(c: StoreComm) -> Any:
        def steps(s: StoreSession) -> Any:
            if c.rank == silent:
                done.wait(30)  # alive (its session beats) but never delivers
                return "silent"
            try:
                return timed(lambda: s.gather("report", c.rank))
            finally:
                done.set()

        return in_session(c, steps)

    out = run(2, body, timeouts=timeouts)
    err, seconds = out[0]
    assert isinstance(err, PeerLost)
    assert err.ranks == {silent: "no report for 'report' within the 1 s timeout"}
    assert 0.9 <= seconds < 3.0


# -- one process -------------------------------------------------------------------------------


def test_local_comm_is_a_world_of_one() -> None:
    c = LocalComm()
    assert (c.rank, c.world_size, c.coordinator, c.is_coordinator) == (0, 1, 0, True)
    s = c.session("save")
    obj = {"a": [1, 2]}
    assert s.gather("meta", obj) == [obj]
    assert s.broadcast("plan", obj) is obj
    assert s.scatter("assign", ["only", "ignored"]) == "only"
    s.close()


def test_peer_lost_is_a_trainsnap_error_carrying_every_lost_rank() -> None:
    err = PeerLost("2 rank(s) did not deliver", {3: "gone", 1: "hung"})
    assert isinstance(err, TrainsnapError) and isinstance(err, CommitFailedError)
    assert err.ranks == {3: "gone", 1: "hung"} and err.rank_errors == err.ranks
    assert str(err) == "2 rank(s) did not deliver\n  - rank 1: hung\n  - rank 3: gone"


# -- what it costs the store -----------------------------------------------------------------------


def test_the_beat_interval_derives_from_the_heartbeat_timeout_unless_given() -> None:
    assert Timeouts().beat_interval == 5.0  # 60 s / 12: a beat (and a scan) every 5 s
    assert Timeouts(heartbeat=20.0).beat_interval == 2.0  # the floor
    assert Timeouts(heartbeat=4.0).beat_interval == 1.0  # short timeouts: a quarter of them
    assert Timeouts(heartbeat=600.0).beat_interval == 50.0
    assert Timeouts(heartbeat=60.0, beat_every=0.05).beat_interval == 0.05


def counted(store: tuple[TCPStore, list[TCPStore]], world: int) -> tuple[list[CountingStore], str]:
    """A counting client per rank (over the module's clients), in a namespace of its own."""
    return [CountingStore(client) for client in store[1][:world]], f"test-{uuid.uuid4().hex[:8]}"


def on_threads(comms: list[StoreComm], body: Callable[[StoreComm], Any]) -> list[Any]:
    with ThreadPoolExecutor(max_workers=len(comms)) as pool:
        return [f.result(timeout=60) for f in [pool.submit(body, c) for c in comms]]


def test_waiting_costs_no_polls_and_liveness_one_bulk_scan_a_beat(
    store: tuple[TCPStore, list[TCPStore]],
) -> None:
    """The coordinator waits 1.2 s for a slow rank: its exchange client makes a fixed handful
    of operations whatever the wait (no polling), its heartbeat thread about one beat and one
    bulk scan of the one pending rank each interval, and the ranks waiting for the
    coordinator's answer as few."""
    world, slow, beat, hold = 4, 3, 0.1, 1.2
    clients, namespace = counted(store, world)
    timeouts = Timeouts(exchange=60.0, heartbeat=30.0, beat_every=beat)
    comms = [
        StoreComm(clients[r], r, world, namespace=namespace, timeouts=timeouts)
        for r in range(world)
    ]
    joined = threading.Barrier(world)

    def body(c: StoreComm) -> Any:
        session = c.session("save")
        try:
            joined.wait(30)
            if c.rank == slow:
                time.sleep(hold)
            gathered = session.gather("report", c.rank)
            return gathered, session.broadcast("outcome", "committed" if gathered else None)
        finally:
            session.close()

    out = on_threads(comms, body)
    assert out[0] == ([0, 1, 2, 3], "committed") and out[1] == (None, "committed")
    intervals = hold / beat
    for rank, client in enumerate(clients):
        counts = client.counts
        exchange, heartbeat = counts.total("exchange"), counts.total("heartbeat")
        # open (1 add), gather (set, add), wait, get, delete, and the rest fixed: no polling;
        # the coordinator's answer is a set for each other rank
        answers = world - 1 if rank == 0 else 0
        assert exchange <= 10 + answers, (rank, counts.snapshot())
        # each interval: one beat, and while waiting one scan (a check and a read of a key)
        assert heartbeat <= 4 * intervals + 8, (rank, counts.snapshot())
        assert counts.ops["heartbeat", "add"] >= 0.5 * intervals, (rank, counts.snapshot())


def test_sessions_reuse_their_store_clients(store: tuple[TCPStore, list[TCPStore]]) -> None:
    """A job connects a session's two clients once, not once per save."""
    world = 2
    clients, namespace = counted(store, world)
    comms = [StoreComm(clients[r], r, world, namespace=namespace, timeouts=ALIVE) for r in (0, 1)]

    def body(c: StoreComm) -> Any:
        return [in_session(c, lambda s, n=n: s.broadcast("plan", n)) for n in range(3)]

    assert on_threads(comms, body) == [[0, 1, 2]] * 2
    assert [client.counts.clients for client in clients] == [3, 3]  # the rank's own and two


def test_every_comm_over_a_store_reuses_the_clients_of_its_sessions(
    store: tuple[TCPStore, list[TCPStore]],
) -> None:
    """``trainsnap.save`` makes a ``StoreComm`` a call: the clients are still connected once a
    process, not twice a rank at every save. A session whose exchange failed keeps neither."""
    world = 2
    clients, namespace = counted(store, world)

    def body(rank: int) -> Any:
        out = []
        for n in range(3):  # three calls, each with a comm of its own (sessions of one name)
            c = StoreComm(clients[rank], rank, world, namespace=namespace, timeouts=ALIVE)
            # a gather first, as every save and load has: the coordinator waits for the others
            out.append(
                in_session(c, lambda s, n=n: (s.gather("meta", n), s.broadcast("plan", n))[1])
            )
        return out

    with ThreadPoolExecutor(max_workers=world) as pool:
        assert list(pool.map(body, range(world))) == [[0, 1, 2]] * 2
    assert [client.counts.clients for client in clients] == [3, 3]
    alone = StoreComm(clients[0], 0, 2, namespace=namespace, timeouts=FAST)
    failed = alone.session("save")
    with pytest.raises(PeerLost):
        failed.gather("meta", 0)  # rank 1 never reports: its heartbeat never appears
    failed.close()
    in_session(alone, lambda s: s.publish("part", "x", b"", 0))
    assert clients[0].counts.clients == 4  # the failed session's client was dropped


def test_a_gather_nobody_answers_and_a_large_broadcast_leave_no_keys_behind(run: Any) -> None:
    """The coordinator removes the reports of a gather it never answered (each rank removes its
    own once answered); the last reader removes a broadcast too large to copy to every rank."""
    master = run.master
    before = master.num_keys()
    large = b"\x01" * (4 * INLINE_MAX)

    def body(c: StoreComm) -> Any:
        plan = in_session(c, lambda s: s.broadcast("plan", large if c.is_coordinator else None))
        return plan, in_session(c, lambda s: s.gather("meta", c.rank))

    out = run(4, body)
    assert out[0] == (large, [0, 1, 2, 3]) and out[3] == (large, None)
    assert master.num_keys() == before


def test_large_scatters_in_sessions_of_one_name_never_see_an_earlier_one(run: Any) -> None:
    """Scatters of several MiB a rank, in sessions of one name (as successive ``ts.load`` calls
    open them): each rank gets this session's part, and nothing is left behind. torch's libuv
    store applies a ``multi_set`` again when its bytes arrive in more than one read, which set
    a rank's key again after the rank had read and removed it: the next session read it."""
    master = run.master
    before = master.num_keys()
    big = 3 << 20

    def body(c: StoreComm) -> Any:
        got = []
        for session in range(3):
            parts = [bytes([session, r]) * (big // 2) for r in range(4)]
            mine = in_session(c, lambda s, p=parts: s.scatter("parts", p if c.rank == 0 else None))
            got.append(mine[:2])
        return got

    out = run(4, body)
    assert out == [[bytes([session, rank]) for session in range(3)] for rank in range(4)]
    assert master.num_keys() == before


def test_a_killed_rank_is_named_within_the_heartbeat_timeout_at_the_derived_interval(
    run: Any,
) -> None:
    """No beat interval given: 1 s heartbeat, a beat every 0.25 s. A rank that joined and then
    stopped (as a killed process does) is named about a heartbeat timeout later, among ranks
    that keep beating; the others get the failure from the coordinator."""
    timeouts = Timeouts(exchange=60.0, heartbeat=1.0)
    world, killed = 4, 2
    joined = threading.Barrier(world)
    coordinator_done = threading.Event()

    def body(c: StoreComm) -> Any:
        session = beating(run.master, c.session("save"))
        try:
            if c.rank == killed:
                session._stop.set()
                session._beater.join()
                joined.wait(30)
                coordinator_done.wait(30)
                return "killed"
            joined.wait(30)
            result = timed(lambda: session.gather("report", c.rank))
            if c.is_coordinator:
                failed = result[0] if isinstance(result[0], PeerLost) else None
                session.broadcast("outcome", None if failed is None else failed.ranks)
                return result
            return session.broadcast("outcome")
        finally:
            if c.is_coordinator:
                coordinator_done.set()
            session.close()

    out = run(world, body, timeouts=timeouts)
    err, seconds = out[0]
    assert isinstance(err, PeerLost) and list(err.ranks) == [killed], err
    assert "no sign of life" in err.ranks[killed]
    assert timeouts.heartbeat * 0.9 <= seconds < timeouts.heartbeat + 2 * 0.25 + 1.0
    assert out[1] == out[3] == err.ranks


# -- a stalled store, a client cut off ---------------------------------------------------------


class Stalling:
    """A store client whose operations wait while ``running`` is clear (the store's server
    stalled for everyone); once it is set again, those of a lagging client wait ``lag`` s more
    (their requests were queued behind the others'). Its clones do the same."""

    def __init__(self, store: Any, running: threading.Event, lag: float) -> None:
        self._store, self._running, self._lag = store, running, lag

    def clone(self) -> Stalling:
        return Stalling(self._store.clone(), self._running, self._lag)

    def __getattr__(self, name: str) -> Any:
        operation = getattr(self._store, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if not self._running.is_set():
                self._running.wait()
                time.sleep(self._lag)
            return operation(*args, **kwargs)

        return call


def test_a_store_that_stalls_for_everyone_longer_than_the_heartbeat_names_nobody(
    store: tuple[TCPStore, list[TCPStore]],
) -> None:
    """The store stops answering for three heartbeat timeouts while the coordinator waits. After
    it, the coordinator's scan is answered before the others' beats (queued behind it): every
    rank looks silent for the length of the stall, but none is taken for dead -- silence counts
    only while the store answers."""
    world, stall, lag = 3, 3.0, 0.2
    timeouts = Timeouts(exchange=60.0, heartbeat=1.0, beat_every=0.05)
    running = threading.Event()
    running.set()
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    comms = [
        StoreComm(
            Stalling(store[1][r], running, 0.0 if r == 0 else lag),
            r,
            world,
            namespace=namespace,
            timeouts=timeouts,
        )
        for r in range(world)
    ]
    joined = threading.Barrier(world)
    waiting, resumed = threading.Event(), threading.Event()

    def body(c: StoreComm) -> Any:
        session = beating(store[0], c.session("save"))
        try:
            joined.wait(30)
            if c.is_coordinator:
                waiting.set()
            else:
                resumed.wait(30)
            return timed(lambda: session.gather("meta", c.rank))
        finally:
            session.close()

    def stall_the_store() -> None:
        waiting.wait(30)
        time.sleep(0.3)  # the coordinator is in its wait
        running.clear()
        time.sleep(stall)
        running.set()
        time.sleep(4 * lag)  # the others' beats are through
        resumed.set()

    with ThreadPoolExecutor(max_workers=world + 1) as pool:
        stalling = pool.submit(stall_the_store)
        out = [f.result(timeout=60) for f in [pool.submit(body, c) for c in comms]]
        stalling.result(timeout=60)
    gathered, seconds = out[0]
    assert gathered == [0, 1, 2], gathered
    assert seconds >= stall


class CutOff:
    """A store client (counted) whose ``cut``-th clone fails its first ``add``, as one that
    timed out does; what a client cut off answers next cannot be trusted."""

    def __init__(self, store: Any, cut: int, clones: list[CutOff] | None = None) -> None:
        self._store, self._cut = store, cut
        self.clones = clones if clones is not None else []
        self.failed = False
        self.asked_after = 0
        """Operations asked of it after it failed."""

    def clone(self) -> CutOff:
        twin = CutOff(self._store.clone(), self._cut, self.clones)
        self.clones.append(twin)
        return twin

    def __getattr__(self, name: str) -> Any:
        operation = getattr(self._store, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            cut_off = len(self.clones) >= self._cut and self is self.clones[self._cut - 1]
            if cut_off and name == "add" and not self.failed:
                self.failed = True
                raise RuntimeError("Socket Timeout")
            self.asked_after += self.failed
            return operation(*args, **kwargs)

        return call


def test_a_heartbeat_client_whose_operation_failed_is_replaced_and_never_asked_again(
    store: tuple[TCPStore, list[TCPStore]],
) -> None:
    """A session connects its exchange client, then its heartbeat client, whose first beat
    fails: the next beat connects another, the failed one is never used again nor kept, and the
    next session reuses the replacement."""
    world = 2
    clients, namespace = counted(store, world)
    cut = CutOff(clients[0], cut=2)
    comms = [
        StoreComm(cut, 0, world, namespace=namespace, timeouts=ALIVE),
        StoreComm(clients[1], 1, world, namespace=namespace, timeouts=ALIVE),
    ]

    def body(c: StoreComm) -> Any:
        out = []
        for n in range(2):
            session = c.session("save")
            try:
                if c.rank == 1:
                    time.sleep(0.3)  # the coordinator waits: its heartbeat beats and scans
                out.append((session.gather("meta", c.rank), session.broadcast("plan", n)))
            finally:
                session.close()
        return out

    assert on_threads(comms, body)[0] == [([0, 1], 0), ([0, 1], 1)]
    wait, failed, replacement = cut.clones
    assert failed.failed and failed.asked_after == 0 and failed is not replacement
    assert clients[0].counts.clients == 4  # the rank's own, and three clones, one a replacement
    assert clients[0].counts.ops["heartbeat", "add"] >= 2
    idle = [c for kind in comms[0]._idle_clients.values() for c in kind]
    assert failed not in idle and wait in idle and replacement in idle
