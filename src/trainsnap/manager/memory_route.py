"""The storage a memory-tier save writes through: this node's directory, with the commit held
back.

The ordinary save protocol (:mod:`trainsnap.protocol.save_protocol`) runs unchanged on it:

* objects go to this node's directory, and the route remembers every object this rank wrote or
  reused for the snapshot (what it replicates and, later, promotes);
* the coordinator's manifest and marker are kept in memory, not written: the snapshot is
  committed in the memory tier only once every object has its copies
  (:mod:`trainsnap.manager.memory_tier`);
* write reports travel through the control plane's store, never through another node's
  directory (a rank reads and writes its own node's directory only).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

from trainsnap.format.manifest import MANIFEST_NAMES
from trainsnap.storage.base import Buffer, Storage, as_buffers

_HELD = {*MANIFEST_NAMES.values(), "COMMITTED"}


class SaveRoute:
    """A :class:`~trainsnap.storage.base.Storage` over a node directory (see the module
    docstring). One per save."""

    def __init__(self, inner: Storage, store: Any, namespace: str) -> None:
        self.inner = inner
        self.url = inner.url
        self.readinto_is_zero_copy = inner.readinto_is_zero_copy
        self.store = store
        self.namespace = namespace
        self.objects: dict[str, int] = {}
        """Object name -> stored size, of every object this rank wrote or reused."""
        self.held: dict[str, bytes] = {}
        """Manifest and marker bytes, by key (coordinator)."""
        self._lock = threading.Lock()

    def _is_held(self, key: str) -> bool:
        return key.startswith("snapshots/") and key.rsplit("/", 1)[-1] in _HELD

    def _is_report(self, key: str) -> bool:
        return key.startswith("snapshots/") and "/reports/" in key

    def _note(self, key: str, data: Buffer | Sequence[Buffer]) -> None:
        if key.startswith("objects/"):
            size = sum(len(b) for b in as_buffers(data))
            with self._lock:
                self.objects[key.rsplit("/", 1)[-1]] = size

    def put(self, key: str, data: Buffer | Sequence[Buffer]) -> None:
        if self._is_held(key):
            self.held[key] = b"".join(bytes(b) for b in as_buffers(data))
        elif self._is_report(key) and self.store is not None:
            self.store.set(f"{self.namespace}/{key}", b"".join(bytes(b) for b in as_buffers(data)))
        else:
            self.inner.put(key, data)
            self._note(key, data)

    def refresh(self, key: str, data: Buffer | Sequence[Buffer]) -> None:
        self.inner.refresh(key, data)
        self._note(key, data)

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        if key in self.held:
            return self.held[key][start:end]
        if self._is_report(key) and self.store is not None:
            return bytes(self.store.get(f"{self.namespace}/{key}"))[start:end]
        return self.inner.get(key, start, end)

    def stat(self, key: str) -> int:
        if key in self.held:
            return len(self.held[key])
        if self._is_report(key) and self.store is not None:
            if not self.store.check([f"{self.namespace}/{key}"]):
                raise FileNotFoundError(key)
            return len(self.store.get(f"{self.namespace}/{key}"))
        return self.inner.stat(key)

    def delete(self, key: str) -> None:
        if self._is_report(key) and self.store is not None:
            self.store.delete_key(f"{self.namespace}/{key}")
            return
        self.held.pop(key, None)
        self.inner.delete(key)

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        self.inner.read_into(key, start, out)

    def list(self, prefix: str) -> Iterator[str]:
        return self.inner.list(prefix)

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        return self.inner.put_if_absent(key, data)

    def mtime(self, key: str) -> float:
        return self.inner.mtime(key)

    def __getattr__(self, name: str) -> Any:  # capabilities (batched directory syncs, ...)
        return getattr(self.inner, name)
