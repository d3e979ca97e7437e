"""How far a run got, as the restart log records it (the coordinator's part).

The step a run *reached* is the last step whose ``CheckpointManager.step`` returned: a step whose
call blocked (a save waiting for its partners) or was cut short by a kill is not reached, since
the state a restart would want of it was never handed back to the loop. :class:`ProgressRecorder`
is told each such step and keeps the run's progress record (:func:`trainsnap.manager.lease.
record_progress`) up to date:

* ``progress_seconds=0``: written synchronously before ``step()`` returns, so a kill loses no
  record and the lost work a restart reports is exact (one small store write a step);
* ``progress_seconds=None`` (the default): every step on a file-system root, where a small write
  is cheap, and every :data:`OBJECT_STORE_SECONDS` on an object store, where each write is a
  billed request;
* otherwise at most every ``progress_seconds``.

Except with 0, the record is written by the manager's background worker, at most one pending at
a time and carrying the newest step reached when it runs, and at every step that saved (a save
writes many objects already: one more small one costs nothing noticeable), so a crash's reach
is never below the newest save's step. The record a kill overtakes is lost, which is why the
restart log counts such a reach as a lower bound. ``close()`` records the step reached in its
event (exact, whatever the setting).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Final

from trainsnap.manager import lease
from trainsnap.storage.base import Storage

OBJECT_STORE_SECONDS: Final = 30.0
"""The default spacing of progress records on an object store (``progress_seconds=None``)."""

Submit = Callable[[str, Callable[[], None]], bool]
"""Queues work for the background worker without waiting; False when it had no room."""


def on_file_system(storage: Storage) -> bool:
    """Whether ``storage`` keeps its objects in a file system (a write is no billed request)."""
    url = str(getattr(storage, "url", ""))
    return "://" not in url or url.startswith(("file://", "memory://"))


def spacing(progress_seconds: float | None, storage: Storage) -> float:
    """Seconds between progress records that ``progress_seconds`` asks for on ``storage``."""
    if progress_seconds is None:
        return 0.0 if on_file_system(storage) else OBJECT_STORE_SECONDS
    return float(progress_seconds)


def start_fields(progress_seconds: float | None, storage: Storage) -> dict[str, Any]:
    """What the run's ``start`` event says of its progress records: their spacing, and whether
    every step's return is recorded before it returns (``progress: "every step"``: the restart
    log's reach is then exact) or in the background (``"background"``)."""
    every_step = progress_seconds is not None and progress_seconds <= 0
    return {
        "progress_seconds": spacing(progress_seconds, storage),
        "progress": "every step" if every_step else "background",
    }


class ProgressRecorder:
    """The coordinator's record of the steps its ``step()`` returned. ``returned`` is called
    from the training thread only."""

    def __init__(
        self, storage: Storage, generation: int, progress_seconds: float | None, submit: Submit
    ) -> None:
        self._storage = storage
        self._generation = generation
        self._sync = progress_seconds is not None and progress_seconds <= 0
        self._seconds = spacing(progress_seconds, storage)
        self._submit = submit
        self._last_record = -math.inf
        self._pending = False
        self.reached: int | None = None
        """The last step whose ``step()`` returned (None: none yet)."""

    def returned(self, step: int, *, saved: bool) -> None:
        """``step()`` of ``step`` is returning (``saved``: it started a save). O(1), plus one
        small store write when the record is synchronous."""
        self.reached = step
        now = time.monotonic()
        if self._sync:
            lease.record_progress(self._storage, self._generation, step)
            self._last_record = now
            return
        if self._pending or (not saved and now - self._last_record < self._seconds):
            return  # a pending record writes this step too: it reads the newest when it runs
        self._pending = True
        if self._submit("recording progress", self._write):
            self._last_record = now
        else:
            self._pending = False

    def _write(self) -> None:
        """(background worker) Write the newest step reached."""
        self._pending = False
        step = self.reached
        if step is not None:
            lease.record_progress(self._storage, self._generation, step)
