"""The I/O thread pool: tasks run on a few threads, and a failure stops the rest.

Hashing (xxhash, hashlib) and the read/write system calls release the GIL, so a few threads
keep the disk busy while Python only schedules. The threads are the process's, started once
and shared by every save and load (see :func:`_executor`), until :func:`shut_down_idle_pools`
lets them exit between runs (a framework that checks for leftover threads after each job).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from types import TracebackType
from typing import Generic, TypeVar

T = TypeVar("T")


class TaskRunner(Generic[T]):
    """Tasks submitted one by one run at once on up to ``threads`` threads, so that a caller
    can start the first reads while it is still planning the rest (a load of 2,000 tensors
    spends tens of milliseconds planning: the disk need not wait for it).

    Leaving the ``with`` block waits for every task. On the first failure (of a task, or of
    the block itself) what has not started is cancelled and what has is waited for (no thread
    may touch caller memory after the block), then that failure is raised; :meth:`submit` raises
    it too, so that a caller stops planning once a read failed. With one thread, tasks run
    inside :meth:`submit`.
    """

    def __init__(self, threads: int) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._owned = False
        if threads > 1:
            self._executor, self._owned = _executor(threads)
        self._futures: list[Future[T]] = []
        self._inline: list[T] = []
        self._failure: BaseException | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> TaskRunner[T]:
        return self

    def submit(self, task: Callable[[], T]) -> None:
        if self._executor is None:
            self._inline.append(task())
            return
        if self._failure is not None:
            raise self._failure
        future = self._executor.submit(task)
        future.add_done_callback(self._note)
        self._futures.append(future)

    def _note(self, future: Future[T]) -> None:
        if not future.cancelled() and future.exception() is not None:
            with self._lock:
                if self._failure is None:
                    self._failure = future.exception()

    def results(self) -> list[T]:
        """Every task's result, in submission order (once the block has exited)."""
        return self._inline + [f.result() for f in self._futures]

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._executor is None:
            return
        try:
            if exc is None:
                wait(self._futures, return_when=FIRST_EXCEPTION)
            failure = self._first_failure()
            if exc is not None or failure is not None:
                for future in self._futures:
                    future.cancel()
        finally:
            wait(self._futures)  # the shared pool outlives the block, the block's tasks do not
            if self._owned:
                self._executor.shutdown()
            else:
                _release(self._executor)
        if exc is None and failure is not None:
            raise failure

    def _first_failure(self) -> BaseException | None:
        # Asked of the futures, not of ``_note``: a waiter may wake before callbacks have run.
        for future in self._futures:
            if future.done() and not future.cancelled() and future.exception() is not None:
                return future.exception()
        return None


_PREFIX = "trainsnap-io"
_shared: dict[tuple[int, int], ThreadPoolExecutor] = {}
_users: dict[ThreadPoolExecutor, int] = {}
"""Runners inside their block on each shared pool: a pool with none may be shut down."""
_shared_lock = threading.Lock()


def _executor(threads: int) -> tuple[ThreadPoolExecutor, bool]:
    """The process's pool of ``threads`` threads, made once and kept: a thread start pays for
    a fresh stack, and while a load's first reads run each start waits for the GIL. A task
    that itself runs tasks gets a pool of its own: waiting on the shared one could take its
    last thread.
    Keyed by process too: a forked child inherits the pool but not its threads. With it,
    whether the caller owns the pool (shuts it down when done)."""
    if threading.current_thread().name.startswith(_PREFIX):
        return ThreadPoolExecutor(threads, thread_name_prefix=f"{_PREFIX}-nested"), True
    key = (os.getpid(), threads)
    with _shared_lock:
        pool = _shared.get(key)
        if pool is None:
            pool = _shared[key] = ThreadPoolExecutor(threads, thread_name_prefix=_PREFIX)
        _users[pool] = _users.get(pool, 0) + 1
    return pool, False


def _release(pool: ThreadPoolExecutor) -> None:
    with _shared_lock:
        _users[pool] -= 1
        if _users[pool] == 0:
            del _users[pool]


def shut_down_idle_pools() -> int:
    """Shut down this process's shared pools that no runner is using, and wait for their
    threads to exit; the next runner starts a fresh pool. A pool in use is left alone: its
    tasks go on and it is kept for later runners. Safe to call at any time from any thread.
    Returns how many pools were shut down. O(pools + their threads)."""
    pid = os.getpid()
    with _shared_lock:
        idle = [key for key, pool in _shared.items() if key[0] == pid and pool not in _users]
        pools = [_shared.pop(key) for key in idle]
    for pool in pools:  # outside the lock: no runner can reach a pool no longer in ``_shared``
        pool.shutdown(wait=True)
    return len(pools)


def run_all(tasks: Iterable[Callable[[], T]], threads: int) -> list[T]:
    """Run tasks on a pool; on the first failure cancel what has not started, wait for what has
    (no thread may touch caller memory after this returns), and raise that failure."""
    tasks = list(tasks)
    with TaskRunner[T](threads if len(tasks) > 1 else 1) as runner:
        for task in tasks:
            runner.submit(task)
    return runner.results()
