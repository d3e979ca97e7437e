"""Restoring from the memory tier: the nearest copy of every object, then the ordinary load.

For one candidate snapshot, on every rank (the training thread, nothing else in flight):

1. (all ranks) the manifest: a node whose directory lacks it (a replaced node) gets the marker
   and manifest of the first node that holds a valid one, over the control plane, checks the
   manifest against the marker and writes the manifest (its marker comes last, step 4).
2. (all ranks) which objects this rank's load reads (the part of the manifest its state asks
   for, :mod:`trainsnap.format.manifest_part`) its node directory lacks.
3. (coordinator) for each object a node lacks, a holder: the nearest node in ring order with a
   copy not known to be damaged; (all ranks) the objects move over the checkpoint-data group
   (:func:`trainsnap.protocol.replication.move`), each checked against its content address by
   its receiver and written into the receiver's own node directory. A copy that does not
   verify is dropped by its node and the next copy is fetched; an object with no copy left
   makes the snapshot damaged everywhere (the manager then tries the next candidate).
4. (one rank per node) the marker, if the node lacked it; (all ranks) the ordinary load from
   the node directory (:func:`trainsnap.api.snapshots.load`), every block verified. A block
   that does not verify drops that copy from the node, and steps 2-4 run again (bounded).

A rank reads and writes its own node's directory only. The restore reports where its bytes
came from (:attr:`~trainsnap.SnapshotInfo.sources`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from trainsnap.api.snapshots import is_damage, load
from trainsnap.errors import CorruptError, LoadFailedError, RankErrors, TrainsnapError
from trainsnap.format.encoding import decode
from trainsnap.format.manifest import Manifest, marker_key, object_key
from trainsnap.format.manifest_part import PartIndex
from trainsnap.format.marker import check_manifest_bytes, decode_marker
from trainsnap.manager.memory_tier import MemorySaves
from trainsnap.protocol import commit, replication
from trainsnap.protocol.collective import Failure, all_reduce, reduce_scatter
from trainsnap.protocol.load_protocol import state_wants
from trainsnap.protocol.snapshot_info import SnapshotInfo
from trainsnap.storage.base import Storage, read_steps, read_uncached

log = logging.getLogger(__name__)

NODE = "memory (this node)"
PARTNER = "memory (partner node)"


def restore(
    mem: MemorySaves,
    state: Any,
    sid: str,
    *,
    level: str,
    allow_downgrade: bool,
    timeout: float | None,
) -> SnapshotInfo:
    """(all ranks) Restore memory snapshot ``sid`` (module docstring); raises a damage error
    (``CorruptError``) alike on every rank when no copy of something it needs is left."""
    started = time.perf_counter()
    manifest, marker = _ensure_manifest(mem, sid)
    needed = _needed(manifest, state, mem.comm.rank)
    received = 0
    attempts = 1 + mem.topology.copies if mem.topology else 2
    for attempt in range(attempts):
        received += _fetch(mem, manifest, needed)
        if marker is not None and mem.is_leader and attempt == 0:
            mem.storage.put(marker_key(sid), marker)
        counted = _Counted(mem.storage)
        try:
            info = load(
                state,
                counted,
                snapshot=sid,
                level=level,
                allow_downgrade=allow_downgrade,
                coordinator=mem.comm.coordinator,
                timeout=timeout,
            )
        except TrainsnapError as e:
            dropped = _drop_damaged(mem, e, manifest, needed)
            if not _agree_retry(mem, e, dropped, attempt + 1 < attempts):
                raise
            log.warning("memory snapshot %s: copies dropped, fetching others: %s", sid, dropped)
            continue
        sources = {NODE: max(0, counted.bytes_read - received), PARTNER: received}
        log.info(
            "restored snapshot %s step=%d from the memory tier in %.3f s: %d bytes from this "
            "node's memory, %d from partners' memory (rank %d)",
            sid,
            info.step,
            time.perf_counter() - started,
            sources[NODE],
            sources[PARTNER],
            mem.comm.rank,
        )
        return dataclasses.replace(info, root=mem.storage.url, sources=sources)
    raise AssertionError("unreachable: the last attempt raises")


def _ensure_manifest(mem: MemorySaves, sid: str) -> tuple[Manifest, bytes | None]:
    """Step 1: the manifest on every rank; the marker bytes to write last where the node
    lacked them (None where it has them)."""
    comm, rank = mem.comm, mem.comm.rank
    assert mem.topology is not None
    have = False
    try:
        commit.committed_marker(mem.storage, sid)
        have = True
    except TrainsnapError:
        have = False
    lost = _lost("memory-manifest", sid)

    def plan(said: list[bool]) -> tuple[int | None, list[int]]:
        holders = [r for r, h in enumerate(said) if h]
        return (holders[0] if holders else None), [r for r, h in enumerate(said) if not h]

    def send(parts: list[Any]) -> list[Any]:
        (packed,) = [p for p in parts if p is not None]
        return [None if r not in lacking else packed for r in range(len(parts))]

    session = comm.session("memory-manifest")
    try:
        source, lacking = all_reduce(comm, session, "have", lambda: have, plan, lost)
        if source is None:
            raise CorruptError(
                f"memory snapshot {sid}: no node holds its manifest any more",
                snapshot_id=sid,
            )
        if lacking:  # (marker, manifest) bytes from the first holder to the ranks lacking them

            def mine() -> tuple[bytes, bytes] | None:
                if rank != source:
                    return None
                marker = mem.storage.get(marker_key(sid))
                data = mem.storage.get(commit.committed_marker(mem.storage, sid).manifest_key)
                return marker, data

            got = reduce_scatter(comm, session, "manifest", mine, send, lost)
    finally:
        session.close()
    if have:
        return commit.open_snapshot(mem.storage, sid), None
    marker, data = got
    parsed = decode_marker(marker, sid)
    check_manifest_bytes(parsed, data)
    if mem.is_leader:
        mem.storage.put(parsed.manifest_key, data)
    return decode(data, snapshot_id=sid), marker


def _needed(manifest: Manifest, state: Any, rank: int) -> dict[str, int]:
    """Step 2: the objects this rank's load reads, with their stored sizes."""
    sizes = manifest.stored().tolist()
    wants = state_wants(state)
    if wants is None:
        return dict(zip(manifest.object_names, sizes, strict=True))
    index = PartIndex(manifest)
    out: dict[str, int] = {}
    for part in (index.shared(wants), index.own([wants], rank)):
        out.update(zip(part.object_names, part.stored().tolist(), strict=True))
    return out


def _fetch(mem: MemorySaves, manifest: Manifest, needed: Mapping[str, int]) -> int:
    """Step 3 (all ranks): what this node lacks of ``needed``, from the nearest copies. Returns
    the bytes this rank received."""
    assert mem.topology is not None
    topology, comm, rank = mem.topology, mem.comm, mem.comm.rank
    sizes = dict(zip(manifest.object_names, manifest.stored().tolist(), strict=True))
    bad: set[tuple[str, int]] = set()
    received = 0
    lost = _lost("memory-fetch", manifest.snapshot_id)

    def union_of(said: list[list[str]]) -> list[str]:
        asked.append(said)
        return sorted({n for m in said for n in m})

    def planned(holdings: list[list[str] | None]) -> Any:
        return _plan(topology, asked[-1], holdings, sizes, bad)

    def noted(failures: list[list[tuple[str, int]]]) -> None:
        bad.update((str(name), int(node)) for fs in failures for name, node in fs)

    asked: list[list[list[str]]] = []
    for _ in range(1 + topology.copies):
        missing = sorted(n for n, z in needed.items() if not mem.has(n, z))
        session = comm.session("memory-fetch")
        try:
            union = all_reduce(comm, session, "missing", _given(missing), union_of, lost)
            if not union:
                return received
            held = [n for n in union if mem.has(n, sizes[n])] if mem.is_leader else None
            transfers, gone, drop = all_reduce(comm, session, "held", _given(held), planned, lost)
            if gone:
                raise CorruptError(
                    f"memory snapshot {manifest.snapshot_id}: no node holds a good copy of "
                    f"{len(gone)} object(s) it needs (e.g. {gone[0]})",
                    snapshot_id=manifest.snapshot_id,
                    path=object_key(gone[0]),
                )
            for name, node in drop:
                if node == mem.node and mem.is_leader:
                    mem.storage.delete(object_key(name))
            group = replication.checkpoint_data_group()
            moves = [replication.Transfer(*t) for t in transfers]
            failed, nbytes = replication.move(
                moves, rank, group, mem.read, mem.write, manifest.hasher
            )
            received += nbytes
            mine = [(t.name, topology.nodes[t.source]) for t in failed]
            all_reduce(comm, session, "failed", _given(mine), noted, lost)
        finally:
            session.close()
    raise CorruptError(
        f"memory snapshot {manifest.snapshot_id}: objects still missing after "
        f"{1 + topology.copies} rounds of fetching",
        snapshot_id=manifest.snapshot_id,
    )


def _plan(
    topology: Any,
    said: list[list[str]],
    holdings: list[list[str] | None],
    sizes: Mapping[str, int],
    bad: set[tuple[str, int]],
) -> tuple[list[tuple[str, int, int, int]], list[str], list[tuple[str, int]]]:
    """(coordinator) transfers (name, size, source, target); objects with no good copy; the
    damaged copies to drop."""
    holders: dict[str, list[int]] = {}
    for rank, held in enumerate(holdings):
        for name in held or ():
            holders.setdefault(name, []).append(topology.nodes[rank])
    ring = topology.ring
    transfers: list[tuple[str, int, int, int]] = []
    lost: list[str] = []
    taken: set[tuple[str, int]] = set()
    for rank, missing in enumerate(said):
        node = topology.nodes[rank]
        for name in missing:
            if (name, node) in taken:
                continue  # another rank of this node fetches it
            taken.add((name, node))
            good = [n for n in holders.get(name, ()) if (name, n) not in bad and n != node]
            if not good:
                lost.append(name)
                continue
            start = ring.index(node)
            nearest = min(good, key=lambda n: (ring.index(n) - start) % len(ring))
            transfers.append((name, sizes[name], topology.peer(rank, nearest), rank))
    return transfers, lost, sorted(bad)


def _drop_damaged(
    mem: MemorySaves,
    error: BaseException,
    manifest: Manifest,
    needed: dict[str, int],
) -> list[str]:
    """After a load that found an object of this node's directory damaged or missing: check
    every object this rank needs there against its content address and delete the copies that
    fail (they are fetched again from another node); the objects named are added to ``needed``.
    Costs one read of the rank's objects, on this failure path only."""
    sizes = dict(zip(manifest.object_names, manifest.stored().tolist(), strict=True))
    named: list[str] = []
    seen = 0
    cause: BaseException | None = error
    while cause is not None and seen < 16:
        path = getattr(cause, "path", None)
        if isinstance(cause, CorruptError) and isinstance(path, str) and path[:8] == "objects/":
            named.append(path.rsplit("/", 1)[-1])
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    if not named:
        return []
    for name in named:
        if name in sizes:
            needed[name] = sizes[name]
    dropped = []
    hasher = manifest.hasher
    for name in sorted(needed):
        key = object_key(name)
        try:
            data = memoryview(mem.storage.get(key))
        except FileNotFoundError:
            dropped.append(name)
            continue
        if hasher.object_name(len(data), hasher.block_digests(data)) != name:
            mem.storage.delete(key)
            dropped.append(name)
    return dropped


def _agree_retry(mem: MemorySaves, error: TrainsnapError, dropped: list[str], more: bool) -> bool:
    """(all ranks) retry when every rank's failure is damage and some rank dropped a copy."""

    def verdict(votes: list[tuple[bool, bool]]) -> bool:
        return more and all(d for d, _ in votes) and any(x for _, x in votes)

    session = mem.comm.session("memory-retry")
    try:
        mine = (is_damage(error), bool(dropped))
        lost = _lost("memory-retry", mem.newest or "")
        return bool(all_reduce(mem.comm, session, "vote", lambda: mine, verdict, lost))
    except TrainsnapError:
        return False
    finally:
        session.close()


def _given(value: Any) -> Callable[[], Any]:
    """A rank's part of a step, fixed now (the step's local function)."""
    return lambda: value


def _lost(step: str, sid: str) -> Failure:
    def failed(ranks: RankErrors) -> TrainsnapError:
        return LoadFailedError(
            f"restoring memory snapshot {sid} failed in {step} on {len(ranks)} rank(s)",
            snapshot_id=sid,
            rank_errors=ranks,
        )

    return failed


class _Counted:
    """A node directory that counts the bytes a load reads from it."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url
        self.readinto_is_zero_copy = inner.readinto_is_zero_copy
        self.bytes_read = 0
        self._lock = threading.Lock()

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_read += nbytes

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        data = self.inner.get(key, start, end)
        self._count(len(data))
        return data

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        self.inner.read_into(key, start, out)
        self._count(out.nbytes)

    def read_steps(self, key: str, start: int, steps: Any, done: Any) -> None:
        read_steps(self.inner, key, start, steps, done)
        self._count(sum(b.nbytes for step in steps for b in step))

    def read_uncached(self, key: str, start: int, out: memoryview, length: int) -> bool:
        if not read_uncached(self.inner, key, start, out, length):
            return False
        self._count(length)
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


__all__ = ["NODE", "PARTNER", "restore"]
