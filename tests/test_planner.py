"""The pure save planner (``protocol/planner.py``) and object layout (``format/layout.py``).

No processes, no I/O: rank descriptions are built as a rank would (``RankMeta.pack``) and the plan
is checked against the contract -- refusals name what is wrong, replicas are written once by a
balanced writer, values identical everywhere are stored once, and every byte of every payload
lands in exactly one place of one object.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import pickle
import time
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainsnap.format.layout import layout_objects
from trainsnap.format.regions import Box, Flat, Region, Shape
from trainsnap.protocol.planner import (
    GLOBAL,
    Entry,
    RankMeta,
    SavePlan,
    Value,
    flat_entries,
    plan_local,
    plan_save,
)

ITEM = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8}


def entry(
    key: str,
    shape: Shape,
    region: Region | None = None,
    *,
    dtype: str = "float32",
    digest: bytes | None = None,
) -> Entry:
    region = Box.full(shape) if region is None else region
    return Entry(key, dtype, shape, region, region.numel * ITEM[dtype], digest)


def value(key: str, content: bytes, codec: str = "json") -> Value:
    return Value(key, codec, hashlib.blake2b(content, digest_size=16).digest(), len(content))


def written(plan: SavePlan) -> dict[tuple[str, Region, int], list[int]]:
    """(key, region, scope) -> the ranks that write it."""
    out: dict[tuple[str, Region, int], list[int]] = defaultdict(list)
    for rank, (meta, a) in enumerate(zip(plan.metas, plan.assignments, strict=True)):
        flat = flat_entries(meta, plan.decoded)
        for index, scope in a.entries:
            key, _dtype, _shape, region, _n, _d = flat[index]
            out[(key, region, scope)].append(rank)
    return out


def written_values(plan: SavePlan) -> dict[tuple[str, int], list[int]]:
    out: dict[tuple[str, int], list[int]] = defaultdict(list)
    for rank, (meta, a) in enumerate(zip(plan.metas, plan.assignments, strict=True)):
        for index, scope in a.values:
            out[(meta.values[index][0], scope)].append(rank)
    return out


def check_loads(plan: SavePlan) -> None:
    """bytes_per_rank is exactly what each rank's assignment writes."""
    for rank, (meta, a) in enumerate(zip(plan.metas, plan.assignments, strict=True)):
        flat = flat_entries(meta, plan.decoded)
        expect = sum(flat[i][4] for i, _ in a.entries) + sum(meta.values[i][3] for i, _ in a.values)
        assert plan.bytes_per_rank[rank] == expect, rank


def rows(shape: Shape, cuts: list[int]) -> list[Box]:
    """Row bands of a 2-d tensor between the given cut rows."""
    edges = [0, *cuts, shape[0]]
    return [Box((a, 0), (b - a, shape[1])) for a, b in itertools.pairwise(edges) if b > a]


# -- refusals: every one before anything is written, each naming what is wrong ---------------------


def test_ranks_at_different_steps_are_refused_naming_the_steps_and_ranks() -> None:
    metas = [RankMeta.pack(r, 7 if r != 2 else 8, [entry("m.w", (4,))], []) for r in range(4)]
    plan = plan_save(metas, "sid")
    assert plan.problems == [
        "ranks disagree on the step: step 7 on ranks 0, 1, 3; step 8 on ranks 2"
    ]
    assert all(a.problems == plan.problems for a in plan.assignments), "identical on every rank"
    assert all(not a.entries and not a.values and not a.snapshot_id for a in plan.assignments)


def test_a_key_with_different_dtypes_on_two_ranks_is_refused() -> None:
    metas = [
        RankMeta.pack(0, 1, [entry("m.w", (8, 4), dtype="float32")], []),
        RankMeta.pack(1, 1, [entry("m.w", (8, 4), dtype="bfloat16")], []),
    ]
    problems = plan_save(metas, "sid").problems
    assert len(problems) == 1
    assert "'m.w'" in problems[0] and "float32" in problems[0] and "bfloat16" in problems[0]
    assert "rank 1" in problems[0]


def test_a_key_with_different_shapes_on_two_ranks_is_refused() -> None:
    # Different regions too: the disagreement is found when the key's shards are put together.
    metas = [
        RankMeta.pack(0, 1, [entry("m.w", (8, 4), Box((0, 0), (4, 4)))], []),
        RankMeta.pack(1, 1, [entry("m.w", (9, 4), Box((4, 0), (4, 4)))], []),
    ]
    problems = plan_save(metas, "sid").problems
    assert problems and "'m.w'" in problems[0] and "disagree on dtype/shape" in problems[0]
    assert "(8, 4)" in problems[0] and "(9, 4)" in problems[0]
    assert all(a.entries == [] for a in plan_save(metas, "sid").assignments)


def test_shards_that_leave_a_gap_are_refused() -> None:
    metas = [
        RankMeta.pack(0, 1, [entry("m.w", (8, 4), Box((0, 0), (4, 4)))], []),
        RankMeta.pack(1, 1, [entry("m.w", (8, 4), Box((5, 0), (3, 4)))], []),  # row 4 missing
    ]
    problems = plan_save(metas, "sid").problems
    assert len(problems) == 1
    assert "'m.w'" in problems[0] and "do not tile" in problems[0]
    assert "28 of 32 elements (a gap)" in problems[0]


def test_shards_that_overlap_are_refused_naming_both() -> None:
    metas = [
        RankMeta.pack(0, 1, [entry("m.w", (8, 4), Box((0, 0), (4, 4)))], []),
        RankMeta.pack(1, 1, [entry("m.w", (8, 4), Box((3, 0), (5, 4)))], []),
    ]
    problems = plan_save(metas, "sid").problems
    assert len(problems) == 1 and "'m.w'" in problems[0] and "overlap" in problems[0]
    assert "offsets=(0, 0)" in problems[0] and "offsets=(3, 0)" in problems[0]


def test_flat_shards_that_overlap_or_leave_a_gap_are_refused() -> None:
    def two(first: Flat, second: Flat) -> list[str]:
        return plan_save(
            [
                RankMeta.pack(0, 1, [entry("o.m", (10, 10), first)], []),
                RankMeta.pack(1, 1, [entry("o.m", (10, 10), second)], []),
            ],
            "sid",
        ).problems

    assert two(Flat(0, 50), Flat(50, 50)) == []
    gap = two(Flat(0, 50), Flat(51, 49))
    assert len(gap) == 1 and "99 of 100 elements (a gap)" in gap[0]
    overlap = two(Flat(0, 50), Flat(49, 51))
    assert len(overlap) == 1 and "overlap" in overlap[0]


def test_a_shard_outside_its_tensor_is_refused() -> None:
    metas = [
        RankMeta.pack(0, 1, [entry("m.w", (8, 4), Box((0, 0), (4, 4)))], []),
        RankMeta.pack(1, 1, [entry("m.w", (8, 4), Box((4, 0), (5, 4)))], []),
    ]
    problems = plan_save(metas, "sid").problems
    assert len(problems) == 1 and "'m.w'" in problems[0] and "does not fit" in problems[0]


def test_a_rank_reporting_an_error_refuses_the_save_naming_the_rank() -> None:
    metas = [RankMeta.pack(r, 1, [entry("m.w", (4,))], []) for r in range(3)]
    metas[1] = RankMeta(1, 1, error="cannot read the optimizer state: KeyError 'exp_avg'")
    plan = plan_save(metas, "sid")
    assert plan.problems == ["rank 1: cannot read the optimizer state: KeyError 'exp_avg'"]
    assert len(plan.assignments) == 3 and all(a.problems == plan.problems for a in plan.assignments)


def test_every_problem_is_reported_not_only_the_first() -> None:
    metas = [
        RankMeta.pack(
            0, 1, [entry("a", (8,), Box((0,), (4,))), entry("b", (8,), Box((0,), (5,)))], []
        ),
        RankMeta.pack(
            1, 1, [entry("a", (8,), Box((5,), (3,))), entry("b", (8,), Box((4,), (4,)))], []
        ),
    ]
    problems = plan_save(metas, "sid").problems
    assert len(problems) == 2
    assert any("'a'" in p and "gap" in p for p in problems)
    assert any("'b'" in p and "overlap" in p for p in problems)


def test_plan_local_refuses_a_partial_shard_and_writes_everything_otherwise() -> None:
    refused = plan_local([entry("m.w", (8, 4), Box((0, 0), (4, 4)))], [], 3, "sid")
    assert len(refused.problems) == 1
    assert "'m.w'" in refused.problems[0] and "16 of 32 elements (a gap)" in refused.problems[0]

    entries = [
        entry("m.w", (8, 4)),
        entry("m.b", (4,), dtype="bfloat16"),
        entry("o.m", (3, 3), Flat(0, 9)),
    ]
    values = [value("train.step", b"3"), value("rng", b"x" * 100, "pickle")]
    plan = plan_local(entries, values, 3, "sid")
    assert plan.problems == []
    (a,) = plan.assignments
    assert a.snapshot_id == "sid"
    assert a.entries == [(0, GLOBAL), (1, GLOBAL), (2, GLOBAL)]
    assert a.values == [(0, GLOBAL), (1, GLOBAL)]
    assert plan.bytes_per_rank == [128 + 8 + 36 + 1 + 100]
    assert plan.tensors == {
        ("m.w", GLOBAL): ("float32", (8, 4)),
        ("m.b", GLOBAL): ("bfloat16", (4,)),
        ("o.m", GLOBAL): ("float32", (3, 3)),
    }
    assert flat_entries(plan.metas[0], plan.decoded) == entries
    assert plan.metas[0].step == 3


# -- replicas, writer balance, value scoping -------------------------------------------------------


def test_a_replicated_shard_is_written_once_by_one_of_its_holders() -> None:
    # Tensor parallel over 2, data parallel over 4: each TP half is held by 4 replicas.
    world, tp = 8, 2
    metas = []
    for r in range(world):
        half = r % tp
        metas.append(RankMeta.pack(r, 1, [entry("m.w", (8, 4), Box((4 * half, 0), (4, 4)))], []))
    plan = plan_save(metas, "sid")
    assert plan.problems == []
    out = written(plan)
    assert set(out) == {("m.w", Box((0, 0), (4, 4)), GLOBAL), ("m.w", Box((4, 0), (4, 4)), GLOBAL)}
    for (_key, region, _scope), writers in out.items():
        assert len(writers) == 1, "a replica written more than once"
        assert writers[0] % tp == region.offsets[0] // 4, "written by a rank that does not hold it"
    assert sum(plan.bytes_per_rank) == 8 * 4 * 4
    assert plan.tensors == {("m.w", GLOBAL): ("float32", (8, 4))}
    check_loads(plan)


def test_an_undeclared_replica_is_stored_once_when_identical_and_per_rank_when_not() -> None:
    same, other = b"d" * 16, b"e" * 16
    metas = [
        RankMeta.pack(
            0, 1, [entry("m.w", (4,), digest=same), entry("m.bn", (2,), digest=same)], []
        ),
        RankMeta.pack(
            1, 1, [entry("m.w", (4,), digest=same), entry("m.bn", (2,), digest=other)], []
        ),
        RankMeta.pack(
            2, 1, [entry("m.w", (4,), digest=same), entry("m.bn", (2,), digest=same)], []
        ),
    ]
    plan = plan_save(metas, "sid")
    assert plan.problems == []
    out = written(plan)
    assert len(out[("m.w", Box.full((4,)), GLOBAL)]) == 1
    # Never silently reduced to one rank's copy: each rank writes its own, under its own scope.
    for r in range(3):
        assert out[("m.bn", Box.full((2,)), r)] == [r]
    assert ("m.bn", Box.full((2,)), GLOBAL) not in out
    assert plan.tensors[("m.w", GLOBAL)] == ("float32", (4,))
    assert {k for k in plan.tensors if k[0] == "m.bn"} == {("m.bn", 0), ("m.bn", 1), ("m.bn", 2)}
    check_loads(plan)


def test_values_identical_everywhere_are_stored_once_and_differing_ones_per_rank() -> None:
    world = 5
    metas = [
        RankMeta.pack(
            r,
            1,
            [entry(f"m.own{r}", (1000,))],  # uneven loads: the shared value goes to the lightest
            [
                value("train.schedule", b'{"lr": 0.1}'),
                value("rng", r.to_bytes(4, "little") * 10, "pickle"),
                *([value("only.on.three", b"3")] if r == 3 else []),
            ],
        )
        for r in range(world)
    ]
    metas[2] = RankMeta.pack(2, 1, [entry("m.own2", (10,))], metas[2].values)
    plan = plan_save(metas, "sid")
    assert plan.problems == []
    vals = written_values(plan)
    assert vals[("train.schedule", GLOBAL)] == [2], "stored once, by the least-loaded holder"
    for r in range(world):
        assert vals[("rng", r)] == [r]
    assert ("rng", GLOBAL) not in vals
    assert vals[("only.on.three", GLOBAL)] == [3]
    assert sum(len(v) for v in vals.values()) == 1 + world + 1
    check_loads(plan)


def test_writers_stay_balanced_on_a_skewed_layout() -> None:
    # Pure data parallel over 16 ranks: every rank holds every parameter. Sizes are skewed -- a
    # few huge tensors, many tiny ones -- and some ranks also write large shards of their own.
    world = 16
    sizes = [2**20, 2**19, 3 * 2**18] + [2**10 + 37 * i for i in range(200)] + [2**16] * 40
    params = [entry(f"m.p{i}", (n,)) for i, n in enumerate(sizes)]
    metas = []
    for r in range(world):
        own = [entry(f"o.r{r}", (7 * 2**16,), Flat(0, 7 * 2**16))] if r % 5 == 0 else []
        metas.append(RankMeta.pack(r, 1, params + own, []))
    plan = plan_save(metas, "sid")
    assert plan.problems == []
    loads = plan.bytes_per_rank
    largest = max(e[4] for m in metas for e in flat_entries(m, plan.decoded))
    mean = sum(loads) / world
    assert max(loads) <= 1.1 * mean + largest, (max(loads), mean, largest)
    assert sum(loads) == 4 * (sum(sizes) + 4 * 7 * 2**16)
    out = written(plan)
    assert all(len(w) == 1 for w in out.values())
    assert len(out) == len(sizes) + 4
    assert min(loads) > 0, "every replica holder takes part in writing"
    check_loads(plan)


# -- random partitions -----------------------------------------------------------------------------


@st.composite
def partitions(draw: st.DrawFn) -> tuple[Shape, list[Box]]:
    """An irregular grid of a 2-d tensor: row bands, each cut into its own columns."""
    shape = (draw(st.integers(1, 40)), draw(st.integers(1, 40)))
    row_cuts = sorted(set(draw(st.lists(st.integers(1, shape[0]), max_size=6))) - {shape[0]})
    boxes = []
    for band in rows(shape, row_cuts):
        col_cuts = sorted(set(draw(st.lists(st.integers(1, shape[1]), max_size=5))) - {shape[1]})
        edges = [0, *col_cuts, shape[1]]
        for a, b in itertools.pairwise(edges):
            boxes.append(Box((band.offsets[0], a), (band.sizes[0], b - a)))
    return shape, boxes


@settings(max_examples=60, deadline=None)
@given(partitions(), st.integers(1, 6), st.data())
def test_any_partition_over_any_ranks_is_planned_each_shard_written_once(
    partition: tuple[Shape, list[Box]], world: int, data: st.DataObject
) -> None:
    shape, boxes = partition
    held: list[list[Entry]] = [[] for _ in range(world)]
    holders: dict[Box, set[int]] = {}
    for box in boxes:  # each shard on one or more ranks (replicas)
        ranks = data.draw(st.sets(st.integers(0, world - 1), min_size=1))
        holders[box] = ranks
        for r in ranks:
            held[r].append(entry("m.w", shape, box))
    metas = [RankMeta.pack(r, 9, held[r], []) for r in range(world)]
    plan = plan_save(metas, "sid")
    assert plan.problems == []
    out = written(plan)
    assert sorted(out, key=repr) == sorted((("m.w", b, GLOBAL) for b in boxes), key=repr)
    for (_k, box, _s), writers in out.items():
        assert len(writers) == 1 and writers[0] in holders[box]
    assert sum(plan.bytes_per_rank) == shape[0] * shape[1] * 4
    check_loads(plan)

    # Drop one shard everywhere: a gap, unless the tensor is a single shard (then nothing is left).
    if len(boxes) > 1:
        gone = data.draw(st.sampled_from(boxes))
        metas = [
            RankMeta.pack(r, 9, [e for e in held[r] if e[3] != gone], []) for r in range(world)
        ]
        problems = plan_save(metas, "sid").problems
        assert len(problems) == 1 and "(a gap)" in problems[0]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 500), st.lists(st.integers(0, 500), max_size=8), st.integers(1, 4))
def test_any_flat_partition_tiles_and_a_shifted_cut_is_refused(
    numel: int, cuts: list[int], world: int
) -> None:
    edges = sorted({0, numel, *(c for c in cuts if c < numel)})
    ranges = [Flat(a, b - a) for a, b in itertools.pairwise(edges)]
    metas = [
        RankMeta.pack(
            r, 1, [entry("o.m", (numel,), f) for i, f in enumerate(ranges) if i % world == r], []
        )
        for r in range(world)
    ]
    plan = plan_save(metas, "sid")
    assert plan.problems == []
    assert {k[1] for k in written(plan)} == set(ranges)
    if len(ranges) > 1:  # grow the first range by one element: it now overlaps the second
        first = ranges[0]
        metas[0] = RankMeta.pack(
            0,
            1,
            [entry("o.m", (numel,), Flat(0, first.length + 1)), *flat_entries(metas[0], {})[1:]],
            [],
        )
        problems = plan_save(metas, "sid").problems
        assert len(problems) == 1 and "overlap" in problems[0]


# -- planning at scale, bounded --------------------------------------------------------------------

TP, PP, DP = 4, 2, 32  # 256 ranks
PARAMS_PER_STAGE = 300  # 2,400 weight shards and 4,800 optimizer-moment shards
LAYER = (
    ("attn.qkv.weight", (96, 64), 0),
    ("attn.out.weight", (64, 64), 1),
    ("mlp.w1", (128, 64), 0),
    ("mlp.w2", (64, 128), 1),
)


def sim_model(pp: int, tp: int) -> list[Entry]:
    out: list[Entry] = []
    for j in range(PARAMS_PER_STAGE):
        layer = pp * (PARAMS_PER_STAGE // len(LAYER)) + j // len(LAYER)
        name, shape, dim = LAYER[j % len(LAYER)]
        part = shape[dim] // TP
        sizes = (part, shape[1]) if dim == 0 else (shape[0], part)
        offsets = (tp * part, 0) if dim == 0 else (0, tp * part)
        out.append(
            entry(f"model.layers.{layer}.{name}", shape, Box(offsets, sizes), dtype="bfloat16")
        )
    return out


def zero1_cuts(numels: list[int], parts: int) -> list[int]:
    cum = [0]
    for n in numels:
        cum.append(cum[-1] + n)
    cuts = [min(bisect.bisect_left(cum, cum[-1] * k / parts), len(numels)) for k in range(parts)]
    return [*cuts, len(numels)]


def sim_metas() -> list[RankMeta]:
    world = TP * PP * DP
    metas: list[RankMeta | None] = [None] * world
    schedule = value("train.schedule", b'{"step": 100}')
    for pp in range(PP):
        for tp in range(TP):
            model = sim_model(pp, tp)
            cuts = zero1_cuts([e[4] for e in model], DP)
            for dp in range(DP):
                rank = (pp * DP + dp) * TP + tp
                optim = [
                    (f"optim.{m}.{k}", "float32", shape, region, n * 2, None)
                    for k, _dt, shape, region, n, _d in model[cuts[dp] : cuts[dp + 1]]
                    for m in ("exp_avg", "exp_avg_sq")
                ]
                rng = value("rng.state", rank.to_bytes(8, "little") * 64, "pickle")
                metas[rank] = RankMeta.pack(rank, 100, model + optim, [schedule, rng])
    assert all(m is not None for m in metas)
    return metas  # type: ignore[return-value]


def test_a_256_rank_plan_keeps_every_invariant_and_is_quick() -> None:
    metas = sim_metas()
    world = len(metas)
    start = time.perf_counter()
    plan = plan_save(metas, "sid-256")
    seconds = time.perf_counter() - start
    assert plan.problems == []
    assert seconds < 2.0, f"planning 256 ranks took {seconds:.2f} s"
    assert all(a.snapshot_id == "sid-256" for a in plan.assignments)
    # A (pp, tp)'s 32 replicas share one "model" blob; each rank's "optim" blob is its own.
    assert len(plan.decoded) == PP * TP + world, "identical blobs decoded once"

    out = written(plan)
    weights = [e for pp in range(PP) for tp in range(TP) for e in sim_model(pp, tp)]
    assert len(out) == 3 * len(weights), "every weight shard and both of its moments, once"
    assert all(len(w) == 1 for w in out.values())
    assert all(scope == GLOBAL for _k, _r, scope in out)
    # A weight is written by one of its 32 data-parallel replicas; a moment by its ZeRO owner.
    tp_of = {(e[0], e[3]): tp for pp in range(PP) for tp in range(TP) for e in sim_model(pp, tp)}
    for (key, region, _scope), (rank,) in out.items():
        base = key.split(".", 2)[2] if key.startswith("optim.") else key
        assert rank % TP == tp_of[(base, region)], (key, region, rank)

    # Tensors: every parameter and both moments, with the dtype and global shape of the state.
    assert len(plan.tensors) == 3 * len(weights) // TP
    for key, _dt, shape, _r, _n, _d in weights:
        assert plan.tensors[(key, GLOBAL)] == ("bfloat16", shape)
        assert plan.tensors[(f"optim.exp_avg.{key}", GLOBAL)] == ("float32", shape)

    vals = written_values(plan)
    assert len(vals[("train.schedule", GLOBAL)]) == 1
    assert all(vals[("rng.state", r)] == [r] for r in range(world))

    # Every byte once, and no writer far above its fair share.
    weight_bytes = sum(e[4] for e in weights)
    expect = 5 * weight_bytes + len(b'{"step": 100}') + world * 8 * 64
    assert sum(plan.bytes_per_rank) == expect
    largest = max(e[4] for m in metas for e in flat_entries(m, plan.decoded))
    mean = expect / world
    assert max(plan.bytes_per_rank) <= 1.1 * mean + largest
    check_loads(plan)


def test_a_description_sends_each_distinct_shape_and_region_once() -> None:
    # Equal shapes and boxes built apart, as a rank's capture builds them: the blob holds one of
    # each, the coordinator decodes them into shared objects, and the entries are unchanged.
    entries = [entry(f"m.w{i}", tuple([8, 4]), Box((0, 0), (4, 4))) for i in range(50)]
    entries += [entry(f"m.v{i}", tuple([8, 4]), Box((4, 0), (4, 4))) for i in range(50)]
    ((_group, blob),) = RankMeta.pack(0, 1, entries, []).groups
    decoded = pickle.loads(blob)
    assert decoded == entries
    assert len({id(e[2]) for e in decoded}) == 1
    assert len({id(e[3]) for e in decoded}) == 2
    assert len(blob) < 0.8 * len(pickle.dumps(entries, protocol=5))


# -- object layout ---------------------------------------------------------------------------------


def check_layout(
    sizes: list[int], chunk_size: int, pack_threshold: int, codecs: list[str] | None
) -> None:
    layout = layout_objects(
        sizes, chunk_size=chunk_size, pack_threshold=pack_threshold, codecs=codecs
    )
    assert len(layout.chunks) == len(sizes)
    # Objects: their parts lie back to back and add up to the size; one codec each.
    stored: dict[int, list[tuple[int, int]]] = defaultdict(list)  # payload -> (offset, length)
    for obj in layout.objects:
        assert obj.size == sum(length for _p, _o, length in obj.parts) > 0
        assert obj.size <= chunk_size
        for payload, offset, length in obj.parts:
            assert obj.codec == (codecs[payload] if codecs else "raw")
            stored[payload].append((offset, length))
        if len(obj.parts) > 1:
            assert all(sizes[p] < pack_threshold for p, _o, _n in obj.parts), (
                "only small ones packed"
            )
    # Chunks: each payload covered from its first byte to its last, in order, no overlap, and
    # each chunk is exactly the bytes its object holds at that offset.
    for payload, (n, chunks) in enumerate(zip(sizes, layout.chunks, strict=True)):
        if n == 0:
            assert chunks == []
            continue
        pos = 0
        for obj_index, obj_offset, length in chunks:
            obj = layout.objects[obj_index]
            at, found = 0, None
            for p, off, part_len in obj.parts:
                if at == obj_offset:
                    found = (p, off, part_len)
                    break
                at += part_len
            assert found == (payload, pos, length), "the chunk is the object's part at its offset"
            pos += length
        assert pos == n
        if n >= pack_threshold:
            assert [c[2] for c in chunks] == [
                min(chunk_size, n - o) for o in range(0, n, chunk_size)
            ]
            assert all(c[1] == 0 and len(layout.objects[c[0]].parts) == 1 for c in chunks)
        else:
            assert len(chunks) == 1
    # Every byte of every payload stored exactly once: its parts, sorted, chain from 0 to its size.
    assert set(stored) == {i for i, n in enumerate(sizes) if n}
    for payload, parts in stored.items():
        pos = 0
        for offset, length in sorted(parts):
            assert offset == pos and length > 0, (payload, parts)
            pos += length
        assert pos == sizes[payload]
    assert sum(map(len, layout.chunks)) == sum(len(o.parts) for o in layout.objects)


def test_small_payloads_are_packed_in_order_up_to_the_chunk_size() -> None:
    layout = layout_objects([100, 200, 300, 500, 50], chunk_size=1000, pack_threshold=512)
    assert [(o.parts, o.size) for o in layout.objects] == [
        ([(0, 0, 100), (1, 0, 200), (2, 0, 300)], 600),
        ([(3, 0, 500), (4, 0, 50)], 550),  # 600 + 500 would pass the chunk size
    ]
    assert layout.chunks == [
        [(0, 0, 100)],
        [(0, 100, 200)],
        [(0, 300, 300)],
        [(1, 0, 500)],
        [(1, 500, 50)],
    ]


def test_a_large_payload_is_cut_into_objects_of_its_own_at_chunk_multiples() -> None:
    layout = layout_objects([10, 2500, 20], chunk_size=1000, pack_threshold=512)
    assert layout.chunks[1] == [(1, 0, 1000), (2, 0, 1000), (3, 0, 500)]
    assert [o.parts for o in layout.objects[1:4]] == [
        [(1, 0, 1000)],
        [(1, 1000, 1000)],
        [(1, 2000, 500)],
    ]
    assert [o.size for o in layout.objects] == [30, 1000, 1000, 500]
    # The small payloads on either side share one pack.
    assert layout.objects[0].parts == [(0, 0, 10), (2, 0, 20)]
    assert layout.chunks[0] == [(0, 0, 10)] and layout.chunks[2] == [(0, 10, 20)]


def test_payloads_are_packed_only_with_their_own_codec_and_empty_ones_take_no_space() -> None:
    sizes, codecs = [10, 0, 20, 30, 40], ["raw", "raw", "zstd", "raw", "zstd"]
    layout = layout_objects(sizes, chunk_size=1000, pack_threshold=512, codecs=codecs)
    by_codec = {o.codec: [p[0] for p in o.parts] for o in layout.objects}
    assert by_codec == {"raw": [0, 3], "zstd": [2, 4]}
    assert len(layout.objects) == 2 and layout.chunks[1] == []
    check_layout(sizes, 1000, 512, codecs)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 5000), max_size=40),
    st.integers(1, 2048),
    st.floats(0, 1),
    st.booleans(),
    st.data(),
)
def test_any_payloads_lay_out_with_every_byte_stored_exactly_once(
    sizes: list[int], chunk_size: int, threshold: float, mixed: bool, data: st.DataObject
) -> None:
    pack_threshold = int(threshold * chunk_size)  # callers clamp the threshold to the chunk size
    codecs = None
    if mixed:
        n = len(sizes)
        codecs = data.draw(st.lists(st.sampled_from(["raw", "zstd"]), min_size=n, max_size=n))
    check_layout(sizes, chunk_size, pack_threshold, codecs)


@pytest.mark.parametrize("pack_threshold", [0, 1])
def test_a_threshold_of_zero_or_one_gives_every_payload_objects_of_its_own(
    pack_threshold: int,
) -> None:
    layout = layout_objects([1, 5, 3], chunk_size=2, pack_threshold=pack_threshold)
    assert [o.parts for o in layout.objects] == [
        [(0, 0, 1)],
        [(1, 0, 2)],
        [(1, 2, 2)],
        [(1, 4, 1)],
        [(2, 0, 2)],
        [(2, 2, 1)],
    ]


def test_a_rank_whose_top_level_keys_interleave_is_assigned_by_its_own_entry_order() -> None:
    # Assignment indices refer to a rank's entries as it described them (its writer looks them
    # up there): a description grouped by top-level key must not reorder interleaved keys
    # (model.a, optim.a, model.b, ... as a state built parameter by parameter is).
    keys = ["model.a", "optim.a.master", "model.b", "optim.b.master", "extra"]
    metas = [
        RankMeta.pack(rank, 1, [entry(k, (4, 2), Box((2 * rank, 0), (2, 2))) for k in keys], [])
        for rank in range(2)
    ]
    for meta in metas:
        assert [e.key for e in flat_entries(meta, {})] == keys
    plan = plan_save(metas, "s")
    for meta, assignment in zip(metas, plan.assignments, strict=True):
        flat = flat_entries(meta, plan.decoded)
        assert sorted(flat[index].key for index, _ in assignment.entries) == sorted(keys)
