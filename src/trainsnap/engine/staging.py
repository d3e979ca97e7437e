"""Staging: copying the state into reused host buffers so training can go on while they are
written.

A fresh buffer costs a page fault per page on first touch -- an order of magnitude slower than
copying into memory that is already mapped -- so buffers are kept and reused from one save to the
next (a state keeps its sizes, so each payload usually finds a buffer of exactly its size).
Buffers for device tensors are pinned and filled on a side stream with non-blocking copies; the
training stream waits for those copies on the device, not the host.

A staged buffer belongs to its save (:class:`Lease`) until every write of that save has finished
and the lease is released: it is never modified or reused while its bytes may still be read.
The pool never holds more than its budget; a save that would need more is refused here (and the
caller saves synchronously, with no staging at all).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from trainsnap.engine.buffers import tensor_bytes
from trainsnap.errors import TrainsnapError

_WARM_LAYOUTS = 2
"""Layouts whose idle arenas are kept for reuse (a state usually alternates between at most a
full and a weights-only layout)."""


class BudgetExceeded(TrainsnapError):
    """The pool cannot hold this save within its budget (the save is then written
    synchronously, from the state itself)."""


@dataclass(slots=True)
class _Arena:
    """One buffer holding a whole save's tensors back to back, with the views into it: a state
    saved again with the same shapes reuses the arena, views and all."""

    buffer: torch.Tensor
    views: list[torch.Tensor]
    bytes_views: list[memoryview]
    busy: bool = False


@dataclass(slots=True)
class Lease:
    """The buffers one save staged into, held until its writes are done."""

    buffers: list[torch.Tensor] = field(default_factory=list)
    arena: _Arena | None = None
    nbytes: int = 0
    events: list[Any] = field(default_factory=list)
    """CUDA events marking the end of device-to-host copies (waited on before reading)."""

    def wait_copies(self) -> None:
        for ev in self.events:
            ev.synchronize()
        self.events.clear()


class StagingPool:
    """Reusable host buffers, bounded by ``budget`` bytes (None: unbounded)."""

    def __init__(self, budget: int | None = None) -> None:
        self.budget = budget
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = {}
        self._allocated = 0
        self.peak = 0
        """The most bytes the pool held at once."""
        self._lock = threading.Lock()
        self._stream: Any = None
        self._arenas: dict[tuple[Any, ...], list[_Arena]] = {}

    @property
    def allocated(self) -> int:
        return self._allocated

    def _take(self, count: int, pinned: bool) -> torch.Tensor:
        with self._lock:
            exact = self._free.get((count, pinned))
            if exact:
                return exact.pop()
            if self.budget is not None and self._allocated + count > self.budget:
                self._trim(self._allocated + count - self.budget)
                if self._allocated + count > self.budget:
                    raise BudgetExceeded(
                        f"staging {count} more bytes would exceed the budget of {self.budget}"
                    )
            self._allocated += count
            self.peak = max(self.peak, self._allocated)
        buf = torch.empty(count, dtype=torch.uint8, pin_memory=pinned)
        buf.fill_(0)  # fault the pages in now, once; later saves reuse them warm
        return buf

    def _trim(self, need: int) -> None:
        """Free idle buffers, largest first, then idle arenas, oldest layout first, until
        ``need`` bytes are released (lock held)."""
        idle = sorted(((n, p) for (n, p), bufs in self._free.items() for _ in bufs), reverse=True)
        for n, p in idle:
            if need <= 0:
                return
            self._free[(n, p)].pop()
            self._allocated -= n
            need -= n
        for key in list(self._arenas):
            if need <= 0:
                return
            need -= self._drop_idle_arenas(key)

    def _drop_idle_arenas(self, key: tuple[Any, ...]) -> int:
        """Free the idle arenas of one layout; the bytes freed (lock held)."""
        keep = [arena for arena in self._arenas[key] if arena.busy]
        freed = sum(a.buffer.numel() for a in self._arenas[key] if not a.busy)
        if keep:
            self._arenas[key] = keep
        else:
            del self._arenas[key]
        self._allocated -= freed
        return freed

    def check_fits(self, sizes: list[int]) -> None:
        """Raise :class:`BudgetExceeded` unless a save of these payload sizes fits."""
        if self.budget is not None and sum(sizes) > self.budget:
            raise BudgetExceeded(
                f"the state to stage ({sum(sizes)} bytes) exceeds the staging budget "
                f"({self.budget} bytes)"
            )

    def stage_many(self, tensors: list[torch.Tensor], lease: Lease) -> list[memoryview]:
        """Copy every tensor into one arena, with one batched copy; returns the staged bytes
        of each. The arena and its views are reused by the next save of the same shapes, so a
        warm save costs the copy itself and little else."""
        xs = [t.detach() for t in tensors]
        if any(x.is_conj() or x.is_neg() or x.device.type != "cpu" for x in xs):
            return [self.stage(t, lease) for t in tensors]  # devices: one by one, side stream
        key = tuple((x.dtype, x.shape) for x in xs)
        arena = self._arena(key, xs)
        lease.arena = arena
        lease.nbytes += arena.buffer.numel()
        dst = [v for v, x in zip(arena.views, xs, strict=True) if x.numel()]
        src = [x for x in xs if x.numel()]
        if dst:
            torch._foreach_copy_(dst, src)
        return arena.bytes_views

    def _arena(self, key: tuple[Any, ...], values: list[torch.Tensor]) -> _Arena:
        with self._lock:
            for arena in self._arenas.get(key, []):
                if not arena.busy:
                    arena.busy = True
                    return arena
        sizes = [x.numel() * x.element_size() for x in values]
        starts, total = [], 0
        for n in sizes:  # each tensor on a 64-byte boundary: any dtype can view its bytes
            starts.append(total)
            total += -(-n // 64) * 64
        buf = self._take(total, pinned=False) if total else torch.empty(0, dtype=torch.uint8)
        views, bviews = [], []
        for x, n, pos in zip(values, sizes, starts, strict=True):
            part = buf[pos : pos + n]
            views.append(part.view(x.dtype).view(x.shape) if n else part)
            bviews.append(tensor_bytes(part) if n else memoryview(b""))
        arena = _Arena(buf, views, bviews, busy=True)
        with self._lock:
            self._arenas.setdefault(key, []).append(arena)
            # A layout that changed for good (optimizer state appeared, a dtype changed) must
            # not keep its arenas forever: only the newest few layouts stay warm.
            for old in list(self._arenas)[:-_WARM_LAYOUTS]:
                self._drop_idle_arenas(old)
        return arena

    def stage(self, tensor: torch.Tensor, lease: Lease) -> memoryview:
        """Copy ``t`` into a pool buffer held by ``lease``; returns the staged bytes."""
        x = tensor.detach()
        n = x.numel() * x.element_size()
        if n == 0:
            return memoryview(b"")
        device = x.device.type == "cuda"
        buf = self._take(n, pinned=device)
        lease.buffers.append(buf)
        lease.nbytes += n
        dst = buf.view(x.dtype).view(x.shape) if x.dim() else buf.view(x.dtype).view(())
        if x.is_conj():
            x = x.resolve_conj()
        if x.is_neg():
            x = x.resolve_neg()
        if device:
            self._copy_on_side_stream(dst, x, lease)
        else:
            dst.copy_(x)
        return tensor_bytes(buf)

    def _copy_on_side_stream(self, dst: torch.Tensor, src: torch.Tensor, lease: Lease) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=src.device)  # type: ignore[no-untyped-call]
        current = torch.cuda.current_stream(src.device)
        self._stream.wait_stream(current)  # the copy sees every write issued so far
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(self._stream)
        # Training's next kernels may overwrite ``src`` only after the copy: ordered on the
        # device, the host does not wait.
        current.wait_event(ev)
        src.record_stream(self._stream)
        lease.events.append(ev)

    def release(self, lease: Lease) -> None:
        """Give a finished save's buffers back for reuse."""
        with self._lock:
            for buf in lease.buffers:
                self._free.setdefault((buf.numel(), buf.is_pinned()), []).append(buf)
            lease.buffers = []
            if lease.arena is not None:
                lease.arena.busy = False
                lease.arena = None
