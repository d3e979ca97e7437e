"""Preemption signals: SIGTERM/SIGUSR1 (by default) ask the manager for a save at the next step.

:class:`PreemptionSignals` installs its handlers on the main thread only (a manager made on
another thread installs none), chains to the handlers it replaced, and puts them back at
:meth:`PreemptionSignals.restore`. A handler only sets a flag: the save happens at the next
``step()``, where every rank agrees on it (:mod:`trainsnap.manager.decisions`).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)


class PreemptionSignals:
    """The manager's preemption signal handlers and their flag."""

    def __init__(self, signals: Sequence[int]) -> None:
        self._flag = threading.Event()
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def take(self) -> bool:
        """Whether a signal arrived since the last call."""
        signalled = self._flag.is_set()
        self._flag.clear()
        return signalled

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._flag.set()
        log.warning("signal %s: saving at the next step", signal.Signals(signum).name)
        prev = self._previous.get(signum)
        if callable(prev):
            prev(signum, frame)

    def restore(self) -> None:
        """Put the replaced handlers back (idempotent)."""
        for sig, handler in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)
        self._previous = {}
