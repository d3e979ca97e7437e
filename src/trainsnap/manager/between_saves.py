"""Retention and collection between two saves, so that disk stays within the retained
snapshots' bytes plus the one save in flight while saves run back to back.

The manager collects while it holds the root's lease without a grace period, but only while no
save of its own is in flight (:class:`~trainsnap.manager.housekeeping.SaveGate`): an object
nothing committed references may be about to be referenced by that save (one that reuses it).
With a save every step there is always one in flight, so a collection that ran on the
background worker after a commit almost always found the next save begun and stopped, and
``objects/`` grew until ``close()``. Instead the commit waits for its own retention and
collection (:func:`run_before_next_save`), and the next save is counted only once it has room
to start (:meth:`trainsnap.api.async_saver.AsyncSaver.wait_for_room`): between the two no save
is in flight and the collector deletes at once. The cost is the collection's own time (a few
deletes of the snapshot retention dropped), paid by the commit thread of an asynchronous save,
and by the training thread only when it waits for that save anyway.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from trainsnap.manager.housekeeping import Housekeeper


def run_before_next_save(housekeeper: Housekeeper, what: str, work: Callable[[], None]) -> None:
    """Queue ``work`` on ``housekeeper`` (behind the work queued before it, in order) and wait
    until it ran; its error, if any, stays with the housekeeper for the next ``step()``. Never
    call it from the housekeeper's own thread (it would wait for itself)."""
    done = threading.Event()

    def run() -> None:
        try:
            work()
        finally:
            done.set()

    housekeeper.submit(what, run)
    done.wait()
