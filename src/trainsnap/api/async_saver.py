"""Asynchronous saves: the caller is blocked for capture, plan and one copy into staging
buffers; writing, hashing and the commit run on a background thread.

At most ``max_in_flight`` saves are in flight per :class:`AsyncSaver` (default 1). A new save
waits for the oldest to finish (that wait is part of its pause), or, with ``skip_if_busy``, is
skipped with a log line. A background failure is never lost: it is raised by the next
:meth:`AsyncSaver.save`, by :meth:`SaveHandle.wait` and by :meth:`AsyncSaver.close`. At exit the
process waits for saves in flight; a save cut short (the process killed) never committed, since
its marker is written last.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from trainsnap.engine.staging import StagingPool
from trainsnap.errors import InvalidArgumentError, TrainsnapError
from trainsnap.protocol.control_plane import Comm
from trainsnap.protocol.rank_save import SaveRequest
from trainsnap.protocol.save_protocol import PendingSave, SaveResult, finish_save, prepare_save
from trainsnap.protocol.snapshot_info import SnapshotInfo
from trainsnap.storage.base import Storage

log = logging.getLogger(__name__)


class SaveHandle:
    """A save in flight. :meth:`wait` returns the committed snapshot or raises why not."""

    def __init__(self, pending: PendingSave | None, saver: AsyncSaver | None) -> None:
        self._pending = pending
        self._saver = saver
        self._done = threading.Event()
        """Set once the outcome is known and every done callback has run."""
        self._outcome = threading.Event()
        """Set once the outcome is known (the callbacks run after it)."""
        self._finisher: int | None = None
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        self._observed = False
        self._callbacks: list[Callable[[SaveHandle], None]] = []
        self._callbacks_lock = threading.Lock()
        self.snapshot_id = pending.snapshot_id if pending else ""
        self.step = pending.opts.step if pending else -1
        self.pause = pending.waited + pending.pause if pending else 0.0
        """Seconds the caller was blocked by this save (waiting for earlier saves included)."""

    def done(self) -> bool:
        """Whether the save finished (committed or failed) and its done callbacks ran (within
        a done callback: whether the outcome is known, which it is)."""
        if self._done.is_set():
            return True
        return self._outcome.is_set() and self._finisher == threading.get_ident()

    def wait(self, timeout: float | None = None) -> SnapshotInfo:
        """Block until committed and every done callback added before that has run; return
        the snapshot or raise why it was not committed. Called from a done callback, returns
        as soon as the outcome is known."""
        own = self._finisher == threading.get_ident()
        if not (self._outcome if own else self._done).wait(timeout):
            raise TimeoutError(f"save of snapshot {self.snapshot_id} still running")
        self._observed = True
        if self._error is not None:
            raise self._error
        assert self._result is not None and self._pending is not None
        return self._result.info(self._pending.storage.url)

    def add_done_callback(self, fn: Callable[[SaveHandle], None]) -> None:
        """Call ``fn(handle)`` once the save finished (committed or failed), on the thread that
        finished it and before :meth:`wait` returns and :meth:`done` is true, or at once if it
        already has. ``fn`` may call :meth:`wait` to learn the outcome; an exception it raises
        is logged, never lost silently, and does not change the save's outcome."""
        with self._callbacks_lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        self._call(fn)

    def _call(self, fn: Callable[[SaveHandle], None]) -> None:
        try:
            fn(self)
        except Exception:
            log.exception("a done callback of the save of snapshot %s raised", self.snapshot_id)

    @property
    def result(self) -> SaveResult | None:
        return self._result

    def _run(self, pool: StagingPool) -> None:
        assert self._pending is not None
        try:
            self._result = finish_save(self._pending)
        except BaseException as e:  # kept for the caller: raised by wait() / the next save
            self._error = e
            log.error("background save of snapshot %s failed: %s", self.snapshot_id, e)
        finally:
            if self._pending.lease is not None:
                pool.release(self._pending.lease)
            self._finisher = threading.get_ident()
            self._outcome.set()
            while True:  # callbacks added while these run are run too, before done
                with self._callbacks_lock:
                    callbacks, self._callbacks = self._callbacks, []
                    if not callbacks:
                        self._done.set()
                        break
                for fn in callbacks:
                    self._call(fn)


class AsyncSaver:
    """Runs saves in the background with a bound on saves in flight and a staging pool."""

    def __init__(
        self,
        *,
        max_in_flight: int = 1,
        skip_if_busy: bool = False,
        staging_budget: int | None = None,
    ) -> None:
        if max_in_flight < 1:
            raise InvalidArgumentError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.skip_if_busy = skip_if_busy
        self.pool = StagingPool(staging_budget)
        self._inflight: deque[SaveHandle] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self.peak_in_flight = 0
        _live.add(self)

    def in_flight(self) -> int:
        with self._lock:
            return sum(1 for h in self._inflight if not h._outcome.is_set())

    def _reap(self, raise_errors: bool) -> None:
        """Drop finished saves; raise the first unobserved background error."""
        with self._lock:
            finished = [h for h in self._inflight if h._outcome.is_set()]
            self._inflight = deque(h for h in self._inflight if not h._outcome.is_set())
        if raise_errors:
            for h in finished:
                if h._error is not None and not h._observed:
                    h._observed = True
                    raise h._error

    def wait_for_room(self) -> None:
        """Wait until fewer than ``max_in_flight`` saves are in flight (raising the first
        background error not yet raised), unless ``skip_if_busy``: the next :meth:`save` then
        starts at once. A caller that counts saves from their start (the manager's collector
        gate) calls this first, so that a save waiting for room is not counted as in flight."""
        self._reap(raise_errors=True)
        while not self.skip_if_busy and self.in_flight() >= self.max_in_flight:
            with self._lock:
                oldest = next((h for h in self._inflight if not h._outcome.is_set()), None)
            if oldest is not None:
                oldest._outcome.wait()
            self._reap(raise_errors=True)

    def save(
        self, state: Any, storage: Storage, opts: SaveRequest, comm: Comm, *, alone: bool = False
    ) -> SaveHandle | None:
        """Start a save; returns once its state is staged (None when skipped as busy). With
        ``alone`` it first waits until no other save is in flight, and is never skipped (a save
        whose commit moves bytes between ranks, which must run one at a time and in the same
        order on every rank: the memory tier's). A save whose state does not fit the staging
        budget is written before this returns (from the state itself)."""
        if self._closed:
            raise TrainsnapError("this AsyncSaver is closed")
        t0 = time.perf_counter()
        self._reap(raise_errors=True)
        limit = 1 if alone else self.max_in_flight
        while self.in_flight() >= limit:
            if self.skip_if_busy and not alone:
                log.info(
                    "save of step %d skipped: %d save(s) still in flight",
                    opts.step,
                    self.in_flight(),
                )
                return None
            with self._lock:
                oldest = next(h for h in self._inflight if not h._outcome.is_set())
            oldest._outcome.wait()
            self._reap(raise_errors=True)
        waited = time.perf_counter() - t0
        pending = prepare_save(state, storage, opts, comm, pool=self.pool)
        pending.waited = waited
        handle = SaveHandle(pending, self)
        with self._lock:
            self._inflight.append(handle)
            self.peak_in_flight = max(self.peak_in_flight, len(self._inflight))
        if pending.lease is None:  # not staged: the state itself is read, so not in the background
            handle._run(self.pool)
            return handle
        thread = threading.Thread(
            target=handle._run, args=(self.pool,), name=f"trainsnap-save-{opts.step}", daemon=True
        )
        thread.start()
        return handle

    def wait(self) -> None:
        """Wait for every save in flight; raise the first background error not yet raised."""
        with self._lock:
            handles = list(self._inflight)
        for h in handles:
            h._done.wait()
        self._reap(raise_errors=True)

    def close(self) -> None:
        """Wait for every save in flight, then refuse new ones; raises a background error."""
        try:
            self.wait()
        finally:
            self._closed = True
            _live.discard(self)


_live: weakref.WeakSet[AsyncSaver] = weakref.WeakSet()
_default: AsyncSaver | None = None
_default_lock = threading.Lock()


def default_saver() -> AsyncSaver:
    """The process's saver for :func:`trainsnap.async_save`."""
    global _default
    with _default_lock:
        if _default is None or _default._closed:
            _default = AsyncSaver()
        return _default


@atexit.register
def _drain_at_exit() -> None:
    """Exiting waits for saves in flight rather than abandoning them half-way (an abandoned
    save would be harmless -- uncommitted -- but lost)."""
    for saver in list(_live):
        pending = saver.in_flight()
        if pending:
            log.info("waiting for %d save(s) in flight before exit", pending)
        try:
            saver.wait()
        except BaseException as e:
            log.error("a background save failed at exit: %s", e)
