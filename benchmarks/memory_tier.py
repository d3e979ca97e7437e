"""The memory tier: what a memory snapshot every step costs a training step, and how much faster
a restore from the nodes' memory is than one from the durable root on disk.

Two forms, each on the same state (``--mib`` MiB in all, from
``benchmarks._framework.state.make_state``, split by rows across the ranks as ``ts.Sharded``
shards):

- **2 nodes**: 2 spawned processes (gloo, ``trainsnap.testing.run_ranks``), each a simulated
  node with its own memory-tier directory (``ts.MemoryTier(root=<its directory>, node=<rank>)``,
  one copy of each node's objects on the other node: ``replicas=1``);
- **1 process**: one spawned process, no process group, one node (no partner).

Every process computes on one intra-op thread: on a machine whose cores other work shares, a
parallel copy or matmul waits for its slowest thread, and the figures would measure the
scheduler.

In each form, every rank:

1. **One memory copy** of its part of the state (``benchmarks._framework.state.OneCopy``, as
   every benchmark measures one copy: ``copy_`` of every tensor into preallocated tensors whose
   pages were touched before), timed 5 times; the median of the slowest rank is *the copy*.
2. **Steps.** A compute-bound step (``benchmarks._framework.compute.Compute``: fp32 matmuls)
   sized to ``--factor`` (default 25) times the copy. Each repetition runs ``--steps`` steps
   with no snapshot and ``--steps`` steps each followed by ``mgr.step(step, state)`` of a
   ``ts.CheckpointManager`` with ``memory=ts.MemoryTier(interval=Every(steps=1),
   wait_if_busy=True)`` (a memory snapshot every step; a step whose predecessor's replication is
   still in flight waits for it, so no snapshot is skipped), the order alternating between
   repetitions; the durable interval never fires. Reported per repetition: the median step
   time (compute plus ``mgr.step``) of the slowest rank, and the CPU seconds its process used
   per step (every thread: the tier's hashing, writing and copying included). The extra time
   of a snapshot is taken per repetition (its memory steps less its steps with no snapshot, so
   that a drift of the machine's load cancels), then the median over the repetitions. After
   one warm-up step (first save: the footprint check, the checkpoint-data group) every timed
   step's snapshot is counted.
3. **Restores.** The manager closed, the same state is also saved to a durable root on disk
   (``ts.save``, fsynced). Each repetition restores, in an alternating order, with a fresh
   manager: from memory (``CheckpointManager(root, memory=...).restore``: the newest memory
   snapshot, read from the node's own directory) and from the durable root on disk
   (``CheckpointManager(disk_root).restore``, the page cache evicted before, as
   ``benchmarks._framework.system.evict`` does). Each destination is zeroed before and checked
   bit for bit after (outside the timing). The disk's own limit is measured alongside: one
   cold sequential read of the durable root's files (no checks, no placement).

Targets (medians): the extra step time of a memory snapshot every step <= 1.2x one memory
copy, <= 5% of a step ``--factor`` times the copy, and a restore from memory >= 3x faster than
from the durable root on disk. With few cores the background work of the memory tier (hashing,
writing into the tmpfs, sending and receiving the partner's copies) competes with the compute
threads; the machine's other load is reported.

The memory-tier directories are created under ``/dev/shm`` when it has room, else under
``--dir``; the durable roots under ``--dir`` (default: the system's temporary directory). All
are removed at the end.

    python -m benchmarks.memory_tier                  # 256 MiB, 5 repetitions of 3 steps
    python -m benchmarks.memory_tier --mib 128 --reps 5 --json out.json
    python -m benchmarks.memory_tier --skip-single    # the 2-node form only
    python -m benchmarks.memory_tier --smoke          # tiny: does it run and verify?
"""

from __future__ import annotations

import math
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import trainsnap as ts
from benchmarks._framework import cli
from benchmarks._framework.compute import Compute
from benchmarks._framework.method import Measurements, median, rotated
from benchmarks._framework.report import Check, Target, emit, facts, format_table, verdicts
from benchmarks._framework.state import ONE_COPY, MiB, OneCopy, Tensors, describe_state, make_state
from benchmarks._framework.system import (
    contention,
    cpu_times,
    evict,
    iter_files,
    load_average,
    machine_info,
    percent,
    resident_fraction,
)
from trainsnap.testing import assert_all_ok, run_ranks

COPY_TARGET = Target("<=", 1.2)  # extra step time / one memory copy
STEP_TARGET = Target("<=", 5.0)  # extra step time, % of a step --factor times the copy
RESTORE_TARGET = Target(">=", 3.0)  # durable restore (cold, disk) / memory restore
SMOKE = {"mib": 8.0, "reps": 1, "steps": 2, "factor": 5.0}
NEVER = 10**9
"""A durable interval (steps) that never fires in a run."""
COPIES = 5
"""Timed memory copies per rank."""


# -- one rank --------------------------------------------------------------------------------------


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _slowest(world: int, value: float) -> float:
    """The largest of every rank's ``value`` (the rank itself when alone)."""
    if world == 1:
        return value
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def _sharded(part: Tensors, rank: int, world: int) -> dict[str, Any]:
    """This rank's part of the state as row shards of tensors ``world`` times as tall."""
    out: dict[str, Any] = {}
    for key, tensor in part.items():
        rows = tensor.shape[0]
        shape = (rows * world, *tensor.shape[1:])
        offsets = (rows * rank,) + (0,) * (tensor.dim() - 1)
        out[key] = ts.Sharded(tensor, global_shape=shape, offsets=offsets)
    return out


def _copy_seconds(part: Tensors, world: int) -> list[float]:
    """``COPIES`` timed copies of ``part`` into touched tensors, all ranks at once."""
    one = OneCopy(part)  # the destination allocated and touched
    times = []
    for _ in range(COPIES):
        _barrier(world)
        times.append(_slowest(world, one.seconds(part)))
    return times


def _disk_read_seconds(directory: str) -> float:
    """One cold sequential read of every file under ``directory`` (evicted first): the disk's
    own rate for the bytes a durable restore reads."""
    evict(directory)
    start = time.perf_counter()
    for path in iter_files(directory):
        with open(path, "rb", buffering=0) as f:
            while f.read(8 * MiB):
                pass
    return time.perf_counter() - start


def _manager(config: dict[str, Any], rank: int, *, memory: bool) -> ts.CheckpointManager:
    tier = None
    if memory:
        tier = ts.MemoryTier(
            root=os.path.join(config["memory_root"], f"node-dir-{rank}"),
            node=rank,
            interval=ts.Every(steps=1),
            wait_if_busy=True,
            allow_fewer_copies=True,  # the 1-process run: one node, one copy
        )
    root = config["durable"] if memory else config["disk"]
    options = ts.ManagerOptions(timeout=config["timeout"], preemption_signals=())
    return ts.CheckpointManager(root, interval=ts.Every(steps=NEVER), memory=tier, options=options)


def _steps(
    compute: Compute, world: int, count: int, snapshot: Callable[[int], None] | None, first: int
) -> tuple[list[float], list[float], list[float]]:
    """``count`` steps (compute, then ``snapshot(step)`` if any): each step's time, the time
    ``snapshot`` blocked it and the CPU seconds of the process during it (slowest rank)."""
    times, blocked, cpu = [], [], []
    for step in range(first, first + count):
        _barrier(world)
        start, start_cpu = time.perf_counter(), _cpu_seconds()
        compute.step()
        middle = time.perf_counter()
        if snapshot is not None:
            snapshot(step)
        end = time.perf_counter()
        times.append(_slowest(world, end - start))
        blocked.append(_slowest(world, end - middle))
        cpu.append(_slowest(world, _cpu_seconds() - start_cpu))
    return times, blocked, cpu


def _cpu_seconds() -> float:
    """CPU seconds this process used so far, every thread (the memory tier's background work
    included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _time_steps(
    config: dict[str, Any], rank: int, world: int, state: dict[str, Any], copy_s: float
) -> dict[str, Any]:
    """Part 2 (module docstring): per repetition, median step times with and without a memory
    snapshot every step."""
    compute = Compute(size=config["matmul"], target_s=config["factor"] * copy_s)
    alone = median([compute.timed_step() for _ in range(3)])
    mgr = _manager(config, rank, memory=True)
    results = Measurements()
    step = 1
    try:
        mgr.step(step, state)  # warm-up: footprint check, checkpoint-data group, pools
        mgr.wait()
        step += 1
        for rep in range(config["reps"]):
            order = rotated(["none", "memory"], rep)
            results.orders.append(order)
            for kind in order:
                snapshot = (lambda s: mgr.step(s, state)) if kind == "memory" else None
                times, blocked, cpu = _steps(compute, world, config["steps"], snapshot, step)
                step += config["steps"]
                mgr.wait()  # nothing of this part drains into the next one
                _barrier(world)
                results.add(kind, "step", median(times))
                results.add(kind, "blocked", median(blocked))
                results.add(kind, "cpu", median(cpu))
        assert mgr.memory is not None
        counts = {"saved": mgr.memory.saved, "skipped": mgr.memory.skipped}
    finally:
        mgr.close()
    return {
        "results": results,
        "compute": compute.describe() | {"step_alone_s": alone},
        "last_step": step - 1,
        **counts,
    }


def _restore_once(
    config: dict[str, Any], rank: int, world: int, kind: str, state: dict[str, Any]
) -> tuple[float, float | None, dict[str, int]]:
    """One restore into a zeroed destination, checked bit for bit: seconds (slowest rank), the
    durable root's resident fraction before it, where the bytes came from."""
    destination = _sharded({k: torch.zeros_like(v.local) for k, v in state.items()}, rank, world)
    resident = None
    if kind == "durable":
        if rank == 0:
            evict(config["disk"])
            resident = resident_fraction(config["disk"])
        _barrier(world)
    mgr = _manager(config, rank, memory=kind == "memory")
    try:
        _barrier(world)
        start = time.perf_counter()
        info = mgr.restore(destination)
        seconds = _slowest(world, time.perf_counter() - start)
    finally:
        mgr.close()
    if info is None:
        raise AssertionError(f"rank {rank}: nothing to restore from {kind}")
    wrong = [k for k, v in state.items() if not torch.equal(destination[k].local, v.local)]
    if wrong:
        raise AssertionError(f"rank {rank}: the restore from {kind} differs at {wrong[:3]}")
    return seconds, resident, dict(info.sources)


def _time_restores(
    config: dict[str, Any], rank: int, world: int, state: dict[str, Any], step: int
) -> dict[str, Any]:
    """Part 3 (module docstring)."""
    ts.save(state, config["disk"], step=step, timeout=config["timeout"], no_dist=world == 1)
    results = Measurements()
    resident: list[float | None] = []
    sources: dict[str, dict[str, int]] = {}
    for rep in range(config["reps"]):
        order = rotated(["memory", "durable"], rep)
        results.orders.append(order)
        for kind in order:
            seconds, fraction, sources[kind] = _restore_once(config, rank, world, kind, state)
            results.add(kind, "restore", seconds)
            if kind == "durable":
                resident.append(fraction)
    read_s = _disk_read_seconds(config["disk"]) if rank == 0 else math.nan
    disk_bytes = sum(p.stat().st_size for p in iter_files(config["disk"]))
    return {
        "results": results,
        "resident": resident,
        "sources": sources,
        "disk_read_s": read_s,
        "disk_bytes": disk_bytes,
    }


def _node(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    """Everything one rank measures (module docstring)."""
    torch.set_num_threads(config["threads"])
    part = make_state(config["mib"] / 1024 / world, small_tensors=64, seed=config["seed"] + rank)
    state = _sharded(part, rank, world)
    copies = _copy_seconds(part, world)
    start, started = cpu_times(), time.perf_counter()
    steps = _time_steps(config, rank, world, state, median(copies))
    restores = _time_restores(config, rank, world, state, steps["last_step"] + 1)
    used = contention(start, time.perf_counter() - started)
    return {"copy_s": copies, "steps": steps, "restores": restores, "contention": used}


# -- the run ---------------------------------------------------------------------------------------


def _memory_base(where: str | None, need: float) -> Path:
    """/dev/shm when it has room for ``need`` bytes, else ``where`` (or the temporary
    directory)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > need:
        return shm
    return Path(where) if where else Path(tempfile.gettempdir())


def run_form(name: str, world: int, args: Any, base: Path, memory_base: Path) -> dict[str, Any]:
    """One form (2 nodes or 1 process): every rank's :func:`_node`, and its summary."""
    memory_root = Path(tempfile.mkdtemp(prefix=f"trainsnap-memory-{world}-", dir=memory_base))
    work = Path(tempfile.mkdtemp(prefix=f"trainsnap-memory-bench-{world}-", dir=base))
    config = {
        "mib": args.mib,
        "seed": args.seed,
        "reps": args.reps,
        "steps": args.steps,
        "factor": args.factor,
        "matmul": 256 if args.smoke else 512,
        "threads": 1,
        "memory_root": str(memory_root),
        "durable": str(work / "durable"),
        "disk": str(work / "disk"),
        "timeout": 300.0,
    }
    print(f"form {name}: {world} rank(s), memory tier under {memory_root}", flush=True)
    try:
        init = {"init_pg": False} if world == 1 else {"rendezvous": "tcp"}
        results = run_ranks(_node, world, args=(config,), timeout=900, **init)
        per_rank = assert_all_ok(results)
    finally:
        shutil.rmtree(memory_root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return summarize(name, world, config, per_rank)


def summarize(
    name: str, world: int, config: dict[str, Any], per_rank: list[dict[str, Any]]
) -> dict[str, Any]:
    """The medians of one form (every timing is already the slowest rank's)."""
    first = per_rank[0]
    steps: Measurements = first["steps"]["results"]
    restores: Measurements = first["restores"]["results"]
    copy_s = median(first["copy_s"])
    none_s, memory_s = steps.median("none", "step"), steps.median("memory", "step")
    # Per repetition, its memory steps against its own steps with no snapshot (a drift of the
    # machine's load between repetitions cancels), then the median over the repetitions.
    pairs = zip(steps.series("memory", "step"), steps.series("none", "step"), strict=True)
    extra = median([with_snapshot - without for with_snapshot, without in pairs])
    cpu_pairs = zip(steps.series("memory", "cpu"), steps.series("none", "cpu"), strict=True)
    extra_cpu = median([with_snapshot - without for with_snapshot, without in cpu_pairs])
    restores_info = first["restores"]
    memory_restore = restores.median("memory", "restore")
    durable_restore = restores.median("durable", "restore")
    return {
        "name": name,
        "world": world,
        "threads": config["threads"],
        "copy_s": copy_s,
        "copies_s": first["copy_s"],
        "step_none_s": none_s,
        "step_memory_s": memory_s,
        "blocked_s": steps.median("memory", "blocked"),
        "extra_s": extra,
        "extra_cpu_s": extra_cpu,
        "extra_cpu_over_copy": extra_cpu / copy_s,
        "disk_read_s": restores_info["disk_read_s"],
        "disk_bytes": restores_info["disk_bytes"],
        "extra_over_copy": extra / copy_s,
        "extra_percent_of_step": 100 * extra / (config["factor"] * copy_s),
        "step_over_copy": none_s / copy_s,
        "restore_memory_s": memory_restore,
        "restore_durable_s": durable_restore,
        "restore_ratio": durable_restore / memory_restore,
        "resident": [f for f in first["restores"]["resident"] if f is not None],
        "sources": [rank["restores"]["sources"] for rank in per_rank],
        "saved": [rank["steps"]["saved"] for rank in per_rank],
        "skipped": [rank["steps"]["skipped"] for rank in per_rank],
        "compute": first["steps"]["compute"],
        "steps": steps,
        "restores": restores,
        "contention": [rank["contention"] for rank in per_rank],
    }


def run(args: Any) -> dict[str, Any]:
    nbytes = args.mib * MiB
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    memory_base = _memory_base(args.dir, nbytes * 2 * 3 * 1.5)  # own + copy, keep 2 + 1
    machine = machine_info() | {"loadavg_start": load_average()}
    description = describe_state(make_state(args.mib / 1024, small_tensors=64, seed=args.seed))
    print(facts("machine", machine))
    print(facts("state (all ranks' parts together)", {"mib": args.mib}))
    forms = [("2 nodes", 2)] + ([] if args.skip_single else [("1 process", 1)])
    out: dict[str, Any] = {"forms": []}
    for name, world in forms:
        out["forms"].append(run_form(name, world, args, base, memory_base))
    machine["loadavg_end"] = load_average()
    config = {
        "mib": args.mib,
        "reps": args.reps,
        "steps": args.steps,
        "factor": args.factor,
        "seed": args.seed,
        "memory_base": str(memory_base),
    }
    return out | {"machine": machine, "config": config, "state_one_rank_form": description}


# -- the report ------------------------------------------------------------------------------------


def form_checks(form: dict[str, Any], factor: float) -> list[Check]:
    label = form["name"]
    return [
        Check(f"{label}: extra step time / one memory copy", form["extra_over_copy"], COPY_TARGET),
        Check(
            f"{label}: extra step time, % of a step {factor:g}x the copy",
            form["extra_percent_of_step"],
            STEP_TARGET,
        ),
        Check(
            f"{label}: restore durable (disk, cold) / memory",
            form["restore_ratio"],
            RESTORE_TARGET,
        ),
    ]


def _form_lines(form: dict[str, Any], factor: float) -> list[str]:
    ms = 1e3
    steps: Measurements = form["steps"]
    restores: Measurements = form["restores"]
    rows = [
        ["one memory copy of a rank's part", ms * form["copy_s"], "median of 5, slowest rank"],
        ["step, no snapshot", ms * form["step_none_s"], f"{form['step_over_copy']:.1f}x the copy"],
        ["step, memory snapshot every step", ms * form["step_memory_s"], ""],
        ["  of which mgr.step blocked", ms * form["blocked_s"], ""],
        ["extra per step", ms * form["extra_s"], "median over repetitions of memory - none"],
        [
            "extra CPU per step (a rank's process)",
            ms * form["extra_cpu_s"],
            f"{form['extra_cpu_over_copy']:.1f}x the copy: the tier's background work",
        ],
        ["restore from memory", ms * form["restore_memory_s"], "own node's directory"],
        [
            "restore from the durable root (disk)",
            ms * form["restore_durable_s"],
            f"cold: resident before {', '.join(percent(f) for f in form['resident']) or 'n/a'}",
        ],
        [
            "the disk's cold read of the same files",
            ms * form["disk_read_s"],
            f"{form['disk_bytes'] / MiB:.0f} MiB, one thread, no checks: the disk's limit",
        ],
    ]
    per_rep = "; ".join(
        f"{kind} " + " ".join(f"{ms * v:.0f}" for v in steps.series(kind, "step"))
        for kind in ("none", "memory")
    )
    restore_reps = "; ".join(
        f"{kind} " + " ".join(f"{ms * v:.0f}" for v in restores.series(kind, "restore"))
        for kind in ("memory", "durable")
    )
    compute = form["compute"]
    return [
        "",
        f"== {form['name']} ({form['world']} rank(s), {form['threads']} intra-op thread(s) "
        f"each; compute step: {compute['matmuls_per_step']} x matmul {compute['matmul_n']}^2)",
        format_table(["figure", "ms (median)", "note"], rows, digits=1),
        f"  per repetition (median step ms): {per_rep}",
        f"  restores (ms): {restore_reps}",
        f"  memory snapshots saved per rank {form['saved']}, skipped {form['skipped']}; "
        f"restore sources per rank: {form['sources']}",
        "",
        verdicts(form_checks(form, factor)),
    ]


def report(out: dict[str, Any]) -> tuple[str, list[Check]]:
    factor = out["config"]["factor"]
    machine = out["machine"]
    lines = [
        "",
        f"state {out['config']['mib']:g} MiB in all (split across the ranks), "
        f"{out['config']['reps']} repetitions of {out['config']['steps']} steps, step = "
        f"{factor:g}x one memory copy; memory tier under {out['config']['memory_base']}; "
        f"load average at start {machine['loadavg_start']}, at end {machine['loadavg_end']}",
        ONE_COPY,
    ]
    checks: list[Check] = []
    for form in out["forms"]:
        lines += _form_lines(form, factor)
        checks += form_checks(form, factor)
    return "\n".join(lines), checks


def main(argv: list[str] | None = None) -> int:
    arguments = cli.parser(__doc__, reps=5)
    arguments.add_argument("--mib", type=float, default=256.0, help="state size (default 256)")
    arguments.add_argument(
        "--steps", type=int, default=3, help="steps per repetition and case (default 3)"
    )
    arguments.add_argument(
        "--factor", type=float, default=25.0, help="compute step / one memory copy (default 25)"
    )
    arguments.add_argument("--skip-single", action="store_true", help="the 2-node form only")

    def validate(args: Any) -> str | None:
        if args.steps < 1 or args.mib <= 0 or args.factor <= 0 or not math.isfinite(args.factor):
            return "--steps must be >= 1, --mib and --factor positive"
        return None

    args = cli.parse(arguments, argv, SMOKE, validate)
    os.environ.setdefault("TRAINSNAP_HEARTBEAT_SECONDS", "10")
    out = run(args)
    text, checks = report(out)
    out["checks"] = [{"label": c.label, "value": c.value, "result": c.result} for c in checks]
    emit(out, text, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
