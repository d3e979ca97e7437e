"""Loading into a given state: match keys, plan ranged reads, read and verify, fill in place.

For each tensor the state asks for, the saved shards that meet the local shard are found by a
sort-and-sweep index (:class:`trainsnap.format.regions.RegionIndex`) and intersected into
pieces; each piece becomes records of the load's read plan
(:func:`trainsnap.engine.read_plan.piece_reads`), and values become records too. One executor
(:class:`trainsnap.engine.read_executor.ReadExecutor`) reads them, each by the strategy its policy
picks, every block verified before its bytes are used. Destinations that are not
CPU-contiguous are filled through a contiguous work tensor.

All checks that need no data (missing keys, shapes, dtypes, coverage) run before the first byte
is read, so a load refused for those reasons leaves the state untouched. A load that fails while
reading (a corrupt block) leaves the state partially filled: load again, from this snapshot or
another, before using it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from trainsnap import tunables
from trainsnap.engine.buffers import raw_bytes
from trainsnap.engine.read_executor import ReadExecutor, read_payload
from trainsnap.engine.read_plan import Destination, object_reads, piece_reads
from trainsnap.engine.reader import Reader
from trainsnap.errors import (
    CorruptError,
    IncompatibleError,
    InvalidArgumentError,
    NotFoundError,
    TrainsnapError,
)
from trainsnap.format import values
from trainsnap.format.manifest import Manifest, keys_summary
from trainsnap.format.regions import Piece, Region, RegionIndex
from trainsnap.format.values import PickleKeys
from trainsnap.protocol import replica_reads
from trainsnap.protocol.direct_reads import whole_reads, whole_shards
from trainsnap.protocol.replica_reads import Replicas
from trainsnap.state.capture import Targets, TensorItem, ValueTarget
from trainsnap.storage.base import Storage

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Dest(Destination):
    """A target tensor's memory for the reads (``work``: the destination itself when it is a
    contiguous CPU tensor; ``view``, its bytes, made once here, before any read: made while the
    I/O pool runs, its torch calls would each wait for a worker to hand the GIL back)."""

    item: TensorItem


def _dest(item: TensorItem) -> _Dest:
    # detach only where it matters (a strided copy into a leaf that requires grad): it releases
    # the GIL, which costs a handoff per tensor while the I/O pool runs
    t = item.local.detach() if item.local.requires_grad else item.local
    direct = t.is_cpu and t.is_contiguous() and not (t.is_conj() or t.is_neg())
    work = t if direct else torch.empty(tuple(t.shape), dtype=t.dtype)
    return _Dest(raw_bytes(work), work, t.element_size(), direct, item.key, item)


def _check_rank_bound(manifest: Manifest, targets: Targets, same_world: bool) -> None:
    """Per-rank entries (saved by each rank, different on each) map rank r to rank r, and only
    on the world size that saved them: any other mapping would be a silent wrong value."""
    if same_world:
        return
    bound = [t.key for t in targets.tensors if _rank_scoped(manifest, t.key)]
    bound += [v.key for v in targets.values if _rank_scoped(manifest, v.key, value=True)]
    refuse_rank_bound(manifest, bound)


def refuse_rank_bound(manifest: Manifest, bound: list[str]) -> None:
    """Raise for per-rank entries asked for on another world size (nothing when none)."""
    if bound:
        world = manifest.topology.get("world_size")
        raise IncompatibleError(
            f"snapshot {manifest.snapshot_id} holds per-rank state for {keys_summary(bound)}, "
            "saved by "
            f"{world} ranks with different contents on each; it maps only to the same number of "
            "ranks (rank r restores rank r). Load on that many ranks, or leave these keys out of "
            "the state (and re-derive them), or make them identical on every rank so they are "
            "stored once.",
            snapshot_id=manifest.snapshot_id,
            key=bound[0],
        )


def rank_scoped(manifest: Manifest, key: str) -> bool:
    """True when ``key`` was saved per rank (a tensor or a value)."""
    return _rank_scoped(manifest, key) or _rank_scoped(manifest, key, value=True)


def _rank_scoped(manifest: Manifest, key: str, value: bool = False) -> bool:
    idx = manifest.value_index() if value else manifest.tensor_index()
    return (key, -1) not in idx and key in manifest.rank_scoped_keys(value)


def match(
    manifest: Manifest, targets: Targets, rank: int, same_world: bool = True
) -> list[tuple[_Dest, int]]:
    """Pair each target tensor with its saved tensor; refuse (before reading anything) keys the
    snapshot lacks, per-rank state on another world size, and shapes or dtypes that differ."""
    _check_rank_bound(manifest, targets, same_world)
    missing: list[str] = []
    problems: list[tuple[str, str]] = []
    pairs = []
    for item in targets.tensors:
        t = manifest.find_tensor(item.key, rank)
        if t is None:
            missing.append(item.key)
            continue
        saved_dtype, want = manifest.tensor_dtypes[t], values.dtype_name(item.local.dtype)
        if saved_dtype != want:
            problems.append((item.key, f"saved as {saved_dtype}, the state holds {want}"))
        if manifest.tensor_shapes[t] != item.global_shape:
            problems.append(
                (
                    item.key,
                    f"saved with shape {list(manifest.tensor_shapes[t])}, "
                    f"the state holds {list(item.global_shape)}",
                )
            )
        pairs.append((_dest(item), t))
    for v in targets.values:
        if manifest.find_value(v.key, rank) is None:
            missing.append(v.key)
    if missing:
        raise NotFoundError(
            f"snapshot {manifest.snapshot_id} lacks {len(missing)} key(s) the state asks for: "
            f"{keys_summary(missing)}. Load into a state that matches the one saved, or remove "
            "those keys from the state you load into.",
            snapshot_id=manifest.snapshot_id,
            key=missing[0],
        )
    if problems:
        raise IncompatibleError(
            f"snapshot {manifest.snapshot_id} does not fit the state: the tensors differ. "
            "Build the "
            "state with the model and optimizer configuration that was saved.",
            snapshot_id=manifest.snapshot_id,
            key=problems[0][0],
            problems=[f"{k!r}: {why}" for k, why in problems],
            see_all="`trainsnap show ROOT ID` lists every saved key with its shape",
        )
    return pairs


def _overlaps(
    manifest: Manifest,
    tensor_index: int,
    region: Region,
    indexes: dict[int, tuple[list[int], RegionIndex]],
) -> list[tuple[int, list[Piece]]]:
    """(shard row, pieces) of saved tensor ``ti`` that meet ``region``."""
    ss = manifest.shard_start()
    lo, hi = int(ss[tensor_index]), int(ss[tensor_index + 1])
    if hi - lo == 1 and tensor_index not in indexes:
        # The common case of an unchanged topology: one saved shard, the one asked for.
        saved = manifest.shard_region(lo, manifest.tensor_shapes[tensor_index])
        if saved == region:
            n = region.numel
            return [(lo, [Piece((n,), 0, (1,), 0, (1,))])] if n else []
    if tensor_index not in indexes:
        shards = manifest.tensor_shards(tensor_index)
        indexes[tensor_index] = (
            [s for s, _ in shards],
            RegionIndex([r for _, r in shards], manifest.tensor_shapes[tensor_index]),
        )
    ids, index = indexes[tensor_index]
    return [(ids[i], ps) for i, ps in index.overlapping(region)]


def load_tensors(reader: Reader, pairs: list[tuple[_Dest, int]], threads: int) -> None:
    """Read every destination's elements; each destination gets every element exactly once.

    Coverage is checked for every tensor before the first read (a refused load touches
    nothing). Tensors read whole from one saved shard are planned in bulk and their reads
    start first; the others' reads start as each is planned, while later ones are still being
    planned (:class:`~trainsnap.engine.read_executor.ReadExecutor`)."""
    wholes, rest = _split_whole(reader.m, pairs)
    found = _checked_overlaps(reader.m, rest)
    with ReadExecutor(reader, threads) as executor:
        executor.add(whole_reads(reader.m, wholes))
        for dest, shards in found:
            for shard, pieces in shards:
                runs_of = partial(reader.payload_runs, shard)
                for piece in pieces:
                    executor.add(piece_reads(piece, runs_of, dest, reader.policy))
    for dest, _ in pairs:
        if not dest.in_place:
            with torch.no_grad():
                dest.item.local.copy_(dest.work)


def _split_whole(
    manifest: Manifest, pairs: list[tuple[_Dest, int]]
) -> tuple[list[tuple[memoryview, int, str]], list[tuple[_Dest, int]]]:
    """(destination bytes, shard row, key) of the destinations read in place, whole, from
    their one saved shard; and the other pairs."""
    direct = [(dest, t) for dest, t in pairs if dest.in_place]
    rows = whole_shards(
        manifest, [t for _, t in direct], [dest.item.region for dest, _ in direct]
    ).tolist()
    wholes = [
        (dest.view, row, dest.item.key)
        for (dest, _), row in zip(direct, rows, strict=True)
        if row >= 0
    ]
    if len(wholes) == len(pairs):
        return wholes, []
    taken = {id(dest) for (dest, _), row in zip(direct, rows, strict=True) if row >= 0}
    return wholes, [(dest, t) for dest, t in pairs if id(dest) not in taken]


def _checked_overlaps(
    manifest: Manifest, pairs: list[tuple[_Dest, int]]
) -> list[tuple[_Dest, list[tuple[int, list[Piece]]]]]:
    """Each destination with the pieces of saved shards it needs; refused (before anything is
    read) when the saved shards do not cover it exactly."""
    indexes: dict[int, tuple[list[int], RegionIndex]] = {}
    found = []
    for dest, ti in pairs:
        shards = _overlaps(manifest, ti, dest.item.region, indexes)
        covered = sum(p.numel for _, ps in shards for p in ps)
        if covered != dest.item.region.numel:
            raise CorruptError(
                f"snapshot {manifest.snapshot_id}: the saved shards of {dest.item.key!r} cover "
                f"{covered} of the {dest.item.region.numel} elements this rank needs (shards "
                "overlap or leave a gap); the manifest is inconsistent",
                snapshot_id=manifest.snapshot_id,
                key=dest.item.key,
            )
        found.append((dest, shards))
    return found


def read_values(
    reader: Reader, manifest: Manifest, targets: Targets, rank: int, *, allow_pickle: PickleKeys
) -> list[tuple[ValueTarget, Any]]:
    """Read, verify and decode every value the state asks for (nothing is assigned yet): one
    read plan for all of them (values packed together share blocks, read once), then each
    decoded."""
    if not targets.values:
        return []
    base = manifest.value_chunk_base()
    read: list[tuple[ValueTarget, int, bytearray]] = []
    with ReadExecutor(reader, tunables.get().io_threads) as executor:
        for v in targets.values:
            vi = manifest.find_value(v.key, rank)
            assert vi is not None  # match() checked
            n = reader.checked_payload_size(base + vi, v.key)
            buf = bytearray(n)
            runs = reader.payload_runs(base + vi, 0, n)
            executor.add(object_reads(runs, [memoryview(buf)], v.key))
            read.append((v, vi, buf))
    return [
        (
            v,
            values.decode(
                manifest.value_codecs[vi],
                bytes(buf),
                v.key,
                allow_pickle=allow_pickle,
                snapshot_id=manifest.snapshot_id,
            ),
        )
        for v, vi, buf in read
    ]


def read_value(reader: Reader, key: str, rank: int) -> Any:
    """One value of a snapshot, verified and decoded (JSON only)."""
    manifest = reader.m
    vi = manifest.find_value(key, rank)
    if vi is None:
        raise NotFoundError(f"snapshot {manifest.snapshot_id} has no value {key!r}", key=key)
    owner = manifest.value_chunk_base() + vi
    n = reader.checked_payload_size(owner, key)
    buf = bytearray(n)
    read_payload(reader, owner, 0, n, memoryview(buf), key)
    return values.decode(
        manifest.value_codecs[vi],
        bytes(buf),
        key,
        allow_pickle=False,
        snapshot_id=manifest.snapshot_id,
    )


def fill(
    storage: Storage,
    manifest: Manifest,
    targets: Targets,
    rank: int,
    *,
    allow_pickle: PickleKeys,
    same_world: bool = True,
    replicas: Replicas | None = None,
    reader: Reader | None = None,
) -> Reader:
    """Fill ``targets`` from ``manifest``: values are read and decoded first (a value that may
    not be loaded refuses the load before any tensor is touched), then tensors (with
    ``replicas``, this rank's share of them, the rest received from the replicas), then values
    are put in their containers and stateful objects get their state dicts back. ``reader``:
    the load's reader when it has read already (its verified blocks are not read again)."""
    reader = reader if reader is not None else Reader(storage, manifest)
    if replicas is None:
        pairs = match(manifest, targets, rank, same_world)
        values = read_values(reader, manifest, targets, rank, allow_pickle=allow_pickle)
        load_tensors(reader, pairs, tunables.get().io_threads)
    else:
        values = _fill_shared(reader, manifest, targets, replicas, allow_pickle, same_world)
    if targets.assign is not None:
        targets.assign({v.key: value for v, value in values})
    else:
        for v, value in values:
            if v.container is None:
                raise InvalidArgumentError(f"nowhere to put the value {v.key!r}", key=v.key)
            v.container[v.index] = value
    for finish in targets.finishers:
        finish()
    return reader


def _place(manifest: Manifest, tensor: int) -> replica_reads.Place:
    """Where a tensor's stored bytes start and end (its first and last shard's chunks), by
    object name: the same on every rank, whichever part of the manifest it holds."""
    ss = manifest.shard_start()
    lo, hi = int(ss[tensor]), int(ss[tensor + 1])
    first = manifest.chunks_of(lo) if hi > lo else range(0)
    last = manifest.chunks_of(hi - 1) if hi > lo else range(0)
    if not len(first) or not len(last):
        return ("", -1, "", -1)
    end = last[-1]
    return (
        manifest.object_names[int(manifest.chunk_object[first[0]])],
        int(manifest.chunk_offset[first[0]]),
        manifest.object_names[int(manifest.chunk_object[end])],
        int(manifest.chunk_offset[end] + manifest.chunk_length[end]),
    )


def _fill_shared(
    reader: Reader,
    manifest: Manifest,
    targets: Targets,
    replicas: Replicas,
    allow_pickle: PickleKeys,
    same_world: bool,
) -> list[tuple[ValueTarget, Any]]:
    """Read this rank's share of the tensors its replicas also need and what only it needs, in
    stored order and in batches, sending each batch's shared tensors as soon as they are
    verified while the replicas' arrive (:mod:`trainsnap.protocol.replica_reads`)."""
    failure: TrainsnapError | None = None
    values: list[tuple[ValueTarget, Any]] = []
    pairs: list[tuple[_Dest, int]] = []
    held: replica_reads.Held = []
    owner: dict[str, int] = {}
    try:
        pairs = match(manifest, targets, replicas.rank, same_world)
        classes: dict[tuple[int, ...], list[tuple[_Dest, int]]] = {}
        for dest, t in pairs:
            members = replicas.members_of(dest.item.key)
            if members is not None and int(manifest.tensor_ranks[t]) == -1:
                classes.setdefault(members, []).append((dest, t))
        for members, shared in classes.items():
            places = [(d.item.key, d.work, _place(manifest, t)) for d, t in shared]
            owner.update(replica_reads.split(members, places, manifest.block_size))
            held += [(key, work, members, place) for key, work, place in places]
        _checked_overlaps(manifest, _split_whole(manifest, pairs)[1])  # refused before reading
        values = read_values(reader, manifest, targets, replicas.rank, allow_pickle=allow_pickle)
    except TrainsnapError as e:
        failure = e
    replica_reads.start(replicas, failure)
    exchange = replica_reads.Exchange(replicas, held, owner)
    me = replicas.rank
    mine = {d.item.key: (d, t) for d, t in pairs if owner.get(d.item.key, me) == me}
    reads = [
        (key, d.work.numel() * d.work.element_size(), _place(manifest, t))
        for key, (d, t) in mine.items()
    ]
    threads = tunables.get().io_threads
    read_failure: TrainsnapError | None = None
    for batch in replica_reads.batches(reads, manifest.block_size):
        if read_failure is None:
            try:
                load_tensors(reader, [mine[key] for key in batch], threads)
            except TrainsnapError as e:
                read_failure = e
        exchange.send(batch)
    exchange.finish(read_failure)
    for dest, _ in pairs:
        if owner.get(dest.item.key, me) != me and not dest.in_place:
            with torch.no_grad():
                dest.item.local.copy_(dest.work)
    return values
