"""Asynchronous saves: how long the caller is blocked, and what the background drain costs.

Two parts, one process, CPU tensors:

1. **Pause.** On a state of ``--gib`` GiB (fp32 and bf16 tensors of mixed sizes, from
   ``benchmarks._framework.state.make_state``; with ``--tensors N``, N equal fp32 tensors),
   each repetition measures, in an order rotating
   from one repetition to the next:

   - ``memcpy``: one copy as every benchmark measures it (``benchmarks._framework.state.
     OneCopy``: ``dst.copy_(src)`` of every tensor into preallocated tensors of the same shapes
     whose pages were touched before): the limit of any staging copy.
   - ``np.copyto``: one ``np.copyto`` of a single buffer of the same total size into another
     (both touched): a second reference, one call, one thread.
   - ``trainsnap``: ``trainsnap.async_save(..., saver=<a dedicated AsyncSaver>)``:
     its pause (``handle.pause``) and the wall time of the call; its phases (capture, plan,
     stage) come from ``trainsnap.trace``.
   - ``dcp ...``: ``torch.distributed.checkpoint.async_save`` with ``FileSystemWriter(thread_
     count=<io threads>, sync_files=True)``, single process (``no_dist``, no process group): its
     pause is the time until ``async_save`` returns. Besides the default (the writer stages into
     freshly allocated memory at every save) the staging options this torch offers on CPU are
     tried: a reused ``DefaultStager`` (staging buffers cached across saves) and a
     ``DefaultStager`` staging on a background thread (``async_save`` returns at once; its pause
     here is the time until ``staging_completion``: the state may not change before). The
     writer's own ``cache_staged_state_dict=True`` pins memory, which needs an accelerator: it is
     listed as unavailable when it fails.

   Every save goes into a fresh directory and is waited for (and the directory removed) outside
   the timed region, so no save drains during another measurement. One warm-up save per method
   comes first (the pools of trainsnap and of the reused DCP stagers are then warm); after it the
   saved tensor with the most bytes is overwritten while the save drains, and the snapshot is
   loaded back and checked bit for bit against the state as it was at the save (outside the
   timing).

2. **Slowdown while draining.** A compute-bound loop (1024x1024 fp32 matmuls, torch's default
   intra-op threads, ~30-50 ms a step) is timed step by step around asynchronous trainsnap saves
   of the state: ``--around`` steps with no save, the save, steps until it is committed (while it
   drains), ``--around`` steps with no save again; with the default ``io_threads`` and with
   ``io_threads=2``, alternating. Each save's slowdown is taken against the steps just around it
   (so that a slow drift of the machine's load cancels); reported are the medians over the saves,
   the drain's duration and the compute time lost to it. With few cores the background hashing
   and writing compete with the compute threads.

The machine's other load is reported (load averages; from ``/proc``, the CPU time other processes
used during each part): on a shared machine it can dominate the timings.

<io threads> is trainsnap's ``io_threads`` tunable (``TRAINSNAP_IO_THREADS`` overrides it).

    python -m benchmarks.async_pause                  # 1 GiB, 5 repetitions
    python -m benchmarks.async_pause --gib 0.25 --reps 3 --json out.json
    python -m benchmarks.async_pause --skip-dcp --profile 25
    python -m benchmarks.async_pause --tensors 64 --skip-drain   # 1 GiB of 64 tensors
    python -m benchmarks.async_pause --smoke          # tiny: does it run and verify?

Snapshots live in a temporary directory under ``--dir`` (default: the system's temporary
directory), removed at the end.
"""

from __future__ import annotations

import cProfile
import dataclasses
import gc
import inspect
import io
import math
import pstats
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks._framework import cli
from benchmarks._framework.adapters import Dcp, Trainsnap
from benchmarks._framework.compute import Compute, Drain, save_while_computing, summarize
from benchmarks._framework.method import (
    Measurements,
    Method,
    measure_save,
    median,
    rotated,
    set_up,
)
from benchmarks._framework.report import (
    Check,
    Column,
    Ratio,
    Target,
    compare,
    emit,
    facts,
    orders_line,
    records_table,
)
from benchmarks._framework.state import (
    ONE_COPY,
    GiB,
    OneCopy,
    Tensors,
    check_bitwise_equal,
    clear_state,
    describe_state,
    equal_state,
    make_state,
    state_nbytes,
)
from benchmarks._framework.system import (
    contention,
    cpu_times,
    describe_contention,
    fresh_dir,
    load_average,
    machine_info,
    scratch_root,
)
from trainsnap import trace, tunables

PAUSE_TARGET = Target("<=", 1.3)  # trainsnap pause / the memcpy limit
DCP_TARGET = Target(">=", 2.0)  # DCP pause / trainsnap pause
SMOKE = {"gib": 0.005, "reps": 1, "around": 1}


# -- the references --------------------------------------------------------------------------------


def flat_like_state(state: Tensors, align: int = 64) -> tuple[torch.Tensor, Tensors]:
    """One touched byte buffer holding views of the shapes and dtypes of ``state``."""
    offsets, position = [], 0
    for tensor in state.values():
        offsets.append(position)
        position += -(-tensor.nbytes // align) * align
    flat = torch.zeros(position, dtype=torch.uint8)
    views = {
        key: flat[offset : offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        for (key, tensor), offset in zip(state.items(), offsets, strict=True)
    }
    return flat, views


class Memcpy(Method):
    """One copy (``OneCopy``: ``copy_`` of every tensor into preallocated, touched tensors):
    the staging limit."""

    name = label = "memcpy"
    can_load = False

    def __init__(self, state: Tensors) -> None:
        self.one = OneCopy(state)

    def save(self, state: Tensors, directory: Path) -> None:
        self.one.copy(state)


class BigCopy(Method):
    """One ``np.copyto`` of a single buffer of the state's size into another."""

    name = label = "np.copyto"
    can_load = False

    def __init__(self, nbytes: int) -> None:
        self.source = np.ones(nbytes, dtype=np.uint8)
        self.destination = np.zeros(nbytes, dtype=np.uint8)

    def save(self, state: Tensors, directory: Path) -> None:
        np.copyto(self.destination, self.source)


# name, StagingOptions of a reused DefaultStager (None: no stager), FileSystemWriter options, label
DCP_VARIANTS: tuple[tuple[str, tuple[bool, ...] | None, dict[str, Any], str], ...] = (
    ("dcp", None, {}, "dcp (default: the FileSystemWriter stages into fresh memory at each save)"),
    (
        "dcp-reused",
        (False, False, False, False),
        {},
        "dcp (async_stager=DefaultStager(no pinning/sharing/background), reused: staging "
        "buffers cached across saves)",
    ),
    (
        "dcp-background",
        (False, False, True, False),
        {},
        "dcp (async_stager=DefaultStager(use_async_staging=True), reused: staged on a thread; "
        "pause = until staging_completion)",
    ),
    (
        "dcp-cached-writer",
        None,
        {"cache_staged_state_dict": True},
        "dcp (FileSystemWriter(cache_staged_state_dict=True): pinned cached staging)",
    ),
)


def dcp_variants(threads: int) -> list[Dcp]:
    """DCP's default, then the CPU staging options this torch has (tried at warm-up)."""
    import torch.distributed.checkpoint as dcp

    has_stagers = "async_stager" in inspect.signature(dcp.async_save).parameters
    variants = []
    for name, staging, writer_options, label in DCP_VARIANTS:
        if staging is not None and not has_stagers:
            continue
        stager = None
        if staging is not None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            stager = DefaultStager(StagingOptions(*staging))
        variants.append(
            Dcp(
                threads,
                name=name,
                label=label,
                asynchronous=True,
                stager=stager,
                writer_options=writer_options,
            )
        )
    return variants


# -- part 1: the pause -----------------------------------------------------------------------------


def warm_and_check(method: Method, state: Tensors, destination: Tensors, root: Path) -> None:
    """The warm-up save of ``method``; while it drains, the largest tensor is overwritten; the
    snapshot must hold the state as it was at the save."""
    key = max(state, key=lambda name: state[name].nbytes)
    keep = state[key].clone()
    with fresh_dir(root, f"{method.name}-warm-") as directory:
        measure_save(method, state, directory, while_draining=lambda: state[key].fill_(-7.0))
        state[key].copy_(keep)
        clear_state(destination)
        method.load(destination, directory)
    what = f"{method.name} (warm-up save, state changed while draining)"
    check_bitwise_equal(state, destination, what)


def warm_up(
    candidates: list[Method], state: Tensors, destination: Tensors, root: Path
) -> dict[str, str]:
    """Warm up and check every candidate; returns the unavailable ones' reasons (only optional
    DCP stagers may be unavailable)."""
    unavailable: dict[str, str] = {}
    for method in candidates:
        gc.collect()
        try:
            warm_and_check(method, state, destination, root)
        except Exception as error:
            if method.name in ("trainsnap", "dcp"):
                raise
            first_line = str(error).splitlines()[0][:160] if str(error) else ""
            unavailable[method.name] = f"{type(error).__name__}: {first_line}"
            print(f"  {method.name}: unavailable ({unavailable[method.name]})", flush=True)
            continue
        print(f"  warm-up {method.name}: saved, changed while draining, loaded, verified")
    return unavailable


def repeat_pauses(methods: list[Method], state: Tensors, root: Path, reps: int) -> Measurements:
    results = Measurements()
    for method in methods:
        results.values[method.name] = {}
    for repetition in range(reps):
        order = rotated(methods, repetition)
        results.orders.append([method.name for method in order])
        for method in order:
            with fresh_dir(root, f"{method.name}-") as directory:
                gc.collect()
                results.add_all(method.name, measure_save(method, state, directory))
        print(
            f"rep {repetition + 1}/{reps} [{' '.join(results.orders[-1])}] "
            + "  ".join(f"{m.name} {results.series(m.name, 'pause')[-1]:.3f}s" for m in methods)
            + "  (pause)",
            flush=True,
        )
    return results


def measure_pause(state: Tensors, root: Path, trainsnap: Trainsnap, args: Any) -> dict[str, Any]:
    flat, destination = flat_like_state(state)
    references: list[Method] = [Memcpy(state), BigCopy(state_nbytes(state))]
    dcps: list[Method] = [] if args.skip_dcp else list(dcp_variants(tunables.get().io_threads))
    with set_up(dcps):
        unavailable = warm_up([trainsnap, *dcps], state, destination, root)
        for reference in references:
            reference.save(state, root)  # warm-up of the references
        available = [m for m in dcps if m.name not in unavailable]
        results = repeat_pauses([*references, trainsnap, *available], state, root, args.reps)
    del flat, destination
    labels = {m.name: m.label for m in available}
    return {"results": results, "labels": labels, "dcp_unavailable": unavailable}


def pause_ratios(results: Measurements) -> list[Ratio]:
    pause = ("trainsnap", "pause")
    ratios = [
        Ratio("trainsnap pause / memcpy limit", pause, ("memcpy", "pause"), PAUSE_TARGET),
        Ratio("trainsnap call / memcpy limit", ("trainsnap", "call"), ("memcpy", "pause")),
        Ratio("trainsnap pause / np.copyto", pause, ("np.copyto", "pause")),
    ]
    dcps = [name for name in results.methods if name.startswith("dcp")]
    if dcps:
        best = min(dcps, key=lambda name: results.median(name, "pause"))
        label = f"{best} (best dcp) pause / trainsnap pause"
        ratios.append(
            Ratio("dcp (default) pause / trainsnap pause", ("dcp", "pause"), pause, DCP_TARGET)
        )
        ratios.append(Ratio(label, (best, "pause"), pause, DCP_TARGET))
    return ratios


# -- part 2: slowdown while draining ---------------------------------------------------------------


@contextmanager
def io_threads(count: int) -> Iterator[None]:
    """trainsnap's ``io_threads`` tunable set to ``count`` inside the block."""
    previous = tunables.get()
    tunables.set_for_testing(dataclasses.replace(previous, io_threads=count))
    try:
        yield
    finally:
        tunables.set_for_testing(previous)


def measure_drain(state: Tensors, root: Path, trainsnap: Trainsnap, args: Any) -> dict[str, Any]:
    compute = Compute()
    default = tunables.get().io_threads
    modes = [(f"io_threads={default}", default)] + ([("io_threads=2", 2)] if default != 2 else [])
    drains: dict[str, list[Drain]] = {name: [] for name, _ in modes}
    orders = []
    for repetition in range(args.reps):
        order = rotated(modes, repetition)
        orders.append([name for name, _ in order])
        for name, count in order:
            gc.collect()
            with fresh_dir(root, "drain-") as directory, io_threads(count):
                drain = save_while_computing(compute, trainsnap, state, directory, args.around)
                drains[name].append(drain)
        print(
            f"drain rep {repetition + 1}/{args.reps} "
            + "  ".join(
                f"{n}: {1e3 * ds[-1].base:.1f} -> {1e3 * median(ds[-1].steps):.1f} ms/step, "
                f"drain {ds[-1].drain:.2f}s"
                for n, ds in drains.items()
            )
            + "  (no save -> draining)",
            flush=True,
        )
    base = [x for ds in drains.values() for drain in ds for x in drain.before + drain.after]
    step = compute.describe() | {"steps_around_each_save": args.around}
    return {
        "step": step,
        "no_save": {"step_s": base, "step_median_s": median(base)},
        "orders": orders,
        "cases": {
            name: summarize(ds) | {"io_threads": count}
            for (name, count), ds in zip(modes, drains.values(), strict=True)
        },
    }


# -- profile ---------------------------------------------------------------------------------------


def profile_pause(state: Tensors, root: Path, trainsnap: Trainsnap, top: int) -> str:
    """cProfile of one warm ``ts.async_save(...)`` call (the pause only)."""
    with fresh_dir(root, "profile-") as directory:
        gc.collect()
        profiler = cProfile.Profile()
        profiler.enable()
        pending = trainsnap.save(state, directory)
        profiler.disable()
        assert pending is not None
        pending.wait()
    buffer = io.StringIO()
    stats = pstats.Stats(profiler, stream=buffer).strip_dirs()
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return (
        f"cProfile of one warm ts.async_save(...) call (pause under the profiler: "
        f"{pending.pause:.3f}s; the profiler inflates Python-heavy code):\n{buffer.getvalue()}"
    )


# -- the run ---------------------------------------------------------------------------------------


def run_parts(state: Tensors, root: Path, args: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"drain": None, "profile": None}
    trainsnap = Trainsnap(asynchronous=True)
    with set_up([trainsnap]):
        print("part 1: pause", flush=True)
        start, started = cpu_times(), time.perf_counter()
        out["pause"] = measure_pause(state, root, trainsnap, args)
        out["pause"]["contention"] = contention(start, time.perf_counter() - started)
        if not args.skip_drain:
            print("part 2: slowdown while draining", flush=True)
            start, started = cpu_times(), time.perf_counter()
            out["drain"] = measure_drain(state, root, trainsnap, args)
            out["drain"]["contention"] = contention(start, time.perf_counter() - started)
        if args.profile:
            out["profile"] = profile_pause(state, root, trainsnap, args.profile)
    return out


def run(args: Any) -> dict[str, Any]:
    print(f"making the state ({args.gib} GiB, seed {args.seed}) ...", flush=True)
    if args.tensors:
        state = equal_state(args.gib, args.tensors, seed=args.seed)
    else:
        state = make_state(args.gib, seed=args.seed)
    machine = machine_info() | {"loadavg_start": load_average()}
    description = describe_state(state)
    print(facts("machine", machine))
    print(facts("state", description))
    start, started = cpu_times(), time.perf_counter()
    was_tracing = trace.enabled()
    trace.enable()
    try:
        with scratch_root(args.dir, state_nbytes(state) * 2.5, "trainsnap-async-") as root:
            out = run_parts(state, root, args)
    finally:
        if not was_tracing:
            trace.disable()
    machine["loadavg_end"] = load_average()
    machine["contention"] = contention(start, time.perf_counter() - started)
    config = {"gib": args.gib, "reps": args.reps, "seed": args.seed, "skip_dcp": args.skip_dcp}
    config["tensors"] = args.tensors
    config["io_threads"] = machine["io_threads"]
    return out | {"machine": machine, "config": config, "state": description}


# -- the report ------------------------------------------------------------------------------------


def _header(out: dict[str, Any]) -> list[str]:
    nbytes, machine = out["state"]["bytes"], out["machine"]
    lines = [
        "",
        f"state {nbytes / GiB:.3f} GiB ({nbytes} bytes, {out['state']['tensors']} tensors), "
        f"{out['config']['reps']} repetitions, io_threads={out['config']['io_threads']}, "
        f"load average (1/5/15 min) at start {machine['loadavg_start']}, at end "
        f"{machine['loadavg_end']}",
    ]
    for part, used in (
        ("the run", machine.get("contention")),
        ("part 1 (with the warm-ups)", out["pause"].get("contention")),
        ("part 2", (out["drain"] or {}).get("contention")),
    ):
        if used:
            lines.append(describe_contention(part, used))
    return lines


def _phases_line(results: Measurements) -> list[str]:
    phases = {
        p: results.median("trainsnap", p) for p in ("capture", "plan", "stage", "write", "commit")
    }
    front = [p for p in ("capture", "plan", "stage") if phases[p] == phases[p]]
    if not front:
        return []
    rest = results.median("trainsnap", "pause") - sum(phases[p] for p in front)
    background = [p for p in ("write", "commit") if phases[p] == phases[p]]
    return [
        "",
        "trainsnap phases (median seconds; trainsnap.trace spans): "
        + ", ".join(f"{p} {phases[p]:.3f}" for p in front)
        + f"; the median pause less these: {rest:.3f}; in the background: "
        + ", ".join(f"{p} {phases[p]:.3f}" for p in background),
    ]


def report_pause(out: dict[str, Any]) -> tuple[list[str], list[Check]]:
    pause = out["pause"]
    results: Measurements = pause["results"]
    comparison = compare(
        results,
        nbytes=out["state"]["bytes"],
        metrics=("pause", "call", "returned", "drain"),
        rates=("pause",),
        ratios=pause_ratios(results),
    )
    table, rest = comparison.lines[0], comparison.lines[1:]
    lines = ["", "part 1: pause (seconds the caller is blocked; median)", table]
    lines += [
        f"  memcpy: {ONE_COPY}",
        "  pause: trainsnap: handle.pause; dcp: until async_save returns (dcp-background: until "
        "staging_completion); call: wall time of ts.async_save; returned: when async_save "
        "returned; drain: from the end of the pause to the commit, the caller idle",
    ]
    lines += [f"  {name}: {label}" for name, label in pause["labels"].items()]
    lines += [
        f"  {name}: unavailable here: {why}" for name, why in pause["dcp_unavailable"].items()
    ]
    return [*lines, *_phases_line(results), *rest], comparison.checks


def _no_save_case(drain: dict[str, Any]) -> dict[str, Any]:
    steps = drain["no_save"]["step_s"]
    mean = sum(steps) / len(steps)
    return {"case": "no save", "step_median_s": drain["no_save"]["step_median_s"]} | {
        "step_mean_s": mean,
        "slowdown_median": 1.0,
    }


DRAIN_COLUMNS: list[Column] = [
    ("case", lambda case: case["case"]),
    ("step ms (med)", lambda case: 1e3 * case["step_median_s"]),
    ("step ms (mean)", lambda case: 1e3 * case["step_mean_s"]),
    ("slowdown (med)", lambda case: case["slowdown_median"]),
    ("slowdown (mean)", lambda case: case.get("slowdown_mean", math.nan)),
    ("pause s", lambda case: median(case.get("pause_s", []))),
    ("steps in drain", lambda case: " ".join(map(str, case.get("steps_during_drain", "-")))),
    ("drain s", lambda case: case.get("drain_median_s", math.nan)),
    ("lost s", lambda case: median(case.get("lost_compute_s", []))),
    ("lost/drain", lambda case: case.get("lost_fraction_of_drain", math.nan)),
]


def report_drain(out: dict[str, Any]) -> list[str]:
    drain, step = out["drain"], out["drain"]["step"]
    idle = out["pause"]["results"].median("trainsnap", "drain")
    around = step["steps_around_each_save"]
    cases = [_no_save_case(drain)]
    cases += [{"case": f"draining, {name}"} | case for name, case in drain["cases"].items()]
    per_save = "; ".join(
        f"{name}: "
        + " ".join(
            f"{1e3 * b:.0f}->{1e3 * m:.0f}"
            for b, m in zip(
                case["no_save_step_median_s"], case["step_median_per_save_s"], strict=True
            )
        )
        for name, case in drain["cases"].items()
    )
    return [
        "",
        f"part 2: compute steps ({step['matmuls_per_step']} x matmul {step['matmul_n']}x"
        f"{step['matmul_n']} fp32, torch threads {step['torch_threads']}) while an async "
        f"trainsnap save of the state drains ({out['machine'].get('cpus_usable', '?')} usable "
        "CPUs)",
        records_table(cases, DRAIN_COLUMNS, digits=2),
        f"  no save: the {around} steps just before and the {around} just after each save; "
        "slowdown: per save, the median (mean) step time while it drains / the median of the "
        "steps around it, then the median over the saves; lost: compute seconds lost per save "
        "(the drain's step times - their count x the median around it); drain: from the end of "
        "the pause to the commit, while the steps run",
        f"  drain with the caller idle (part 1, io_threads={out['config']['io_threads']}): "
        f"{idle:.2f}s; per save (no save -> draining, ms/step): {per_save}",
        orders_line(drain["orders"], " | "),
    ]


def report(out: dict[str, Any]) -> tuple[str, list[Check]]:
    pause_lines, checks = report_pause(out)
    lines = [*_header(out), *pause_lines]
    if out["drain"] is not None:
        lines += report_drain(out)
    if out["profile"]:
        lines += ["", out["profile"]]
    return "\n".join(lines), checks


def main(argv: list[str] | None = None) -> int:
    arguments = cli.parser(__doc__, reps=5)
    arguments.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
    arguments.add_argument(
        "--skip-dcp", action="store_true", help="no torch.distributed.checkpoint"
    )
    arguments.add_argument("--skip-drain", action="store_true", help="part 1 only")
    arguments.add_argument(
        "--tensors",
        type=int,
        default=0,
        metavar="N",
        help="a state of N equal fp32 tensors instead of the mixed one (50 large + 2,000 small)",
    )
    arguments.add_argument(
        "--around",
        type=int,
        default=10,
        help="compute steps timed with no save just before and after each save (default 10)",
    )
    arguments.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also cProfile one warm async save call and print its top N functions",
    )
    args = cli.parse(
        arguments, argv, SMOKE, lambda a: "--around must be at least 1" if a.around < 1 else None
    )
    out = run(args)
    text, out["checks"] = report(out)
    emit(out, text, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
