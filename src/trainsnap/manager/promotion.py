"""Promotion: a committed snapshot copied from a faster tier to a slower one, in commit order,
without a second capture of the state. One function for every pair of tiers.

1. (each uploading rank) the objects it is given, or every object of the manifest when it
   uploads alone: an object already in the destination with its size is not copied but, when it
   is older than a minute, refreshed (a collector with a grace period must not take an object a
   new snapshot references); a source object whose size is not the manifest's fails the
   promotion. Fault point ``promote_object`` before each copy.
2. (coordinator, every rank uploaded) the manifest, then the marker, each after the fence says
   this job still holds the destination (fault points ``promote_manifest`` and
   ``promote_marker``). The marker is the source's, with the ``writer`` record of the
   destination (:func:`trainsnap.format.marker.with_writer`): the destination never shows a
   snapshot whose objects are not all there.

A disk tier's snapshot is promoted by the coordinator alone (``comm=None``: it can read every
object); a memory snapshot by every rank, each uploading from its own node's directory the
objects it wrote, and agreeing through one step of :mod:`trainsnap.protocol.collective`.
Cost: one stat per object, one read and one write per object copied, O(1) control-plane steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from trainsnap import faults
from trainsnap.errors import CommitFailedError, RankErrors, TrainsnapError
from trainsnap.format.manifest import manifest_key, marker_key, object_key
from trainsnap.format.marker import with_writer
from trainsnap.protocol import commit
from trainsnap.protocol.collective import all_reduce
from trainsnap.protocol.control_plane import Comm
from trainsnap.storage.base import Storage

log = logging.getLogger(__name__)

REFRESH_AFTER = 60.0
"""Seconds after which an object reused in the destination is refreshed."""


def promote(
    src: Storage,
    dst: Storage,
    snapshot_id: str,
    *,
    writer: Mapping[str, Any],
    objects: Mapping[str, int] | None = None,
    comm: Comm | None = None,
    fence: Callable[[], None] | None = None,
) -> int:
    """Copy committed snapshot ``snapshot_id`` from ``src`` to ``dst`` (module docstring);
    returns the bytes of objects this rank copied. ``objects`` (name -> stored size) is what
    this rank uploads (None: every object of the manifest); with ``comm`` every rank calls this
    and the coordinator commits once all uploaded. Raises ``CommitFailedError`` naming the
    snapshot and the failed ranks; the destination then does not hold the snapshot."""
    if objects is None:
        m = commit.open_snapshot(src, snapshot_id)
        objects = dict(zip(m.object_names, m.stored().tolist(), strict=True))
    copied: list[int] = []

    def upload() -> int:
        copied.append(_upload(src, dst, snapshot_id, objects))
        return copied[-1]

    def commit_there(_: list[Any]) -> bool:
        _commit(src, dst, snapshot_id, writer, fence)
        return True

    def failed(ranks: RankErrors) -> TrainsnapError:
        return CommitFailedError(
            f"promotion of snapshot {snapshot_id} to {dst.url} failed on {len(ranks)} rank(s); "
            "it is not committed there",
            snapshot_id=snapshot_id,
            rank_errors=ranks,
        )

    if comm is None:
        upload()
        commit_there([])
    else:
        session = comm.session("promote")
        try:
            all_reduce(comm, session, "uploaded", upload, commit_there, failed)
        finally:
            session.close()
    log.info(
        "promoted %s from %s to %s (%d bytes copied)", snapshot_id, src.url, dst.url, copied[0]
    )
    return copied[0]


def _upload(src: Storage, dst: Storage, snapshot_id: str, objects: Mapping[str, int]) -> int:
    copied = 0
    for name, size in sorted(objects.items()):
        key = object_key(name)
        try:
            if dst.stat(key) == size:
                if time.time() - dst.mtime(key) > REFRESH_AFTER:
                    dst.refresh(key, src.get(key))
                continue
        except FileNotFoundError:
            pass
        data = src.get(key)
        if len(data) != size:
            raise TrainsnapError(
                f"cannot promote {snapshot_id}: object {name} is {len(data)} bytes in "
                f"{src.url}, the manifest says {size}",
                snapshot_id=snapshot_id,
                path=key,
            )
        faults.point("promote_object")
        dst.put(key, data)
        copied += size
    return copied


def _commit(
    src: Storage,
    dst: Storage,
    snapshot_id: str,
    writer: Mapping[str, Any],
    fence: Callable[[], None] | None,
) -> None:
    """(coordinator) The manifest, then the marker with the destination's writer record."""
    marker = commit.committed_marker(src, snapshot_id)
    faults.point("promote_manifest")
    if fence is not None:
        fence()
    dst.put(manifest_key(snapshot_id, marker.format_version), src.get(marker.manifest_key))
    faults.point("promote_marker")
    if fence is not None:
        fence()
    dst.put(
        marker_key(snapshot_id), with_writer(src.get(marker_key(snapshot_id)), snapshot_id, writer)
    )
