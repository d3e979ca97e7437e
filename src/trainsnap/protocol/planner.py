"""The global save plan: who writes what. Pure -- no data, no I/O, no torch.distributed.

Input: what each rank holds (:class:`RankMeta`: its step, its tensor entries and values, with
sizes and, for undeclared replicas, content digests). Output: per rank, which of its entries and
values it writes and under which scope (:class:`Assignment`), or the reasons the save cannot go
ahead -- on every rank, before anything is written.

Scale: ranks' entry lists are gathered per top-level state key as opaque blobs, and identical
blobs (data-parallel replicas of a model hold identical lists) are decoded and processed once, so
the work is O(unique entries), not O(ranks x entries). Writer balancing is greedy, largest first,
onto the least-loaded holder (a heap per holder group with lazy updates), O(n log n).
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any

from trainsnap.format import tree
from trainsnap.format.regions import Flat, Region, Shape, tiling_problems

# The plan's records live in plan_records; they are re-exported here, where callers find them.
from trainsnap.protocol.plan_records import (
    GLOBAL,
    Assigned,
    Assignment,
    Entry,
    RankMeta,
    SavePlan,
    Value,
    _decode,
    flat_entries,
)

__all__ = [
    "GLOBAL",
    "Assigned",
    "Assignment",
    "Channel",
    "Entry",
    "PlanCache",
    "PlanMemory",
    "RankMeta",
    "SavePlan",
    "Value",
    "flat_entries",
    "layout_digest",
    "plan_cached",
    "plan_local",
    "plan_save",
]


def _refuse(world: int, problems: list[str]) -> SavePlan:
    return SavePlan([Assignment(problems=problems) for _ in range(world)], [0] * world, {})


@dataclass(slots=True)
class _Uniques:
    """Every distinct (key, region) to write, numbered in the order first seen, held in columns.

    An id first seen at ``index`` of blob ``b`` is held by every (rank, offset) in
    ``holders[b]``, at flat index offset + index: an entry shared by the 32 data-parallel
    replicas of a blob costs three list slots, not 32 tuples, and no object of its own (half a
    million small objects cost more in garbage collection than in their own making). The few ids
    also found in other blobs (undeclared replicas of ranks that group differently) list those
    sources in ``more``.
    """

    blobs: list[list[Entry]]
    """The distinct blobs' entries, in the order first seen."""
    holders: list[list[tuple[int, int]]]
    """Per blob: (rank, offset of the blob in that rank's flat entries) of each rank with it."""
    entries: list[Entry] = field(default_factory=list)
    """Per id: its entry as first seen."""
    blob: list[int] = field(default_factory=list)
    index: list[int] = field(default_factory=list)
    more: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    """Per id seen in several places: the further (blob, index) sources."""

    def sources(self, uid: int) -> list[tuple[int, int]]:
        return [(self.blob[uid], self.index[uid]), *self.more.get(uid, ())]

    def holders_of(self, uid: int) -> list[tuple[int, int]]:
        """(rank, flat index) of every holder."""
        return [(r, off + i) for b, i in self.sources(uid) for r, off in self.holders[b]]

    def index_on(self, uid: int, rank: int) -> int:
        for r, index in self.holders_of(uid):
            if r == rank:
                return index
        raise KeyError(rank)

    def differs(self, uid: int) -> bool:
        """True when every holder gave a content digest and they do not all agree."""
        digests = {self.blobs[b][i].digest for b, i in self.sources(uid)}
        return None not in digests and len(digests) > 1


Channel = tuple[str, int, int, int]
"""Whose plans: (storage URL, world size, coordinator, rank; -1 for the coordinator's plan)."""


class PlanMemory:
    """What a process remembers of its job's save plans, kept from one save to the next by the
    job's control plane (:attr:`~trainsnap.protocol.control_plane.StoreComm.plans`): the layout
    each rank last had accepted (it then sends only a digest) and the coordinator's last full
    plans (a few roots at most). Also how the coordinator planned, for tests and benchmarks.
    Forgetting either is always safe: the next save sends, or plans, in full."""

    MAX_PLANS = 4

    def __init__(self) -> None:
        self.sent: dict[Channel, bytes] = {}
        self.plans: OrderedDict[Channel, PlanCache] = OrderedDict()
        self.counts = {"full": 0, "reused": 0, "digests_received": 0}

    def forget_sent(self) -> None:
        """What a restarted rank remembers: the next save sends its layout in full."""
        self.sent.clear()

    def forget_plans(self) -> None:
        """What a restarted coordinator remembers: a digest it then receives refuses that save,
        and the next one is planned in full."""
        self.plans.clear()

    def keep(self, channel: Channel, cache: PlanCache | None, *, reused: bool) -> None:
        """(coordinator) The plan to reuse on ``channel`` next time (none: forget it)."""
        if cache is None:
            self.plans.pop(channel, None)
            return
        self.counts["reused" if reused else "full"] += 1
        self.plans[channel] = cache
        self.plans.move_to_end(channel)
        while len(self.plans) > self.MAX_PLANS:
            self.plans.popitem(last=False)


@dataclass(slots=True)
class PlanCache:
    """The coordinator's last full plan, reused while no rank's layout changes: a training
    job's layout is the same from one save to the next, only the bytes change."""

    layouts: list[bytes]
    metas: list[RankMeta]
    plan: SavePlan
    entries: list[list[Assigned]]
    """Each rank's tensor assignment in that plan."""
    loads: list[int]
    """Tensor bytes per rank in that plan (values are assigned afresh every save)."""


def layout_digest(meta: RankMeta) -> bytes:
    """The digest of a rank's layout (everything the plan is made from but the values'
    contents): equal digests mean the same plan."""
    h = hashlib.blake2b(digest_size=16)
    for group, blob in meta.groups:
        h.update(group.encode())
        h.update(len(blob).to_bytes(8, "little"))
        h.update(blob)
    h.update(json.dumps([[v.key, v.codec] for v in meta.values]).encode())
    h.update(json.dumps(meta.tree).encode())
    return h.digest()


def plan_save(metas: list[RankMeta], snapshot_id: str) -> SavePlan:
    """Decide who writes what, or refuse with every reason found."""
    return plan_cached(metas, snapshot_id, None)[0]


def plan_cached(
    metas: list[RankMeta], snapshot_id: str, cache: PlanCache | None
) -> tuple[SavePlan, PlanCache | None]:
    """Decide who writes what, or refuse with every reason found; with ``cache`` (the last
    full plan), ranks whose layout did not change sent only a digest, and when no rank's
    changed the plan is reused: only the values are assigned anew. Returns the plan and the
    cache to keep (None after a refusal)."""
    world = len(metas)
    problems = [f"rank {m.rank}: {m.error}" for m in metas if m.error]
    if problems:
        return _refuse(world, problems), None
    steps = {m.step for m in metas}
    if len(steps) > 1:
        by_step: dict[int, list[int]] = defaultdict(list)
        for m in metas:
            by_step[m.step].append(m.rank)
        shown = "; ".join(f"step {s} on ranks {_ranks(r)}" for s, r in sorted(by_step.items()))
        return _refuse(world, [f"ranks disagree on the step: {shown}"]), None
    usable = cache is not None and len(cache.layouts) == world
    unknown = [
        m.rank
        for m in metas
        if m.cached and not (usable and cache is not None and cache.layouts[m.rank] == m.layout)
    ]
    if unknown:
        return _refuse(
            world,
            [
                f"ranks {_ranks(unknown)} sent the digest of a layout the coordinator does not "
                "hold (it restarted?); the next save sends every layout in full"
            ],
        ), None
    if usable and cache is not None and [m.layout for m in metas] == cache.layouts:
        return _reuse(metas, snapshot_id, cache), cache
    if cache is not None:  # some ranks changed: the others' layouts come from the cache
        metas = [_in_full(m, cache.metas[m.rank]) if m.cached else m for m in metas]
    plan = _plan_full(metas, snapshot_id, world)
    if plan.problems:
        return plan, None
    fresh = PlanCache(
        [m.layout for m in metas],
        metas,
        plan,
        [list(a.entries) for a in plan.assignments],
        _tensor_loads(plan, metas),
    )
    return plan, fresh


def _tensor_loads(plan: SavePlan, metas: list[RankMeta]) -> list[int]:
    loads = list(plan.bytes_per_rank)
    for rank, a in enumerate(plan.assignments):
        values = metas[rank].values
        loads[rank] -= sum(values[i].nbytes for i, _ in a.values)
    return loads


def _in_full(meta: RankMeta, known: RankMeta) -> RankMeta:
    """A rank's description with the entries and tree of its known (same) layout."""
    return RankMeta(
        meta.rank, meta.step, known.groups, meta.values, tree=known.tree, layout=meta.layout
    )


def _reuse(metas: list[RankMeta], snapshot_id: str, cache: PlanCache) -> SavePlan:
    """The cached plan under a new id, with this save's values assigned."""
    full = [_in_full(m, old) for m, old in zip(metas, cache.metas, strict=True)]
    assignments = [Assignment(snapshot_id=snapshot_id, entries=list(e)) for e in cache.entries]
    loads = list(cache.loads)
    _assign_values(full, loads, assignments)
    p = cache.plan
    return SavePlan(assignments, loads, p.tensors, p.decoded, full, p.tree)


def _plan_full(metas: list[RankMeta], snapshot_id: str, world: int) -> SavePlan:
    merged: Any = None
    for m in metas:
        try:
            merged = tree.merge(merged, m.tree)
        except ValueError as e:
            return _refuse(world, [f"ranks hold differently shaped states: {e} (rank {m.rank})"])
    decoded: dict[bytes, list[Entry]] = {}
    uniques, problems = _collect(metas, decoded)
    if problems:
        return _refuse(world, problems)
    tensors, scoped, problems = _scope_and_check(uniques)
    if problems:
        return _refuse(world, problems)
    assignments = [Assignment(snapshot_id=snapshot_id) for _ in range(world)]
    loads = [0] * world
    # Ranks' own (non-replicated) entries load them first; replicas then go where there is room.
    replicated = _assign_own(uniques, scoped, loads, assignments)
    _balance(uniques, replicated, loads, assignments)
    _assign_values(metas, loads, assignments)
    return SavePlan(assignments, loads, tensors, decoded, metas, merged)


_LOCAL_BLOB = b"<this process>"


def plan_local(
    entries: list[Entry], values: list[Value], step: int, snapshot_id: str, structure: Any = None
) -> SavePlan:
    """The plan of a single process: it writes everything, all of it global. Nothing is
    pickled (the pause of an asynchronous save includes planning)."""
    problems: list[str] = []
    tensors: dict[tuple[str, int], tuple[str, Shape]] = {}
    for key, dtype, shape, region, _nbytes, _digest in entries:
        tensors[(key, GLOBAL)] = (dtype, shape)
        if region.numel != _numel(shape):
            for why in tiling_problems([region], shape, limit=3):
                problems.append(
                    f"{key!r}: the shards all ranks hold together do not tile the tensor: {why}"
                )
    if problems:
        return _refuse(1, problems[:20])
    a = Assignment(
        snapshot_id=snapshot_id,
        entries=[Assigned(i, GLOBAL) for i in range(len(entries))],
        values=[Assigned(i, GLOBAL) for i in range(len(values))],
    )
    loads = [sum(e.nbytes for e in entries) + sum(v.nbytes for v in values)]
    meta = RankMeta(0, step, [("", _LOCAL_BLOB)], values, tree=structure)
    return SavePlan([a], loads, tensors, {_LOCAL_BLOB: list(entries)}, [meta], structure)


def _ranks(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    return ", ".join(map(str, ranks[:8])) + (
        f" and {len(ranks) - 8} more" if len(ranks) > 8 else ""
    )


def _collect(
    metas: list[RankMeta], decoded: dict[bytes, list[Entry]]
) -> tuple[_Uniques, list[str]]:
    """Every distinct (key, region) with its holders; blobs shared by ranks are decoded once."""
    uniques = _blobs(metas, decoded)
    problems: list[str] = []
    entries, blob_of, index_of, more = uniques.entries, uniques.blob, uniques.index, uniques.more
    # Keyed by key, then region: one small dict per tensor costs less than a tuple per shard.
    seen: dict[str, dict[Region, int]] = {}
    for b, blob_entries in enumerate(uniques.blobs):
        for i, e in enumerate(blob_entries):
            key, dtype, shape, region = e.key, e.dtype, e.shape, e.region
            by_region = seen.get(key)
            if by_region is None:
                by_region = seen[key] = {}
            uid = by_region.setdefault(region, len(entries))
            if uid == len(entries):
                entries.append(e)
                blob_of.append(b)
                index_of.append(i)
                continue
            first = entries[uid]
            if first.dtype != dtype or first.shape != shape:
                problems.append(
                    f"{key!r}: ranks disagree on dtype/shape ({first.dtype} {list(first.shape)} vs "
                    f"{dtype} {list(shape)}, rank {uniques.holders[b][0][0]})"
                )
                continue
            more.setdefault(uid, []).append((b, i))
    return uniques, problems[:20]


def _blobs(metas: list[RankMeta], decoded: dict[bytes, list[Entry]]) -> _Uniques:
    """The distinct blobs, each decoded once, with the ranks holding it."""
    slots: dict[bytes, int] = {}
    uniques = _Uniques([], [])
    for m in metas:
        offset = 0
        for _g, blob in m.groups:
            slot = slots.get(blob)
            if slot is None:
                slot = slots[blob] = len(uniques.blobs)
                es = decoded.get(blob)
                if es is None:
                    es = decoded[blob] = _decode(blob)
                uniques.blobs.append(es)
                uniques.holders.append([])
            uniques.holders[slot].append((m.rank, offset))
            offset += len(uniques.blobs[slot])
    return uniques


_Scoped = tuple[list[int], list[int]]
"""(ids, scopes): each id to write under each scope, in the order writers are given them."""


def _scope_and_check(
    uniques: _Uniques,
) -> tuple[dict[tuple[str, int], tuple[str, Shape]], _Scoped, list[str]]:
    """Decide each entry's scope and check that global tensors tile exactly.

    An undeclared replica (digest given) whose holders disagree on the bytes is kept per rank:
    never silently reduced to one rank's copy.
    """
    problems: list[str] = []
    tensors: dict[tuple[str, int], tuple[str, Shape]] = {}
    regions: dict[str, list[Region]] = {}
    ids: list[int] = []
    scopes: list[int] = []
    head: dict[str, Entry] = {}  # each key's first entry: its dtype and shape
    for uid, e in enumerate(uniques.entries):
        key = e.key
        first = head.setdefault(key, e)
        if first is not e and (first.dtype != e.dtype or first.shape != e.shape):
            was, now = (first.dtype, first.shape), (e.dtype, e.shape)
            problems.append(f"{key!r}: ranks disagree on dtype/shape ({was} vs {now})")
            continue
        if uid in uniques.more and uniques.differs(uid):
            for rank, _index in uniques.holders_of(uid):
                tensors[(key, rank)] = (e.dtype, e.shape)
                ids.append(uid)
                scopes.append(rank)
            continue
        rs = regions.get(key)
        if rs is None:
            rs = regions[key] = []
            tensors[(key, GLOBAL)] = (e.dtype, e.shape)
        rs.append(e.region)
        ids.append(uid)
        scopes.append(GLOBAL)
    problems += _tiling(regions, head)
    return tensors, (ids, scopes), problems[:20]


def _tiling(regions: dict[str, list[Region]], head: dict[str, Entry]) -> list[str]:
    """Why each key's global regions do not tile its tensor (empty when all do)."""
    problems: list[str] = []
    # A model has a handful of distinct layouts over thousands of tensors: check each once. Ranks
    # list a layout's regions in the same order almost always, so that order is tried first.
    checked: dict[tuple[Shape, tuple[Region, ...]], list[str]] = {}
    for key, rs in regions.items():
        shape = head[key].shape
        if len(rs) == 1 and rs[0].numel == _numel(shape):
            continue  # the common case: one full region
        as_listed = (shape, tuple(rs))
        found = checked.get(as_listed)
        if found is None:
            layout = (shape, tuple(sorted(rs, key=_region_order)))
            found = checked.get(layout)
            if found is None:
                found = checked[layout] = tiling_problems(rs, shape, limit=3)
            checked[as_listed] = found
        for why in found:
            problems.append(
                f"{key!r}: the shards all ranks hold together do not tile the tensor: {why}"
            )
    return problems


def _region_order(result: Region) -> tuple[int, ...]:
    return (1, result.start) if isinstance(result, Flat) else (0, *result.offsets)


def _numel(shape: Shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _assign_own(
    uniques: _Uniques, scoped: _Scoped, loads: list[int], out: list[Assignment]
) -> list[int]:
    """Give each entry held by one rank only (or kept per rank) to that rank; returns the ids
    of the replicated ones, in order."""
    replicated: list[int] = []
    entries, blob_of, index_of = uniques.entries, uniques.blob, uniques.index
    for uid, scope in zip(*scoped, strict=True):
        if scope != GLOBAL:  # a rank's own copy: that rank writes it
            out[scope].entries.append(Assigned(uniques.index_on(uid, scope), scope))
            loads[scope] += entries[uid].nbytes
            continue
        src = uniques.holders[blob_of[uid]]
        if len(src) == 1 and uid not in uniques.more:
            rank, offset = src[0]
            out[rank].entries.append(Assigned(offset + index_of[uid], GLOBAL))
            loads[rank] += entries[uid].nbytes
        else:
            replicated.append(uid)
    return replicated


def _balance(
    uniques: _Uniques, replicated: list[int], loads: list[int], out: list[Assignment]
) -> None:
    """Largest first onto the least-loaded holder: each writer ends within one shard of fair."""
    heaps: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    groups: dict[int, tuple[tuple[int, ...], dict[int, int]]] = {}  # blob -> ranks, offsets
    entries, blob_of, index_of = uniques.entries, uniques.blob, uniques.index
    sizes = [entries[uid].nbytes for uid in replicated]
    # Stable: equal sizes keep their order (the reverse of a stable sort is stable too).
    for k in sorted(range(len(replicated)), key=sizes.__getitem__, reverse=True):
        uid = replicated[k]
        offsets: dict[int, int] | None = None
        if uid in uniques.more:
            ranks = tuple(sorted({r for r, _ in uniques.holders_of(uid)}))
        else:
            group = groups.get(blob_of[uid])
            if group is None:
                group = groups[blob_of[uid]] = _group(uniques.holders[blob_of[uid]])
            ranks, offsets = group
        heap = heaps.get(ranks)
        if heap is None:
            heap = heaps[ranks] = [(loads[r], r) for r in ranks]
            heapq.heapify(heap)
        # Each rank has one heap item; a stale one (another group moved the rank) is refreshed.
        while heap[0][0] != loads[heap[0][1]]:
            heapq.heapreplace(heap, (loads[heap[0][1]], heap[0][1]))
        r = heap[0][1]
        index = uniques.index_on(uid, r) if offsets is None else offsets[r] + index_of[uid]
        out[r].entries.append(Assigned(index, GLOBAL))
        loads[r] += sizes[k]
        heapq.heapreplace(heap, (loads[r], r))


def _group(holders: list[tuple[int, int]]) -> tuple[tuple[int, ...], dict[int, int]]:
    """A blob's holding ranks, sorted, and each one's offset (its first, if it holds it twice)."""
    offsets: dict[int, int] = {}
    for rank, offset in holders:
        offsets.setdefault(rank, offset)
    return tuple(sorted(offsets)), offsets


def _assign_values(metas: list[RankMeta], loads: list[int], out: list[Assignment]) -> None:
    """A value identical on every rank that holds it is stored once (by the least-loaded
    holder); a value that differs between ranks is stored per rank."""
    holders: dict[str, list[tuple[int, int, Value]]] = defaultdict(list)
    for m in metas:
        for i, value in enumerate(m.values):
            holders[value.key].append((m.rank, i, value))
    for _key, hs in holders.items():
        if len({v.digest for _, _, v in hs}) == 1:
            rank, i, value = min(hs, key=lambda h: (loads[h[0]], h[0]))
            out[rank].values.append(Assigned(i, GLOBAL))
            loads[rank] += value.nbytes
        else:
            for rank, i, value in hs:
                out[rank].values.append(Assigned(i, rank))
                loads[rank] += value.nbytes
