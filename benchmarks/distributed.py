"""Distributed save and load: trainsnap against torch.distributed.checkpoint on real gloo ranks,
a 4 -> 2 rank reshard, and a planner simulation at 4,096 ranks.

Three parts, all in one default run:

1. **Sharded save/load.** 4 spawned processes (gloo, one intra-op thread each; a TCPStore
   rendezvous on loopback, as torchrun makes) on a (dp=2, tp=2) device mesh hold a DTensor
   state of ``--gib`` GiB (global, logical bytes): 2-D weights placed [Replicate(), Shard(0)],
   [Replicate(), Shard(1)] and [Shard(0), Shard(1)], fp32 and bf16, plus small 1-D tensors
   (norms, biases). Each rank builds only its local shards
   (values are a deterministic function of the global coordinates), never a full tensor. Each
   repetition saves with both methods into fresh directories, then loads both into zeroed
   destination DTensors, the order of methods alternating between repetitions; the page cache is
   evicted (``posix_fadvise(DONTNEED)`` on every file of the checkpoint) before each load. Every
   phase is timed on every rank between two barriers (rank 0 runs ``sync`` before them, so that
   no phase pays for earlier write-back) and the slowest rank's time is reported. ``--warmup``
   repetitions (default 1) run first and are not counted; the first repetition's loads are
   checked bit for bit.
2. **Reshard.** The last 4-rank checkpoints of part 1 are loaded on 2 ranks (mesh (2, 1): each
   rank holds the [Replicate(), Shard(d)] weights whole and half of the [Shard(0), Shard(1)]
   ones), alternating methods, evicted before each load, checked once.

   **The limit** of both loads (``raw`` in the output): in each repetition, among the loads (the
   methods take turns at going first, second and so on), the byte ranges of trainsnap's object
   files that this rank's ``ts.load`` reads (found with trainsnap's own load planner, merged,
   cut at 32 MiB) are read, evicted first, with
   ``preadv`` into one preallocated buffer on the same number of threads, with no checksums and
   no placement: what the disk and the page cache allow for the same bytes on the same ranks.
   Part 2 has a second limit, ``raw_direct``, where the file system takes ``O_DIRECT``: the same
   ranges, widened to whole pages, read past the page cache (trainsnap reads the column pieces it
   copies from bounce windows that way when they are not cached).
3. **Planner simulation** (no processes, no data): ``benchmarks.planner_sim``, 4,096 ranks.

Methods (``benchmarks._framework.adapters`` and ``.raw``):

- ``trainsnap``: ``trainsnap.save`` (checksums on, the default) / ``trainsnap.load``, every rank
  calling them with its part of the state.
- ``dcp``: ``torch.distributed.checkpoint.save`` with ``FileSystemWriter(thread_count=<io
  threads>, sync_files=True)`` / ``dcp.load`` with ``FileSystemReader``, on the default group.

<io threads> is trainsnap's ``io_threads`` tunable (``TRAINSNAP_IO_THREADS`` overrides it).

    python -m benchmarks.distributed                  # 1 GiB, 1 warm-up + 6 repetitions, all parts
    python -m benchmarks.distributed --gib 0.25 --reps 2 --json out.json
    python -m benchmarks.distributed --skip-io        # the planner simulation only
    python -m benchmarks.distributed --smoke          # tiny, 16 simulated ranks: does it run?

The ranks are spawned by ``trainsnap.testing.run_ranks``. Checkpoints live in a temporary
directory under ``--dir`` (default: the system's temporary directory), removed at the end.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import planner_sim
from benchmarks._framework import cli
from benchmarks._framework.adapters import Dcp, Trainsnap
from benchmarks._framework.method import (
    Measurements,
    Method,
    SaveLoadRound,
    State,
    rotated,
    timed,
)
from benchmarks._framework.raw import RawLimit, direct_io_works, trainsnap_read_ranges
from benchmarks._framework.report import Check, Ratio, Target, compare, emit, facts, verdicts
from benchmarks._framework.sharded_state import (
    Spec,
    build_state,
    check_state,
    describe_specs,
    local_nbytes,
    state_specs,
)
from benchmarks._framework.state import GiB, MiB, clear_state
from benchmarks._framework.system import (
    evict,
    load_average,
    machine_info,
    resident_fraction,
    scratch_root,
)
from trainsnap.testing import assert_all_ok, run_ranks

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")

# trainsnap time / DCP time, at most.
IO_TARGETS: dict[str, float] = {"save": 1.0, "load": 0.5, "reshard_load": 0.5}
RAW_DIRECT = "raw_direct"
"""The reshard's second limit: the same byte ranges read past the page cache (``O_DIRECT``)."""
SMOKE = {"gib": 0.01, "reps": 1, "warmup": 0, **planner_sim.SMOKE}


# == on each rank ==================================================================================


def _barrier_timer(operation: Callable[[], object]) -> float:
    """This rank's time for ``operation``, started together with every rank (barrier before)
    and followed by a barrier, so that phases never overlap. Rank 0 first flushes what earlier
    work left dirty (a removed checkpoint, directory entries), so that no phase pays for
    another's write-back."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        os.sync()
    dist.barrier()
    start = time.perf_counter()
    operation()
    seconds = time.perf_counter() - start
    dist.barrier()
    return seconds


def _evict_for_load(rank: int, directory: Path) -> float | None:
    """Rank 0 drops the checkpoint's files from the page cache (they are shared by all ranks of
    this machine) and returns the fraction of their pages still resident."""
    if rank != 0:
        return None
    evict(directory)
    return resident_fraction(directory)


def _mesh(dp: int, tp: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def _methods(rank: int, config: dict[str, Any], same_world: bool) -> list[Method]:
    ranges = functools.partial(trainsnap_read_ranges, rank=rank, same_world=same_world)
    threads = config["threads"]
    methods = [Trainsnap(), Dcp(threads, distributed=True), RawLimit(threads, ranges=ranges)]
    if not same_world and config["direct"]:
        methods.append(RawLimit(threads, ranges=ranges, direct=True, name=RAW_DIRECT))
    return methods


def _round(
    rank: int,
    source: State,
    destination: State,
    specs: list[Spec],
    mesh: Any,
    checked: dict[str, int],
    *,
    saves: bool = True,
) -> SaveLoadRound:
    """A repetition on this rank; only its first checks the loads (``checked`` keeps the bytes)."""

    def verify(method: Method) -> None:
        if method.verifiable and method.name not in checked:
            what = f"{method.name} load, rank {rank}"
            checked[method.name] = check_state(specs, destination, mesh, what)

    return SaveLoadRound(
        state=source,
        destination=destination,
        clear=clear_state,
        before_load=functools.partial(_evict_for_load, rank),
        verify=verify,
        timer=_barrier_timer,
        saves=saves,
    )


def _rank_record(
    rank: int, results: Measurements, local_bytes: int, checked: dict[str, int], raw: Method
) -> dict[str, Any]:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "rank": rank,
        "results": results,
        "local_bytes": local_bytes,
        "raw_bytes": getattr(raw, "last_bytes", 0),
        "checked_bytes": checked,
        "peak_rss": peak,
    }


def _rotate(methods: list[Method], repetition: int) -> list[Method]:
    """The methods rotated (the first timed repetition starts with trainsnap), the limit among
    them: its reads need only the repetition's trainsnap snapshot, which every save precedes.
    Each load takes each place in turn, so none always follows the same one (a DCP load leaves
    the most memory to reclaim behind it)."""
    return rotated(methods, repetition)


def _new_directories(root: Path, rank: int, repetition: int) -> dict[str, Path]:
    import torch.distributed as dist

    directories = {name: root / f"{name}-{repetition}" for name in ("trainsnap", "dcp")}
    if rank == 0:
        for directory in directories.values():
            directory.mkdir(parents=True)
    dist.barrier()
    return directories | {"raw": directories["trainsnap"]}


def _retire(directories: dict[str, Path], root: Path, last: bool) -> dict[str, tuple[int, int]]:
    """(files, bytes) of each checkpoint; the last repetition's are kept as ``<method>-last``
    for the reshard, the others removed."""
    disk = {}
    for name in ("trainsnap", "dcp"):
        files = [p for p in directories[name].rglob("*") if p.is_file()]
        disk[name] = (len(files), sum(p.stat().st_size for p in files))
        if last:
            directories[name].rename(root / f"{name}-last")
        else:
            shutil.rmtree(directories[name])
    return disk


def sharded_rank(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    """Part 1, on each of the 4 ranks: every repetition (warm-up ones first) saves with both
    methods, then loads both and the limit (evicted first); the first repetition's loads are
    checked."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    root, specs, mesh = Path(config["root"]), state_specs(config["gib"]), _mesh(2, 2)
    source = build_state(specs, mesh, fill=True)
    destination = build_state(specs, mesh, fill=False)
    methods, results = _methods(rank, config, True), Measurements()
    checked: dict[str, int] = {}
    disk: dict[str, tuple[int, int]] = {}
    repetitions = config["warmup"] + config["reps"]
    for repetition in range(repetitions):
        directories = _new_directories(root, rank, repetition)
        one = _round(rank, source, destination, specs, mesh, checked)
        one.run(_rotate(methods, repetition - config["warmup"]), directories, results)
        dist.barrier()
        if rank == 0:
            disk = _retire(directories, root, repetition == repetitions - 1)
        dist.barrier()
    record = _rank_record(rank, results, local_nbytes(source), checked, methods[2])
    return record | {"disk": disk}


def reshard_rank(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    """Part 2, on each of the 2 ranks (mesh (2, 1)): load the 4-rank checkpoints of part 1,
    rotating methods and the limit (warm-up repetitions first), evicted first; the first
    repetition's loads are checked."""
    warnings.filterwarnings("ignore")
    root, specs, mesh = Path(config["root"]), state_specs(config["gib"]), _mesh(2, 1)
    destination = build_state(specs, mesh, fill=False)
    methods, results = _methods(rank, config, False), Measurements()
    checked: dict[str, int] = {}
    directories = {name: root / f"{name}-last" for name in ("trainsnap", "dcp")}
    directories["raw"] = directories[RAW_DIRECT] = directories["trainsnap"]
    for repetition in range(config["warmup"] + config["reps"]):
        one = _round(rank, {}, destination, specs, mesh, checked, saves=False)
        one.run(_rotate(methods, repetition - config["warmup"]), directories, results)
    return _rank_record(rank, results, local_nbytes(destination), checked, methods[2])


# == in the parent =================================================================================


def _gather(per_rank: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """The slowest rank's values per phase, the warm-up repetitions apart."""
    slowest = Measurements.slowest([record["results"] for record in per_rank])
    warm, timed_results = slowest.split(warmup)
    return {"results": timed_results, "warmup": warm, "per_rank": per_rank}


def _print_repetitions(part: str, gathered: dict[str, Any], metrics: tuple[str, ...]) -> None:
    for label, results in (("warm-up", gathered["warmup"]), ("rep", gathered["results"])):
        for i, order in enumerate(results.orders):
            times = "  ".join(
                name + " " + "/".join(f"{results.series(name, m)[i]:.2f}" for m in metrics) + "s"
                for name in ("trainsnap", "dcp")
            )
            print(f"  {part} {label} {i + 1} [{' '.join(order[:2])}] {times}", flush=True)


def _run_part(
    function: Any, world_size: int, config: dict[str, Any], metrics: tuple[str, ...], part: str
) -> dict[str, Any]:
    how = f"{config['warmup']} warm-up + {config['reps']} timed repetitions"
    mesh = "(dp=2, tp=2)" if world_size == 4 else "(dp=2, tp=1)"
    print(f"{part}: {world_size} ranks, mesh {mesh}, {how} ...", flush=True)
    timeout = 900 + 900 * config["gib"] * (config["warmup"] + config["reps"])
    wall_s, ranks = timed(
        lambda: run_ranks(function, world_size, args=(config,), timeout=timeout, rendezvous="tcp")
    )
    gathered = _gather(assert_all_ok(ranks), config["warmup"]) | {"wall_s": wall_s}
    _print_repetitions(part, gathered, metrics)
    return gathered


def run_io(args: Any, threads: int) -> dict[str, Any]:
    specs = state_specs(args.gib)
    description = describe_specs(specs)
    print(facts("state", description))
    out: dict[str, Any] = {"state": description}
    with scratch_root(args.dir, description["bytes"] * 2.6, "trainsnap-dist-") as root:
        config = {"root": str(root), "gib": args.gib, "reps": args.reps}
        config |= {"warmup": args.warmup, "threads": threads}
        config["direct"] = out["direct"] = direct_io_works(root)
        out["sharded"] = _run_part(sharded_rank, 4, config, ("save", "load"), "part 1")
        if not args.skip_reshard:
            out["reshard"] = _run_part(reshard_rank, 2, config, ("load",), "part 2")
    return out


# == the report ====================================================================================


def _mib_list(values: list[int]) -> str:
    return "[" + ", ".join(f"{value / MiB:.0f}" for value in values) + "] MiB"


def _ratios(
    label: str, operations: tuple[str, ...], targets: tuple[str, ...], direct: bool = False
) -> list[Ratio]:
    """trainsnap/DCP of ``operations`` (each against the target of the same place in
    ``targets``), both loads against the raw reads of the same bytes, and with ``direct``
    trainsnap's against those reads past the page cache."""
    ratios = [
        Ratio(
            f"{label} {op}: trainsnap/DCP",
            ("trainsnap", op),
            ("dcp", op),
            Target("<=", IO_TARGETS[key]),
        )
        for op, key in zip(operations, targets, strict=True)
    ]
    ratios.append(
        Ratio(f"{label} load: trainsnap/raw reads", ("trainsnap", "load"), ("raw", "load"))
    )
    ratios.append(Ratio(f"{label} load: DCP/raw reads", ("dcp", "load"), ("raw", "load")))
    if direct:
        ratios.append(
            Ratio(
                f"{label} load: trainsnap/raw reads past the page cache",
                ("trainsnap", "load"),
                (RAW_DIRECT, "load"),
            )
        )
    return ratios


def _rank_lines(part: dict[str, Any], threads: int) -> list[str]:
    per_rank = part["per_rank"]
    checked = ", ".join(
        f"{m} {sum(r['checked_bytes'][m] for r in per_rank) / MiB:.0f} MiB"
        for m in ("trainsnap", "dcp")
    )
    peaks = [r["peak_rss"] for r in per_rank]
    resident = [x for m in part["results"].methods for x in part["results"].series(m, "resident")]
    resident = [x for x in resident if x == x]
    raw_bytes = _mib_list([r["raw_bytes"] for r in per_rank])
    lines = [
        f"raw: reads of the byte ranges each rank's trainsnap load reads (preadv, {threads} "
        f"threads, no checks, no placement; {raw_bytes} per rank)",
        f"local bytes per rank {_mib_list([r['local_bytes'] for r in per_rank])}; peak RSS per "
        f"rank {_mib_list(peaks)}, sum {sum(peaks) / GiB:.2f} GiB",
        f"checked bitwise (first repetition, all ranks): {checked}",
    ]
    if resident:
        lines.append(
            f"page-cache residency of the files when loads started: max {max(resident):.1%}"
        )
    return lines


def report_io(out: dict[str, Any]) -> tuple[list[str], list[Check]]:
    io, config = out["io"], out["config"]
    nbytes = io["state"]["bytes"]
    sharded = io["sharded"]
    disk = sharded["per_rank"][0]["disk"]
    comparison = compare(
        sharded["results"],
        nbytes=nbytes,
        metrics=("save", "load"),
        ratios=_ratios("sharded", ("save", "load"), ("save", "load")),
        columns={
            "files": {m: files for m, (files, _) in disk.items()},
            "MiB on disk": {m: size / MiB for m, (_, size) in disk.items()},
        },
        warmup=sharded["warmup"],
    )
    lines = [
        f"== part 1: sharded save/load, 4 ranks (dp=2, tp=2), state {nbytes / GiB:.3f} GiB "
        f"global ({io['state']['tensors']} tensors), {config['reps']} timed repetitions after "
        f"{config['warmup']} warm-up, io_threads={config['io_threads']}, page cache evicted "
        "before loads; time of the slowest rank per phase",
        *comparison.lines,
        *_rank_lines(sharded, config["io_threads"]),
    ]
    checks = comparison.checks
    if "reshard" in io:
        reshard = compare(
            io["reshard"]["results"],
            nbytes=nbytes,
            metrics=("load",),
            ratios=_ratios(
                "resharded", ("load",), ("reshard_load",), direct=io.get("direct", False)
            ),
            warmup=io["reshard"]["warmup"],
        )
        lines += [
            "",
            "== part 2: resharded load, the 4-rank (dp=2, tp=2) checkpoints of part 1 loaded on "
            "2 ranks (dp=2, tp=1)",
            *reshard.lines,
            *_rank_lines(io["reshard"], config["io_threads"]),
        ]
        checks = checks + reshard.checks
    return lines, checks


def report(out: dict[str, Any]) -> tuple[str, list[Check]]:
    lines: list[str] = [""]
    checks: list[Check] = []
    if "io" in out:
        io_lines, io_checks = report_io(out)
        lines += [*io_lines, ""]
        checks += io_checks
    if "sim" in out:
        sim_lines, sim_checks = planner_sim.report_sim(out["sim"], "part 3: planner simulation")
        lines += [*sim_lines, ""]
        checks += sim_checks
    lines += ["== targets", verdicts(checks, digits=3)]
    shown = "; ".join(f"{k} {v}" for k, v in out["loadavg"].items())
    lines.append(
        f"\nload average (1/5/15 min): {shown}; {os.cpu_count()} CPUs. A high value at the "
        "start means other work shared the machine (later values count this run's own "
        "ranks and I/O threads too)"
    )
    return "\n".join(lines), checks


def _validate(args: Any) -> str | None:
    if args.warmup < 0:
        return "--warmup must be at least 0"
    if args.skip_io and args.skip_sim:
        return "nothing to run: --skip-io and --skip-sim together"
    return None


def main(argv: list[str] | None = None) -> int:
    arguments = cli.parser(__doc__, reps=6, seed=False)
    arguments.add_argument(
        "--gib", type=float, default=1.0, help="global state size in GiB (default 1)"
    )
    arguments.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed repetitions first, both methods (default 1; 0 for none)",
    )
    arguments.add_argument("--skip-io", action="store_true", help="skip parts 1 and 2 (real ranks)")
    arguments.add_argument("--skip-reshard", action="store_true", help="skip part 2 (the reshard)")
    arguments.add_argument(
        "--skip-sim", action="store_true", help="skip part 3 (planner simulation)"
    )
    world = planner_sim.World()
    arguments.set_defaults(
        tp=world.tp, pp=world.pp, dp=world.dp, params_per_stage=world.params_per_stage
    )
    args = cli.parse(arguments, argv, SMOKE, _validate)
    machine = machine_info()
    print(facts("machine", machine), flush=True)
    config = {
        "gib": args.gib,
        "reps": args.reps,
        "warmup": args.warmup,
        "io_threads": machine["io_threads"],
    }
    out: dict[str, Any] = {
        "machine": machine,
        "config": config,
        "loadavg": {"start": load_average()},
    }
    if not args.skip_io:
        out["io"] = run_io(args, machine["io_threads"])
        out["loadavg"]["after parts 1-2"] = load_average()
    if not args.skip_sim:
        print("part 3: ", end="")
        out["sim"] = planner_sim.run_sim(
            planner_sim.World(args.tp, args.pp, args.dp, args.params_per_stage)
        )
        out["loadavg"]["after part 3"] = load_average()
    text, out["checks"] = report(out)
    emit(out, text, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
