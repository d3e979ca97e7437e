"""The save planner at 4,096 ranks, simulated: no processes, no data.

The descriptions of 4,096 ranks (TP 8 x PP 16 x DP 32) of a ~185 B-parameter model (20,000 2-D
bf16 parameters, TP-sharded, replicated over DP; fp32 Adam moments held ZeRO-1 style, each DP
rank owning whole TP-local parameters) are planned (``plan_save``), every rank's write report is
simulated, and the manifest is assembled, encoded and decoded. Targets: the plan in under 10 s,
the manifest decoded in under 1 s, the busiest writer within 10% of the mean plus one shard.
The next save of the same layout is planned from the cache: each rank sends a digest (under
1 KiB), the coordinator takes in under 16 MiB and plans in under 0.5 s.

This is also part 3 of ``benchmarks.distributed``.

    python -m benchmarks.planner_sim                       # 4,096 ranks
    python -m benchmarks.planner_sim --tp 4 --pp 4 --dp 8  # another world
    python -m benchmarks.planner_sim --smoke               # 16 ranks: does it run?
"""

from __future__ import annotations

import bisect
import gc
import os
import sys
from dataclasses import dataclass
from typing import Any

from benchmarks._framework import cli
from benchmarks._framework.method import timed
from benchmarks._framework.report import Check, Target, emit, facts, format_table, verdicts
from benchmarks._framework.state import MiB
from benchmarks._framework.system import load_average, machine_info
from trainsnap.engine.gc_pause import paused_gc
from trainsnap.format import encoding
from trainsnap.format.checksums import Hasher
from trainsnap.format.layout import layout_objects
from trainsnap.format.manifest import StoredObject
from trainsnap.format.regions import Box
from trainsnap.protocol import commit
from trainsnap.protocol.assemble import assemble
from trainsnap.protocol.planner import (
    Entry,
    PlanCache,
    RankMeta,
    SavePlan,
    Value,
    layout_digest,
    plan_cached,
    plan_save,
)
from trainsnap.protocol.rank_save import SaveRequest, WriteReport, Written

PLAN_TARGET = Target("<", 10.0)  # seconds
CACHED_PLAN_TARGET = Target("<", 0.5)  # seconds
CACHED_SEND_TARGET = Target("<", 1024)  # bytes per rank
CACHED_INGEST_TARGET = Target("<", 16 * 2**20)  # bytes into the coordinator
DECODE_TARGET = Target("<", 1.0)  # seconds
BALANCE_SLACK = 0.10  # the busiest writer within 10% of the mean plus one shard
SMOKE = {"tp": 2, "pp": 2, "dp": 4, "params_per_stage": 20}

# One "layer" of 10 parameters (hidden 4096, 4 experts): (name, global shape, TP-sharded dim).
# Half are sharded on dim 0 (column parallel), half on dim 1 (row parallel).
LAYER: tuple[tuple[str, tuple[int, int], int], ...] = (
    ("attn.qkv.weight", (6144, 4096), 0),
    ("attn.out.weight", (4096, 4096), 1),
    *(
        (f"mlp.experts.{e}.{w}", shape, dim)
        for e in range(4)
        for w, shape, dim in (("w1", (1536, 4096), 0), ("w2", (4096, 1536), 1))
    ),
)
RNG_STATE_BYTES = 5056  # a per-rank value (each rank's RNG state differs)
SIM_CHUNK = 32 * MiB
SIM_BLOCK = 1 * MiB


@dataclass(frozen=True, slots=True)
class World:
    """The simulated topology: TP x PP x DP ranks, ``params_per_stage`` parameters a stage."""

    tp: int = 8
    pp: int = 16
    dp: int = 32
    params_per_stage: int = 1250

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.dp) < 1 or self.params_per_stage < len(LAYER):
            raise ValueError(f"every dimension must be >= 1 and params_per_stage >= {len(LAYER)}")

    @property
    def size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, pp: int, dp: int, tp: int) -> int:
        """Megatron's order: TP fastest, then DP, then PP."""
        return (pp * self.dp + dp) * self.tp + tp


def sim_model(world: World, pp: int, tp: int) -> list[Entry]:
    """The TP-local parameter entries of one (pp, tp): identical on its DP replicas."""
    entries: list[Entry] = []
    per_layer = len(LAYER)
    for j in range(world.params_per_stage):
        layer = pp * (world.params_per_stage // per_layer) + j // per_layer
        name, shape, dim = LAYER[j % per_layer]
        part = shape[dim] // world.tp
        sizes = (part, shape[1]) if dim == 0 else (shape[0], part)
        offsets = (tp * part, 0) if dim == 0 else (0, tp * part)
        key = f"model.layers.{layer}.{name}"
        nbytes = sizes[0] * sizes[1] * 2
        entries.append(Entry(key, "bfloat16", shape, Box(offsets, sizes), nbytes, None))
    return entries


def zero1_cuts(numels: list[int], parts: int) -> list[int]:
    """Cut the flat buffer of ``numels`` into ``parts`` contiguous ranges at parameter
    boundaries, each cut at the first boundary at or past its even share. Returns parts + 1
    indices."""
    cumulative = [0]
    for count in numels:
        cumulative.append(cumulative[-1] + count)
    total = cumulative[-1]
    cuts = [
        min(bisect.bisect_left(cumulative, total * k / parts), len(numels)) for k in range(parts)
    ]
    return [*cuts, len(numels)]


def sim_optim(model: list[Entry], dp: int, cuts: list[int]) -> list[Entry]:
    """This DP rank's ZeRO-1 slice of the two Adam moments: whole TP-local parameters, as boxes
    of the logical fp32 moment tensors."""
    entries: list[Entry] = []
    for key, _dtype, shape, region, nbytes, _digest in model[cuts[dp] : cuts[dp + 1]]:
        for moment in ("exp_avg", "exp_avg_sq"):
            moment_key = f"optim.{moment}.{key}"
            entries.append(Entry(moment_key, "float32", shape, region, nbytes * 2, None))
    return entries


def sim_values(rank: int, hasher: Hasher) -> list[Value]:
    """A value every rank holds identically (stored once) and one per rank (its RNG state)."""
    step = b'{"step": 100000, "lr": 0.0003}'
    rng = rank.to_bytes(8, "little") * (RNG_STATE_BYTES // 8)
    assert len(rng) == RNG_STATE_BYTES
    return [
        Value("train.schedule", "json", hasher.digest(step), len(step)),
        Value("rng.state", "pickle", hasher.digest(rng), len(rng)),
    ]


def build_metas(world: World, hasher: Hasher) -> tuple[list[RankMeta], list[list[Entry]]]:
    """Every rank's description (packed by RankMeta.pack as a rank would) and its flat entry
    list (for the simulated writes)."""
    metas: list[Any] = [None] * world.size
    flats: list[Any] = [None] * world.size
    for pp in range(world.pp):
        for tp in range(world.tp):
            model = sim_model(world, pp, tp)
            cuts = zero1_cuts([entry[4] for entry in model], world.dp)
            for dp in range(world.dp):
                rank = world.rank(pp, dp, tp)
                entries = model + sim_optim(model, dp, cuts)  # the same Entry objects
                metas[rank] = RankMeta.pack(rank, 100, entries, sim_values(rank, hasher))
                flats[rank] = entries
    assert all(meta is not None for meta in metas)
    return metas, flats


def _report_of(sizes: list[int], assignment: Any, pattern: bytes, serial: int) -> WriteReport:
    """One rank's report of writing ``sizes``: one object per 32 MiB chunk of each payload
    (small payloads packed), names unique by ``serial``, 16 bytes of digest per 1 MiB block."""
    layout = layout_objects(sizes, chunk_size=SIM_CHUNK, pack_threshold=SIM_BLOCK)
    objects = []
    for index, obj in enumerate(layout.objects):
        blocks = -(-obj.size // SIM_BLOCK)
        objects.append(StoredObject(f"{serial + index:032x}", obj.size, pattern[: 16 * blocks]))
    count = len(assignment.entries)
    return WriteReport(
        objects=objects,
        entries=[Written(i, s, layout.chunks[j]) for j, (i, s) in enumerate(assignment.entries)],
        values=[
            Written(i, s, layout.chunks[count + j]) for j, (i, s) in enumerate(assignment.values)
        ],
        bytes_new=sum(sizes),
    )


def simulate_reports(
    plan: SavePlan, metas: list[RankMeta], flats: list[list[Entry]]
) -> list[WriteReport]:
    """Each rank's report of writing its assignment."""
    pattern = os.urandom(16 * (SIM_CHUNK // SIM_BLOCK))
    reports: list[WriteReport] = []
    serial = 0
    for rank, assignment in enumerate(plan.assignments):
        sizes = [flats[rank][i].nbytes for i, _ in assignment.entries]
        sizes += [metas[rank].values[i].nbytes for i, _ in assignment.values]
        reports.append(_report_of(sizes, assignment, pattern, serial))
        serial += len(reports[-1].objects)
    return reports


def expected_bytes(world: World, hasher: Hasher) -> int:
    """Every byte is written once: the weights once for their DP replicas, the two fp32 moments
    (4x the bf16 weights' bytes) by their owners, the shared value once, the per-rank values by
    each rank."""
    weights = sum(
        entry[4]
        for pp in range(world.pp)
        for tp in range(world.tp)
        for entry in sim_model(world, pp, tp)
    )
    values = sim_values(0, hasher)
    return 5 * weights + values[0][3] + world.size * values[1][3]


def _balance(plan: SavePlan, flats: list[list[Entry]]) -> dict[str, Any]:
    loads = plan.bytes_per_rank
    mean = sum(loads) / len(loads)
    largest = max(entry[4] for flat in flats for entry in flat)
    bound = (1 + BALANCE_SLACK) * mean + largest
    return {
        "max": max(loads),
        "mean": mean,
        "min": min(loads),
        "largest_shard": largest,
        "bound": bound,
        "max_over_mean": max(loads) / mean,
        "excess_over_largest_shard": (max(loads) - mean) / largest,
    }


def _plan_and_assemble(
    world: World, hasher: Hasher, metas: list[RankMeta], flats: list[list[Entry]]
) -> dict[str, Any]:
    sid = commit.new_snapshot_id(100)
    with paused_gc():  # as a save plans (save_protocol: the collector paused)
        plan_s, plan = timed(lambda: plan_save(metas, sid))
    if plan.problems:
        raise AssertionError(f"the simulated plan was refused: {plan.problems[:5]}")
    print(f"  plan_save {plan_s:.2f} s", flush=True)
    simulate_s, reports = timed(lambda: simulate_reports(plan, metas, flats))
    mesh = {"pp": world.pp, "dp": world.dp, "tp": world.tp}
    topology = {"world_size": world.size, "coordinator": 0, "mesh": mesh}
    request = SaveRequest(step=100)
    with paused_gc():
        assemble_s, manifest = timed(
            lambda: assemble(sid, request, hasher, metas, plan, reports, topology)
        )
    print(f"  assemble {assemble_s:.2f} s", flush=True)
    encode_s, data = timed(lambda: encoding.encode(manifest))
    decode_s, decoded = timed(lambda: encoding.decode(data))
    print(f"  manifest {len(data) / MiB:.1f} MiB, encode {encode_s:.2f} s, decode {decode_s:.2f} s")
    cached = _cached_save(metas, plan)
    written, expect = sum(plan.bytes_per_rank), expected_bytes(world, hasher)
    if written != expect:
        raise AssertionError(f"the plan writes {written} bytes, the state holds {expect}")
    return {
        "logical_tensors": len(decoded.tensor_keys),
        "shards": len(decoded.shard_kind),
        "objects": len(decoded.object_names),
        "chunks": len(decoded.chunk_object),
        "bytes_written": written,
        "bytes_expected": expect,
        "manifest_nbytes": int(decoded.nbytes),
        "plan_s": plan_s,
        "simulate_reports_s": simulate_s,
        "assemble_s": assemble_s,
        "encode_s": encode_s,
        "decode_s": decode_s,
        "manifest_bytes": len(data),
        "balance": _balance(plan, flats),
        **cached,
    }


def _cached_save(metas: list[RankMeta], plan: SavePlan) -> dict[str, Any]:
    """The next save of the same layout: what each rank sends (the pickled description, as
    the control plane sends it) in full and as a digest, and the coordinator's planning."""
    import pickle

    for m in metas:
        m.layout = layout_digest(m)
    cache = PlanCache(
        [m.layout for m in metas],
        metas,
        plan,
        [list(a.entries) for a in plan.assignments],
        list(plan.bytes_per_rank),
    )
    digests = [RankMeta(m.rank, m.step, [], m.values, layout=m.layout, cached=True) for m in metas]
    full_sizes = sorted(len(pickle.dumps(m)) for m in metas)
    sizes = sorted(len(pickle.dumps(m)) for m in digests)
    sid = commit.new_snapshot_id(101)
    cached_s, (again, kept) = timed(lambda: plan_cached(digests, sid, cache))
    if kept is not cache or again.problems:
        raise AssertionError("the cached plan was not reused")
    if [a.entries for a in again.assignments] != [a.entries for a in plan.assignments]:
        raise AssertionError("the cached plan assigns other writers")
    print(f"  cached plan {cached_s:.3f} s, {sizes[-1]} bytes sent per rank at most")
    return {
        "full_send_bytes_median": full_sizes[len(full_sizes) // 2],
        "full_ingest_bytes": sum(full_sizes),
        "cached_send_bytes_max": sizes[-1],
        "cached_ingest_bytes": sum(sizes),
        "cached_plan_s": cached_s,
    }


def run_sim(world: World) -> dict[str, Any]:
    """Build every rank's description, plan, simulate the writes, assemble, encode, decode."""
    hasher = Hasher()
    parameters = world.pp * world.params_per_stage
    print(
        f"planner simulation, {world.size} ranks (TP {world.tp} x PP {world.pp} x DP "
        f"{world.dp}), {parameters} parameters ...",
        flush=True,
    )
    gc.collect()
    build_s, (metas, flats) = timed(lambda: build_metas(world, hasher))
    meta_bytes = sum(len(blob) for meta in metas for _, blob in meta.groups)
    print(f"  built {world.size} metas in {build_s:.2f} s ({meta_bytes / MiB:.0f} MiB of blobs)")
    numel = sum(shape[0] * shape[1] for _, shape, _ in LAYER)
    return {
        "world": world.size,
        "tp": world.tp,
        "pp": world.pp,
        "dp": world.dp,
        "parameters": parameters // len(LAYER) * numel,
        "meta_blob_bytes": meta_bytes,
        "unique_blobs": len({blob for meta in metas for _, blob in meta.groups}),
        "build_metas_s": build_s,
        **_plan_and_assemble(world, hasher, metas, flats),
    }


def checks(sim: dict[str, Any]) -> list[Check]:
    """The targets: the plan's and the decode's seconds, the busiest writer's balance."""
    balance, ranks = sim["balance"], f"{sim['world']:,}-rank"
    return [
        Check(f"{ranks} plan_save (s)", sim["plan_s"], PLAN_TARGET),
        Check(f"{ranks} manifest decode (s)", sim["decode_s"], DECODE_TARGET),
        Check(
            f"writer balance: max / ({1 + BALANCE_SLACK:g} x mean + 1 shard)",
            balance["max"] / balance["bound"],
            Target("<=", 1.0),
        ),
        Check(f"{ranks} cached plan (s)", sim["cached_plan_s"], CACHED_PLAN_TARGET),
        Check("cached save: bytes sent per rank", sim["cached_send_bytes_max"], CACHED_SEND_TARGET),
        Check("cached save: coordinator ingest", sim["cached_ingest_bytes"], CACHED_INGEST_TARGET),
    ]


def _steps(sim: dict[str, Any], verdict: list[Check]) -> list[list[object]]:
    balance = sim["balance"]
    plan, decode, even, cached, send, ingest = verdict
    shown = f"<= {1 + BALANCE_SLACK:g} x mean + 1 shard = {balance['bound'] / MiB:.1f} MiB"
    return [
        [
            f"build {sim['world']:,} RankMetas (not planning)",
            f"{sim['build_metas_s']:.2f} s",
            "-",
            "-",
        ],
        ["plan_save", f"{sim['plan_s']:.2f} s", f"{PLAN_TARGET} s", plan.result],
        ["simulate write reports (not planning)", f"{sim['simulate_reports_s']:.2f} s", "-", "-"],
        ["assemble", f"{sim['assemble_s']:.2f} s", "-", "-"],
        ["encoding.encode", f"{sim['encode_s']:.2f} s", "-", "-"],
        ["manifest size", f"{sim['manifest_bytes'] / MiB:.1f} MiB", "-", "-"],
        ["encoding.decode", f"{sim['decode_s']:.2f} s", f"{DECODE_TARGET} s", decode.result],
        ["writer bytes: max / mean", f"{balance['max_over_mean']:.4f}", "-", "-"],
        [
            "writer bytes: (max - mean) / largest shard",
            f"{balance['excess_over_largest_shard']:.3f}",
            "-",
            "-",
        ],
        ["writer bytes: max", f"{balance['max'] / MiB:.1f} MiB", shown, even.result],
        [
            "writer bytes: mean, min",
            f"{balance['mean'] / MiB:.1f}, {balance['min'] / MiB:.1f} MiB",
            "-",
            "-",
        ],
        ["largest single shard", f"{balance['largest_shard'] / MiB:.1f} MiB", "-", "-"],
        [
            "first save: bytes sent per rank (median), ingest",
            f"{sim['full_send_bytes_median']:,} B, {sim['full_ingest_bytes'] / MiB:.1f} MiB",
            "-",
            "-",
        ],
        [
            "cached save: plan",
            f"{sim['cached_plan_s']:.3f} s",
            f"{CACHED_PLAN_TARGET} s",
            cached.result,
        ],
        [
            "cached save: bytes sent per rank (max)",
            f"{sim['cached_send_bytes_max']:,} B",
            f"{CACHED_SEND_TARGET} B",
            send.result,
        ],
        [
            "cached save: coordinator ingest",
            f"{sim['cached_ingest_bytes'] / MiB:.2f} MiB",
            "< 16 MiB",
            ingest.result,
        ],
    ]


def report_sim(
    sim: dict[str, Any], title: str = "planner simulation"
) -> tuple[list[str], list[Check]]:
    """The steps' table of a :func:`run_sim` record, and its checks."""
    verdict = checks(sim)
    lines = [
        f"== {title}, {sim['world']} ranks (TP {sim['tp']} x PP {sim['pp']} x DP {sim['dp']}), "
        f"{sim['parameters'] / 1e9:.1f} B parameters, {sim['logical_tensors']} logical tensors, "
        f"{sim['shards']} shards, {sim['objects']} objects, {sim['manifest_nbytes'] / 1e12:.2f} "
        f"TB; rank descriptions {sim['meta_blob_bytes'] / MiB:.0f} MiB of blobs, "
        f"{sim['unique_blobs']} distinct",
        format_table(["step", "value", "target", "result"], _steps(sim, verdict)),
    ]
    return lines, verdict


def main(argv: list[str] | None = None) -> int:
    arguments = cli.parser(__doc__, seed=False)
    defaults = World()
    for name in ("tp", "pp", "dp", "params_per_stage"):
        flag = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        arguments.add_argument(flag, type=int, default=default, help=f"default {default}")
    args = cli.parse(arguments, argv, SMOKE)
    machine = machine_info() | {"loadavg_start": load_average()}
    print(facts("machine", machine), flush=True)
    sim = run_sim(World(args.tp, args.pp, args.dp, args.params_per_stage))
    lines, verdict = report_sim(sim)
    lines = ["", *lines, "", "== targets", verdicts(verdict, digits=3)]
    emit({"machine": machine, "sim": sim, "checks": verdict}, "\n".join(lines), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
