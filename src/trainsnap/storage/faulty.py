"""A storage wrapper that misbehaves on purpose, for the chaos suite and for users who want to
see what their root does under failure.

``TRAINSNAP_STORAGE_FAULTS`` (or :func:`FaultPlan.parse`) holds comma-separated ``name=value``:

=================  ==========================================================================
``latency``        seconds added to every operation
``timeout``        probability that an operation raises ``TimeoutError`` (transient)
``transient``      probability that an operation raises ``ConnectionResetError`` (transient)
``truncate``       probability that a ``put`` stores only part of the bytes yet reports success
``bitflip``        probability that a ``put`` succeeds and one stored bit is then flipped
``lag``            seconds during which a newly written key is missing from listings
``reorder``        1: listings come back shuffled
``duplicate``      probability that a ``put`` or ``delete`` is executed twice
``enospc``         bytes after which every ``put`` fails with ENOSPC (a full disk)
``vanish``         operations after which the root is gone (every operation fails, ENOENT)
``seed``           random seed (default 0)
=================  ==========================================================================

Faults apply below the retry layer, so transient ones exercise the retries; the others must
be caught by the format's own checks (sizes, checksums, the commit protocol).
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

from trainsnap.storage.base import (
    Buffer,
    Steps,
    Storage,
    as_buffers,
    read_steps,
    read_uncached,
)


@dataclass(slots=True)
class FaultPlan:
    latency: float = 0.0
    timeout: float = 0.0
    transient: float = 0.0
    truncate: float = 0.0
    bitflip: float = 0.0
    lag: float = 0.0
    reorder: float = 0.0
    duplicate: float = 0.0
    enospc: float = -1.0
    vanish: float = -1.0
    seed: float = 0.0

    @staticmethod
    def parse(spec: str) -> FaultPlan:
        plan = FaultPlan()
        names = {f.name for f in fields(FaultPlan)}
        for item in filter(None, (x.strip() for x in spec.split(","))):
            name, _, value = item.partition("=")
            if name not in names:
                raise ValueError(f"unknown storage fault {name!r}; known: {sorted(names)}")
            setattr(plan, name, float(value))
        return plan

    @property
    def active(self) -> bool:
        return (
            any(getattr(self, f.name) > 0 for f in fields(FaultPlan) if f.name not in ("seed",))
            or self.enospc >= 0
            or self.vanish >= 0
        )


class FaultyStorage:
    """Wraps a backend and injects the faults of a :class:`FaultPlan`."""

    def __init__(self, inner: Storage, plan: FaultPlan, *, stream: int = 0) -> None:
        """``stream`` separates the fault sequences of processes sharing one plan; with the
        default, a plan's seed alone decides which operations fail (a test's trials repeat)."""
        self.inner, self.plan = inner, plan
        self.url = inner.url
        self.readinto_is_zero_copy = inner.readinto_is_zero_copy
        self._rng = random.Random(int(plan.seed) ^ stream)
        self._lock = threading.Lock()
        self._written: dict[str, float] = {}
        self._bytes = 0
        self._ops = 0
        self.injected: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _count(self, what: str) -> None:
        self.injected[what] = self.injected.get(what, 0) + 1

    def _chance(self, pending: float) -> bool:
        with self._lock:
            return pending > 0 and self._rng.random() < pending

    def _before(self, operation: str) -> None:
        with self._lock:
            self._ops += 1
            gone = self.plan.vanish >= 0 and self._ops > self.plan.vanish
        if gone:
            self._count("vanish")
            raise FileNotFoundError(errno.ENOENT, f"root {self.url} is gone ({operation})")
        if self.plan.latency > 0:
            if not self.injected.get("latency"):
                self._count("latency")  # one fault (a slow root), however many operations
            time.sleep(self.plan.latency)
        if self._chance(self.plan.timeout):
            self._count("timeout")
            raise TimeoutError(f"injected timeout on {operation}")
        if self._chance(self.plan.transient):
            self._count("transient")
            raise ConnectionResetError(
                errno.ECONNRESET, f"injected connection reset on {operation}"
            )

    def put(self, key: str, data: Buffer | Sequence[Buffer]) -> None:
        self._before(f"put {key}")
        payload = b"".join(bytes(b) for b in as_buffers(data))
        with self._lock:
            full = self.plan.enospc >= 0 and self._bytes + len(payload) > self.plan.enospc
            if not full:
                self._bytes += len(payload)
        if full:
            self._count("enospc")
            raise OSError(errno.ENOSPC, f"injected: no space left on device writing {key}")
        if len(payload) > 1 and self._chance(self.plan.truncate):
            self._count("truncate")
            payload = payload[: len(payload) // 2]
        self.inner.put(key, payload)
        if self._chance(self.plan.duplicate):
            self._count("duplicate")
            self.inner.put(key, payload)
        if payload and key.startswith("objects/") and self._chance(self.plan.bitflip):
            self._count("bitflip")
            flipped = bytearray(payload)
            flipped[self._rng.randrange(len(flipped))] ^= 1 << self._rng.randrange(8)
            self.inner.put(key, bytes(flipped))
        with self._lock:
            self._written[key] = time.monotonic()

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        self._before(f"get {key}")
        return self.inner.get(key, start, end)

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        self._before(f"read {key}")
        self.inner.read_into(key, start, out)

    def read_steps(self, key: str, start: int, steps: Steps, done: Callable[[int], None]) -> None:
        self._before(f"read {key}")
        read_steps(self.inner, key, start, steps, done)

    def read_uncached(self, key: str, start: int, out: memoryview, length: int) -> bool:
        self._before(f"read {key}")
        return read_uncached(self.inner, key, start, out, length)

    def stat(self, key: str) -> int:
        self._before(f"stat {key}")
        return self.inner.stat(key)

    def list(self, prefix: str) -> Iterator[str]:
        self._before(f"list {prefix}")
        keys = list(self.inner.list(prefix))
        if self.plan.lag > 0:
            now = time.monotonic()
            with self._lock:
                hidden = {k for k, t in self._written.items() if now - t < self.plan.lag}
            if hidden & set(keys):
                self._count("lag")
            keys = [k for k in keys if k not in hidden]
        if self.plan.reorder > 0:
            self._count("reorder")
            with self._lock:
                self._rng.shuffle(keys)
        return iter(keys)

    def delete(self, key: str) -> None:
        self._before(f"delete {key}")
        self.inner.delete(key)
        if self._chance(self.plan.duplicate):
            self._count("duplicate")
            self.inner.delete(key)

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        self._before(f"create {key}")
        return self.inner.put_if_absent(key, data)

    def mtime(self, key: str) -> float:
        self._before(f"mtime {key}")
        return self.inner.mtime(key)

    def refresh(self, key: str, data: Buffer | Sequence[Buffer]) -> None:
        self._before(f"refresh {key}")
        self.inner.refresh(key, data)


def from_env(inner: Storage) -> Storage:
    """``inner`` wrapped with the faults of ``TRAINSNAP_STORAGE_FAULTS``, if any."""
    spec = os.environ.get("TRAINSNAP_STORAGE_FAULTS", "")
    if not spec:
        return inner
    plan = FaultPlan.parse(spec)
    return FaultyStorage(inner, plan, stream=os.getpid()) if plan.active else inner
