"""Blocks already read and verified in this process, kept for the rest of a load.

A block is the unit a checksum covers, so a read of a few bytes costs the whole block. Plain
values and small tensors are packed together: many of them share a block, and a load that read
each on its own would read and verify that block once per value. A :class:`BlockCache` keeps the
blocks that a read did not use up (a value's block, the edge blocks of a run of packed tensors),
so that every stored block is read and verified once per load and process.
"""

from __future__ import annotations

import threading


class BlockCache:
    """Verified block bytes by ``(object, block)``, at most ``budget`` bytes in all.

    Once the budget is spent, further blocks are not kept (a later read of one reads it again:
    slower, never wrong). Thread-safe; O(1) a lookup."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.held = 0
        self._blocks: dict[tuple[int, int], bytes] = {}
        self._lock = threading.Lock()

    def get(self, obj: int, block: int) -> bytes | None:
        return self._blocks.get((obj, block))

    def has_any(self, obj: int, first: int, stop: int) -> bool:
        """True when one of blocks ``first .. stop - 1`` of ``obj`` is held."""
        if not self._blocks:
            return False
        return any((obj, b) in self._blocks for b in range(first, stop))

    def put(self, obj: int, block: int, data: memoryview) -> None:
        """Keep a copy of ``data``, the verified bytes of the block (within the budget)."""
        with self._lock:
            if (obj, block) in self._blocks or self.held + len(data) > self.budget:
                return
            self._blocks[obj, block] = bytes(data)
            self.held += len(data)
