"""The process's shared I/O pool can be let go between runs without disturbing a run in flight."""

from __future__ import annotations

import threading

from trainsnap.engine.pool import TaskRunner, run_all, shut_down_idle_pools


def _io_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("trainsnap-io_")}


def test_idle_pools_shut_down_and_the_next_run_starts_a_fresh_one():
    assert run_all([lambda: 1, lambda: 2, lambda: 3], 3) == [1, 2, 3]
    started = _io_threads()
    assert started  # the run went through the shared pool
    assert shut_down_idle_pools() >= 1
    assert not any(t.is_alive() for t in started)
    assert not _io_threads()
    assert run_all([lambda: 4, lambda: 5], 3) == [4, 5]  # a fresh pool, same answers
    assert _io_threads() and not _io_threads() & started


def test_a_pool_in_use_is_left_alone_and_its_tasks_finish():
    shut_down_idle_pools()
    release = threading.Event()
    both_started = threading.Barrier(3, timeout=30)

    def blocked() -> threading.Thread:
        both_started.wait()
        release.wait(30)
        return threading.current_thread()

    with TaskRunner[threading.Thread](2) as runner:
        runner.submit(blocked)
        runner.submit(blocked)
        both_started.wait()
        assert shut_down_idle_pools() == 0  # the runner's pool is in use: kept
        release.set()
    working = set(runner.results())
    assert len(working) == 2 and all(t.is_alive() for t in working)
    # Kept for the next runner, and let go once that one is done too.
    assert run_all([lambda: 6, lambda: 7], 2) == [6, 7]
    assert _io_threads() == working
    assert shut_down_idle_pools() == 1
    assert not any(t.is_alive() for t in working)
