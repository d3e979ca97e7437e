"""Phase tracing: capture, plan, stage, write, commit as events, exportable to the Chrome trace
format (open the JSON in https://ui.perfetto.dev or chrome://tracing).

Off unless :func:`enable` was called or ``TRAINSNAP_TRACE`` names a file (each rank then writes
``<file>.rank<N>.json`` at exit; merge them by concatenating their ``traceEvents``). When off, a
span costs one attribute check.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_lock = threading.Lock()
_events: list[dict[str, Any]] = []
_enabled = False
_rank = 0
_t0 = time.perf_counter()
_epoch_us = time.time() * 1e6


def enable(rank: int | None = None) -> None:
    """Start recording events (this process)."""
    global _enabled, _rank
    _enabled = True
    if rank is not None:
        _rank = rank
    else:
        _rank = int(os.environ.get("TRAINSNAP_RANK", os.environ.get("RANK", "0")))


def disable() -> None:
    global _enabled
    _enabled = False


def enabled() -> bool:
    return _enabled


def _now_us() -> float:
    return _epoch_us + (time.perf_counter() - _t0) * 1e6


@contextmanager
def span(name: str, **args: Any) -> Iterator[dict[str, Any]]:
    """Record the enclosed block as a complete event; ``args`` (and whatever the block adds to
    the yielded dict) appear in the trace viewer."""
    if not _enabled:
        yield args
        return
    start = _now_us()
    try:
        yield args
    finally:
        event = {
            "name": name,
            "cat": "trainsnap",
            "ph": "X",
            "ts": start,
            "dur": _now_us() - start,
            "pid": _rank,
            "tid": threading.get_ident() % 1_000_000,
            "args": {k: v for k, v in args.items() if isinstance(v, int | float | str | bool)},
        }
        with _lock:
            _events.append(event)


def events() -> list[dict[str, Any]]:
    with _lock:
        return list(_events)


def clear() -> None:
    with _lock:
        _events.clear()


def export(path: str | os.PathLike[str]) -> Path:
    """Write the events so far as a Chrome trace JSON file; returns its path."""
    p = Path(path)
    meta = [
        {"name": "process_name", "ph": "M", "pid": _rank, "args": {"name": f"rank {_rank}"}},
    ]
    p.write_text(json.dumps({"traceEvents": meta + events(), "displayTimeUnit": "ms"}))
    return p


def _export_at_exit() -> None:
    target = os.environ.get("TRAINSNAP_TRACE")
    if target and _events:
        export(f"{target}.rank{_rank}.json")


if os.environ.get("TRAINSNAP_TRACE"):
    enable()
    atexit.register(_export_at_exit)
