"""Pausing Python's cyclic garbage collector while a save or load runs on the caller's thread.

A load or save of a few thousand tensors allocates tens of thousands of short-lived containers
(pieces, reads, manifest rows). Alive while the operation runs, they survive young collections
and count towards a full one, which then walks the whole heap of the process, holding the GIL
while the I/O threads wait (figures: docs/PERFORMANCE.md).
With the collector paused the same objects are freed by reference counting when the operation
ends, before any collection sees them, so the work is not deferred but avoided.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def paused_gc() -> Iterator[None]:
    """Inside, the cyclic collector does not run; it is enabled again when the last of any
    nested or concurrent pauses ends, if it was enabled when the first began."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
