"""The I/O thread pool: tasks run on a few threads, and a failure stops the rest.

Hashing (xxhash, hashlib) and the read/write system calls release the GIL, so a few threads
keep the disk busy while Python only schedules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")


def run_all(tasks: Iterable[Callable[[], T]], threads: int) -> list[T]:
    """Run tasks on a pool; on the first failure cancel what has not started, wait for what has
    (no thread may touch caller memory after this returns), and raise that failure."""
    tasks = list(tasks)
    if not tasks:
        return []
    if threads <= 1 or len(tasks) == 1:
        return [t() for t in tasks]
    with ThreadPoolExecutor(max_workers=min(threads, len(tasks))) as pool:
        futures: list[Future[T]] = [pool.submit(t) for t in tasks]
        _done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in futures if f.done() and not f.cancelled() and f.exception()]
        if failed:
            for f in pending:
                f.cancel()
            wait(pending)
            exc = failed[0].exception()
            assert exc is not None
            raise exc
        return [f.result() for f in futures]
