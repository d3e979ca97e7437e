"""A ``torch.distributed`` store client that counts what goes through it: operations and bytes,
by method and by the thread that made them. For tests and benchmarks of the control plane
(:mod:`trainsnap.protocol.control_plane`), which cost what they say only if counted.

The bytes are the keys and values handed to the store and returned by it, not the wire protocol's
framing: what a rank asks of the store, the same on every transport.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

HEARTBEAT_THREAD = "trainsnap-heartbeat"
"""The name of the control plane's heartbeat thread: its operations are counted apart."""


def _size(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, bytes | bytearray | memoryview):
        return len(value)
    return 8  # an integer (add's amount)


class StoreCounts:
    """Operations and bytes of every client cloned from one :class:`CountingStore`, shared
    and thread-safe. ``ops[(thread_kind, method)]``, ``sent`` and ``received`` by thread kind
    (``"heartbeat"`` for the heartbeat thread, ``"exchange"`` for every other)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ops: Counter[tuple[str, str]] = Counter()
        self.sent: Counter[str] = Counter()
        self.received: Counter[str] = Counter()
        self.clients = 0
        """Clients connected (clones made), the first one included."""
        self.sent_by_tag: Counter[str] = Counter()
        """Bytes written (set, multi_set) by the exchange tag of the key (its third segment,
        ``<namespace>/<session>/<tag>/...``), so that a gather's share can be told apart."""

    def record(self, method: str, sent: int, received: int, key: str = "") -> None:
        kind = "heartbeat" if threading.current_thread().name == HEARTBEAT_THREAD else "exchange"
        parts = key.split("/", 3)
        with self._lock:
            self.ops[kind, method] += 1
            self.sent[kind] += sent
            self.received[kind] += received
            if method in ("set", "multi_set") and len(parts) > 3:
                self.sent_by_tag[parts[2]] += sent

    def total(self, kind: str | None = None) -> int:
        """Operations made (by one thread kind, or all)."""
        with self._lock:
            return sum(n for (k, _), n in self.ops.items() if kind in (None, k))

    def snapshot(self) -> dict[str, Any]:
        """A copy: ``{"ops": {kind: {method: n}}, "sent": {kind: n}, "received": {kind: n}}``."""
        with self._lock:
            ops: dict[str, dict[str, int]] = {}
            for (kind, method), n in self.ops.items():
                ops.setdefault(kind, {})[method] = n
            return {
                "ops": ops,
                "sent": dict(self.sent),
                "received": dict(self.received),
                "clients": self.clients,
                "sent_by_tag": dict(self.sent_by_tag),
            }


class CountingStore:
    """Wraps a store client; ``clone()`` wraps the clone and counts into the same
    :class:`StoreCounts`."""

    def __init__(self, store: Any, counts: StoreCounts | None = None) -> None:
        self._store = store
        self.counts = counts if counts is not None else StoreCounts()
        with self.counts._lock:
            self.counts.clients += 1

    def clone(self) -> CountingStore:
        return CountingStore(self._store.clone(), self.counts)

    def set_timeout(self, timeout: Any) -> None:
        self._store.set_timeout(timeout)

    @property
    def timeout(self) -> Any:
        return self._store.timeout

    def set(self, key: str, value: Any) -> None:
        self.counts.record("set", _size(key) + _size(value), 0, key)
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        value: bytes = self._store.get(key)
        self.counts.record("get", _size(key), len(value))
        return value

    def add(self, key: str, amount: int) -> int:
        self.counts.record("add", _size(key) + 8, 8)
        return int(self._store.add(key, amount))

    def check(self, keys: list[str]) -> bool:
        self.counts.record("check", sum(map(_size, keys)), 1)
        return bool(self._store.check(keys))

    def wait(self, keys: list[str], *timeout: Any) -> None:
        self.counts.record("wait", sum(map(_size, keys)), 0)
        self._store.wait(keys, *timeout)

    def delete_key(self, key: str) -> bool:
        self.counts.record("delete_key", _size(key), 1)
        return bool(self._store.delete_key(key))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        value: bytes = self._store.compare_set(key, expected, desired)
        self.counts.record("compare_set", _size(key) + _size(expected) + _size(desired), len(value))
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values: list[bytes] = self._store.multi_get(keys)
        self.counts.record("multi_get", sum(map(_size, keys)), sum(map(len, values)))
        return values

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        sent = sum(map(_size, keys)) + sum(map(_size, values))
        self.counts.record("multi_set", sent, 0, keys[0] if keys else "")
        self._store.multi_set(keys, values)

    def num_keys(self) -> int:
        self.counts.record("num_keys", 0, 8)
        return int(self._store.num_keys())


class CountingStorage:
    """Wraps a :class:`~trainsnap.storage.base.Storage` and counts the bytes read from it
    (``get``, ``read_into``, ``read_steps``, ``read_uncached``): in all, and under
    ``snapshots/`` (manifests, markers, reports) apart. For tests of what a load costs the
    storage (bytes read over bytes stored). Every other method is passed through."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.url = inner.url
        self.readinto_is_zero_copy = inner.readinto_is_zero_copy
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.metadata_bytes = 0
        """Bytes read under ``snapshots/`` (manifests, markers): included in ``bytes_read``."""
        self.reads = 0

    def _count(self, key: str, nbytes: int) -> None:
        with self._lock:
            self.reads += 1
            self.bytes_read += nbytes
            if key.startswith("snapshots/"):
                self.metadata_bytes += nbytes

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        data: bytes = self.inner.get(key, start, end)
        self._count(key, len(data))
        return data

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        self.inner.read_into(key, start, out)
        self._count(key, out.nbytes)

    def read_steps(self, key: str, start: int, steps: Any, done: Any) -> None:
        from trainsnap.storage.base import read_steps

        read_steps(self.inner, key, start, steps, done)
        self._count(key, sum(b.nbytes for step in steps for b in step))

    def read_uncached(self, key: str, start: int, out: memoryview, length: int) -> bool:
        from trainsnap.storage.base import read_uncached

        if not read_uncached(self.inner, key, start, out, length):
            return False
        self._count(key, length)
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
