"""Promotion of memory snapshots to the durable root: the durable safety net, without a second
capture of the state.

On a thread of its own per rank, in the order the snapshots were submitted (the same on every
rank), using the control plane only (never the checkpoint-data group, which the memory saves
use):

1. (all ranks) upload the objects this rank wrote for the snapshot from its node's directory to
   the durable root (those already there, by name and size, are skipped);
2. (coordinator) once every rank uploaded: the manifest, then the marker (its ``writer`` says
   ``promoted_from: memory``), each after checking that this job still holds the durable root.

A snapshot waiting for promotion is pinned: the node's retention keeps it until every rank has
uploaded. An error is kept and raised by the manager's next memory step, ``wait()`` or
``close()``; the coordinator's save gate holds the durable collector off while a promotion is
in flight (its objects are not referenced yet).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from trainsnap.errors import CommitFailedError, RankErrors, TrainsnapError
from trainsnap.format.manifest import Manifest, manifest_key, marker_key, object_key
from trainsnap.manager.housekeeping import Housekeeper
from trainsnap.protocol import commit
from trainsnap.protocol.collective import all_reduce
from trainsnap.protocol.control_plane import Comm
from trainsnap.storage.base import Storage

log = logging.getLogger(__name__)


class Promoter:
    """One rank's promotions (module docstring). Thread-safe."""

    def __init__(self, node: Storage, durable: Storage, comm: Comm, depth: int = 4) -> None:
        self.node = node
        self.durable = durable
        self.comm = comm
        self.fence: Callable[[], None] | None = None
        """(coordinator) Raises when this job no longer holds the durable root."""
        self.gate: Any = None
        """(coordinator) The manager's save gate: the durable collector waits for promotions."""
        self.on_promoted: Callable[[Manifest, int], None] | None = None
        """(coordinator) Called with the durable manifest and the bytes uploaded by this rank."""
        self._worker = Housekeeper(depth, name="trainsnap-memory-promote")
        self._pinned: set[str] = set()
        self._lock = threading.Lock()

    def pinned(self) -> set[str]:
        """The snapshots waiting for promotion (retention keeps them)."""
        with self._lock:
            return set(self._pinned)

    def submit(self, snapshot_id: str, objects: dict[str, int]) -> None:
        """Promote ``snapshot_id`` (``objects``: name -> size of what this rank wrote for it);
        waits for room when ``depth`` promotions are queued."""
        with self._lock:
            self._pinned.add(snapshot_id)
        work = partial(self._promote_pinned, snapshot_id, objects)
        self._worker.submit(f"promotion of memory snapshot {snapshot_id}", work)

    def take_error(self) -> TrainsnapError | None:
        return self._worker.take_error()

    def drain(self) -> None:
        """Wait until every promotion submitted has finished."""
        self._worker.drain()

    def close(self) -> None:
        """Finish the promotions queued; their errors stay for :meth:`take_error`."""
        self._worker.stop()

    def _promote_pinned(self, sid: str, objects: dict[str, int]) -> None:
        try:
            self._promote(sid, objects)
        finally:
            with self._lock:
                self._pinned.discard(sid)

    def _promote(self, sid: str, objects: dict[str, int]) -> None:
        uploaded = [0]

        def upload() -> None:
            for name, size in sorted(objects.items()):
                key = object_key(name)
                try:
                    if self.durable.stat(key) == size:
                        continue
                except FileNotFoundError:
                    pass
                self.durable.put(key, self.node.get(key))
                uploaded[0] += size

        def commit_durable(_: list[Any]) -> bool:
            if self.fence is not None:
                self.fence()
            self.durable.put(manifest_key(sid), self.node.get(manifest_key(sid)))
            doc = json.loads(self.node.get(marker_key(sid)))
            doc["writer"] = {"world_size": self.comm.world_size, "promoted_from": "memory"}
            if self.fence is not None:
                self.fence()
            self.durable.put(marker_key(sid), json.dumps(doc, separators=(",", ":")).encode())
            return True

        def failed(ranks: RankErrors) -> TrainsnapError:
            return CommitFailedError(
                f"promotion of memory snapshot {sid} to {self.durable.url} failed on "
                f"{len(ranks)} rank(s); it is not committed there",
                snapshot_id=sid,
                rank_errors=ranks,
            )

        started = time.perf_counter()
        token = self.gate.begin() if self.gate is not None else 0
        session = self.comm.session("promote")
        try:
            all_reduce(self.comm, session, "uploaded", upload, commit_durable, failed)
        finally:
            session.close()
            if self.gate is not None:
                self.gate.end(token)
        if self.comm.is_coordinator:
            log.info(
                "promoted memory snapshot %s to %s in %.3f s",
                sid,
                self.durable.url,
                time.perf_counter() - started,
            )
            if self.on_promoted is not None:
                self.on_promoted(commit.open_snapshot(self.durable, sid), uploaded[0])
