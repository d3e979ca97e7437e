"""The manager's work after a commit, off the training path.

:class:`Housekeeper` runs it in order on one background thread: recording the save, promotion to
the durable tier, retention, history quantisation, collection, progress records. Its queue is
bounded: when ``depth`` items wait, submitting waits for room (a remote tier slower than the
saves slows the saves rather than growing a backlog without bound). An error is kept and raised
once, by the next :meth:`Housekeeper.raise_error` (the manager's next ``step()``, ``save()``,
``wait()`` or ``close()``).

:class:`SaveGate` lets collection run while the manager is the root's only writer without a
grace period: an object nothing committed references may still be about to be referenced by a
save in flight (one that reuses it, or wrote it and has not committed yet). Every save of the
manager is counted from before its plan (no rank writes an object before it) until its commit
or failure, and the collector deletes only while no save is counted, none was when it read the
committed snapshots' references and none began since; otherwise it stops, and the next
commit's collection takes up what is left.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterator

from trainsnap.errors import TrainsnapError

log = logging.getLogger(__name__)


class SaveGate:
    """Saves in flight, as the collector must know them. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: set[int] = set()
        self._tokens = itertools.count(1)
        self.begun = 0
        """Saves begun so far: a collector that saw this number change must not trust the
        references it read before."""

    def begin(self) -> int:
        """A save is about to plan; returns its token for :meth:`end`."""
        with self._lock:
            token = next(self._tokens)
            self._open.add(token)
            self.begun += 1
            return token

    def end(self, token: int) -> None:
        """The save committed or failed (idempotent)."""
        with self._lock:
            self._open.discard(token)

    def mark(self) -> int | None:
        """Where a collector starts: the saves begun so far, or None when one is in flight
        (it may commit references the collector would not see)."""
        with self._lock:
            return None if self._open else self.begun

    @contextlib.contextmanager
    def quiet_since(self, begun: int | None) -> Iterator[bool]:
        """Holds saves from beginning while the body runs; yields whether no save is in flight
        and none began since :meth:`mark` returned ``begun`` (False for None). O(1)."""
        with self._lock:
            yield begun is not None and not self._open and self.begun == begun


class Housekeeper:
    """One background thread running submitted work in order, with a bounded queue."""

    def __init__(self, depth: int = 4, name: str = "trainsnap-after-commit") -> None:
        self._name = name
        self._queue: queue.Queue[tuple[str, Callable[[], None]] | None] = queue.Queue(depth)
        self._error: TrainsnapError | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, what: str, work: Callable[[], None], *, wait: bool = True) -> bool:
        """Queue ``work`` (``what`` names it in an error). Waits for room when the queue is
        full, or, with ``wait=False``, drops the work and returns False."""
        if self._closed:
            raise TrainsnapError(f"cannot run {what}: the manager is closed")
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        try:
            self._queue.put((what, work), block=wait)
        except queue.Full:
            return False
        return True

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                what, work = item
                try:
                    work()
                except Exception as e:  # kept for the training thread, raised there
                    log.exception("%s failed", what)
                    with self._lock:
                        if self._error is None:
                            self._error = _as_error(what, e)
            finally:
                self._queue.task_done()

    def drain(self) -> None:
        """Wait until every submitted piece of work has run."""
        if self._thread is not None:
            self._queue.join()

    def take_error(self) -> TrainsnapError | None:
        """The first error of the work run since the last call, once (None: none)."""
        with self._lock:
            error, self._error = self._error, None
        return error

    def raise_error(self) -> None:
        """Raise the first error of the work run since the last call, once."""
        error = self.take_error()
        if error is not None:
            raise error

    def stop(self) -> None:
        """Run what is queued and stop the thread (errors stay for :meth:`raise_error`)."""
        if not self._closed:
            self._closed = True
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()

    def close(self) -> None:
        """Run what is queued, stop the thread, and raise the first error not yet raised."""
        self.stop()
        self.raise_error()


def _as_error(what: str, error: Exception) -> TrainsnapError:
    if isinstance(error, TrainsnapError):
        return error
    wrapped = TrainsnapError(f"{what} failed: {type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped
