"""Named fault points, switchable by environment variable or API, free when off.

``TRAINSNAP_FAULTS`` holds comma-separated rules ``point=action[@rank][#hit]``:

* ``point``: a name passed to :func:`point` (the table is in FORMAT.md, section Fault points).
* ``action``: ``crash`` (SIGKILL this process), ``raise`` (raise :class:`InjectedFault`),
  ``enospc`` (raise ``OSError(ENOSPC)``, as a write to a full file system or tmpfs does),
  ``hang`` (sleep until killed), ``delay:<seconds>``.
* ``@rank``: only on this rank (``TRAINSNAP_RANK``/``RANK`` of the process, else 0).
* ``#hit``: only the n-th time this process reaches the point (1-based); default every time.

Example: ``TRAINSNAP_FAULTS="before_marker=crash@0,mid_write=delay:0.5#2"``.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from dataclasses import dataclass

__all__ = ["InjectedFault", "clear", "install", "point"]


class InjectedFault(RuntimeError):
    """Raised by a fault point whose action is ``raise``."""


@dataclass(frozen=True, slots=True)
class Rule:
    point: str
    action: str
    rank: int | None = None
    hit: int | None = None
    seconds: float = 0.0


_rules: dict[str, list[Rule]] = {}
_hits: dict[str, int] = {}
_lock = threading.Lock()
_loaded_env: str | None = None


def parse(spec: str) -> list[Rule]:
    rules = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, rest = item.partition("=")
        if not rest:
            raise ValueError(f"fault rule {item!r}: expected point=action")
        hit = rank = None
        if "#" in rest:
            rest, h = rest.split("#", 1)
            hit = int(h)
        if "@" in rest:
            rest, r = rest.split("@", 1)
            rank = int(r)
        action, _, arg = rest.partition(":")
        if action not in ("crash", "raise", "enospc", "hang", "delay"):
            raise ValueError(f"fault rule {item!r}: unknown action {action!r}")
        rules.append(Rule(name.strip(), action, rank, hit, float(arg) if arg else 0.0))
    return rules


def install(rules: list[Rule] | str) -> None:
    """Arm fault rules for this process (in addition to those of the environment)."""
    parsed = parse(rules) if isinstance(rules, str) else rules
    with _lock:
        for r in parsed:
            _rules.setdefault(r.point, []).append(r)


def clear() -> None:
    global _loaded_env
    with _lock:
        _rules.clear()
        _hits.clear()
        _loaded_env = os.environ.get("TRAINSNAP_FAULTS", "")


def _sync_env() -> None:
    global _loaded_env
    env = os.environ.get("TRAINSNAP_FAULTS", "")
    if env != _loaded_env:
        _loaded_env = env
        if env:
            install(env)


def _rank() -> int:
    for var in ("TRAINSNAP_RANK", "RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def point(name: str, rank: int | None = None) -> None:
    """A fault point. Does nothing unless a rule names it."""
    if not _rules and not os.environ.get("TRAINSNAP_FAULTS"):
        return
    _sync_env()
    rules = _rules.get(name)
    if not rules:
        return
    with _lock:
        _hits[name] = n = _hits.get(name, 0) + 1
    me = _rank() if rank is None else rank
    for r in rules:
        if (r.rank is None or r.rank == me) and (r.hit is None or r.hit == n):
            _fire(r)


def _fire(result: Rule) -> None:
    if result.action == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # the signal is delivered asynchronously
    elif result.action == "raise":
        raise InjectedFault(f"injected fault at {result.point}")
    elif result.action == "enospc":
        raise OSError(errno.ENOSPC, f"injected at {result.point}: no space left on device")
    elif result.action == "hang":
        while True:
            time.sleep(3600)
    elif result.action == "delay":
        time.sleep(result.seconds)
