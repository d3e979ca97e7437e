"""Asynchronous saves: how long the caller is blocked, and what the background drain costs.

Two parts, one process, CPU tensors:

1. **Pause.** On a state of ``--gib`` GiB (fp32 and bf16 tensors of mixed sizes, from
   ``common.make_state``), each repetition measures, in an order rotating from one repetition to
   the next:

   - ``memcpy``: one copy of every tensor into preallocated, already-touched tensors of the same
     shapes (``dst.copy_(src)`` per tensor): the limit of any staging copy.
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

    python benchmarks/async_pause.py                  # 1 GiB, 5 repetitions
    python benchmarks/async_pause.py --gib 0.25 --reps 3 --json out.json
    python benchmarks/async_pause.py --skip-dcp --profile 25

Snapshots live in a temporary directory under ``--dir`` (default: the system's temporary
directory), removed at the end.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import inspect
import io
import os
import pstats
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

import trainsnap as ts
from common import (
    GiB,
    check_bitwise_equal,
    describe_state,
    emit,
    format_table,
    fresh_dir,
    kv,
    machine_info,
    make_state,
    median,
    rotated,
    scratch_root,
    state_nbytes,
)
from trainsnap import trace, tunables

try:  # newer torch: stagers that cache their buffers or stage on a background thread
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
except ImportError:  # pragma: no cover - older torch
    DefaultStager = StagingOptions = None  # type: ignore[assignment,misc]

State = dict[str, torch.Tensor]

# The targets this benchmark checks.
TARGETS: dict[str, tuple[str, float]] = {
    "trainsnap/memcpy": ("<=", 1.3),  # trainsnap pause / the memcpy limit
    "dcp/trainsnap": (">=", 2.0),  # DCP pause (default) / trainsnap pause
}

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load).*")
warnings.filterwarnings("ignore", message=".*Ignoring pin_memory flag.*")


# -- references ------------------------------------------------------------------------------------


def flat_like_state(state: State, align: int = 64) -> tuple[torch.Tensor, State]:
    """One touched byte buffer holding views of the shapes and dtypes of ``state``."""
    offsets, pos = [], 0
    for t in state.values():
        offsets.append(pos)
        pos += -(-t.nbytes // align) * align
    flat = torch.zeros(pos, dtype=torch.uint8)
    views = {
        k: flat[off : off + t.nbytes].view(t.dtype).view(t.shape)
        for (k, t), off in zip(state.items(), offsets, strict=True)
    }
    return flat, views


def copy_state(src: State, dst: State) -> None:
    for k, t in src.items():
        dst[k].copy_(t)


# -- one measurement -------------------------------------------------------------------------------


@dataclass
class Sample:
    """One timed save (or copy): seconds blocked, and what followed."""

    pause: float
    call: float | None = None  # wall time of the call (trainsnap: it includes handle creation)
    returned: float | None = None  # when the call returned, where it precedes the pause's end
    drain: float | None = None  # from the end of the pause to the save's completion
    phases: dict[str, float] = field(default_factory=dict)


def span_seconds(step: int) -> dict[str, float]:
    """Durations of the trace spans of the save of ``step`` (seconds)."""
    out: dict[str, float] = {}
    for ev in trace.events():
        if ev.get("args", {}).get("step") == step:
            out[ev["name"]] = out.get(ev["name"], 0.0) + ev["dur"] / 1e6
    return out


class Trainsnap:
    """Warm asynchronous saves with a dedicated saver; unique steps name the trace spans."""

    name = "trainsnap"

    def __init__(self) -> None:
        self.saver = ts.AsyncSaver()
        self.step = 0

    def start(self, state: State, d: Path) -> tuple[ts.SaveHandle, float]:
        self.step += 1
        t0 = time.perf_counter()
        h: Any = ts.async_save(state, d, step=self.step, saver=self.saver)
        return h, time.perf_counter() - t0

    def run(self, state: State, d: Path, mutate: Callable[[], None] | None = None) -> Sample:
        h, call = self.start(state, d)
        t1 = time.perf_counter()
        if mutate is not None:
            mutate()
        h.wait()
        drain = time.perf_counter() - t1
        return Sample(h.pause, call=call, drain=drain, phases=span_seconds(self.step))

    def load(self, dst: State, d: Path) -> None:
        ts.load(dst, d)

    def close(self) -> None:
        self.saver.close()


def _no_dist(fn: Callable[..., Any]) -> dict[str, Any]:
    return {"no_dist": True} if "no_dist" in inspect.signature(fn).parameters else {}


class Dcp:
    """``dcp.async_save`` with one staging option."""

    def __init__(
        self,
        name: str,
        label: str,
        threads: int,
        *,
        stager: Any = None,
        writer_kw: dict[str, Any] | None = None,
    ) -> None:
        self.name, self.label, self.threads = name, label, threads
        self.stager = stager
        self.writer_kw = writer_kw or {}
        self.kw = _no_dist(dcp.async_save)
        if stager is not None:
            self.kw["async_stager"] = stager

    def run(self, state: State, d: Path, mutate: Callable[[], None] | None = None) -> Sample:
        writer = dcp.FileSystemWriter(
            d, thread_count=self.threads, sync_files=True, **self.writer_kw
        )
        t0 = time.perf_counter()
        f = dcp.async_save(state, storage_writer=writer, **self.kw)
        t1 = time.perf_counter()
        if hasattr(f, "staging_completion"):  # staging goes on in the background
            f.staging_completion.result()
            t2 = time.perf_counter()
            if mutate is not None:
                mutate()
            f.upload_completion.result()
            return Sample(t2 - t0, returned=t1 - t0, drain=time.perf_counter() - t2)
        if mutate is not None:
            mutate()
        f.result()
        return Sample(t1 - t0, drain=time.perf_counter() - t1)

    def load(self, dst: State, d: Path) -> None:
        dcp.load(dst, storage_reader=dcp.FileSystemReader(d), **_no_dist(dcp.load))

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


def dcp_options(threads: int) -> list[Dcp]:
    """DCP's default, then the CPU staging options this torch has (tried at warm-up)."""
    out = [
        Dcp(
            "dcp",
            "dcp (default: the FileSystemWriter stages into fresh memory at each save)",
            threads,
        )
    ]
    if "async_stager" in inspect.signature(dcp.async_save).parameters and DefaultStager:
        out.append(
            Dcp(
                "dcp-reused",
                "dcp (async_stager=DefaultStager(no pinning/sharing/background), reused: "
                "staging buffers cached across saves)",
                threads,
                stager=DefaultStager(StagingOptions(False, False, False, False)),
            )
        )
        out.append(
            Dcp(
                "dcp-background",
                "dcp (async_stager=DefaultStager(use_async_staging=True), reused: staged on a "
                "thread; pause = until staging_completion)",
                threads,
                stager=DefaultStager(StagingOptions(False, False, True, False)),
            )
        )
    out.append(
        Dcp(
            "dcp-cached-writer",
            "dcp (FileSystemWriter(cache_staged_state_dict=True): pinned cached staging)",
            threads,
            writer_kw={"cache_staged_state_dict": True},
        )
    )
    return out


class Memcpy:
    name = "memcpy"

    def __init__(self, dst: State) -> None:
        self.dst = dst

    def run(self, state: State, d: Path, mutate: Callable[[], None] | None = None) -> Sample:
        t0 = time.perf_counter()
        copy_state(state, self.dst)
        return Sample(time.perf_counter() - t0)


class BigCopy:
    name = "np.copyto"

    def __init__(self, nbytes: int) -> None:
        self.src = np.ones(nbytes, dtype=np.uint8)
        self.dst = np.zeros(nbytes, dtype=np.uint8)

    def run(self, state: State, d: Path, mutate: Callable[[], None] | None = None) -> Sample:
        t0 = time.perf_counter()
        np.copyto(self.dst, self.src)
        return Sample(time.perf_counter() - t0)


# -- part 1: the pause -----------------------------------------------------------------------------


def warm_and_check(m: Any, state: State, dst: State, root: Path) -> None:
    """The warm-up save of ``m``; while it drains, the largest tensor is overwritten; the
    snapshot must hold the state as it was at the save."""
    key = max(state, key=lambda k: state[k].nbytes)
    keep = state[key].clone()
    with fresh_dir(root, f"{m.name}-warm-") as d:
        m.run(state, d, mutate=lambda: state[key].fill_(-7.0))
        state[key].copy_(keep)
        for t in dst.values():
            t.zero_()
        m.load(dst, d)
    check_bitwise_equal(state, dst, f"{m.name} (warm-up save, state changed while draining)")


def measure_pause(
    state: State, root: Path, threads: int, reps: int, skip_dcp: bool
) -> tuple[dict[str, Any], Trainsnap]:
    nbytes = state_nbytes(state)
    flat, dst = flat_like_state(state)
    tsm = Trainsnap()
    methods: list[Any] = [Memcpy(dst), BigCopy(nbytes), tsm]
    unavailable: dict[str, str] = {}
    dcps = [] if skip_dcp else dcp_options(threads)
    labels = {m.name: m.label for m in dcps}

    for m in [tsm, *dcps]:
        gc.collect()
        try:
            warm_and_check(m, state, dst, root)
        except Exception as e:
            if m is tsm or m.name == "dcp":
                raise
            unavailable[m.name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            print(f"  {m.name}: unavailable ({unavailable[m.name]})", flush=True)
            m.close()
            continue
        if m is not tsm:
            methods.append(m)
        print(f"  warm-up {m.name}: saved, changed while draining, loaded, verified", flush=True)
    for m in methods[:2]:
        m.run(state, root)  # warm-up of the references

    samples: dict[str, list[Sample]] = {m.name: [] for m in methods}
    orders: list[list[str]] = []
    try:
        for rep in range(reps):
            order = rotated(methods, rep)
            orders.append([m.name for m in order])
            for m in order:
                with fresh_dir(root, f"{m.name}-") as d:
                    gc.collect()
                    samples[m.name].append(m.run(state, d))
            print(
                f"rep {rep + 1}/{reps} [{' '.join(orders[-1])}] "
                + "  ".join(f"{n} {s[-1].pause:.3f}s" for n, s in samples.items())
                + "  (pause)",
                flush=True,
            )
    finally:
        for m in dcps:
            if m.name not in unavailable:
                m.close()
    del flat, dst

    results: dict[str, Any] = {}
    for n, ss in samples.items():
        r: dict[str, Any] = {
            "pause_s": [s.pause for s in ss],
            "pause_median_s": median([s.pause for s in ss]),
            "pause_GBps": nbytes / median([s.pause for s in ss]) / 1e9,
        }
        if any(s.call is not None for s in ss):
            r["call_s"] = [s.call for s in ss]
            r["call_median_s"] = median([s.call for s in ss if s.call is not None])
        if any(s.returned is not None for s in ss):
            r["returned_s"] = [s.returned for s in ss]
            r["returned_median_s"] = median([s.returned for s in ss if s.returned is not None])
        if any(s.drain is not None for s in ss):
            r["drain_s"] = [s.drain for s in ss]
            r["drain_median_s"] = median([s.drain for s in ss if s.drain is not None])
        phases = sorted({p for s in ss for p in s.phases})
        if phases:
            r["phases_median_s"] = {p: median([s.phases.get(p, 0.0) for s in ss]) for p in phases}
        if n in labels:
            r["label"] = labels[n]
        results[n] = r

    pause = {n: r["pause_median_s"] for n, r in results.items()}
    ratios: dict[str, float] = {
        "trainsnap/memcpy": pause["trainsnap"] / pause["memcpy"],
        "trainsnap call/memcpy": results["trainsnap"]["call_median_s"] / pause["memcpy"],
        "trainsnap/np.copyto": pause["trainsnap"] / pause["np.copyto"],
    }
    dcp_names = [n for n in pause if n.startswith("dcp")]
    if dcp_names:
        ratios["dcp/trainsnap"] = pause["dcp"] / pause["trainsnap"]
        best = min(dcp_names, key=lambda n: pause[n])
        ratios["dcp best/trainsnap"] = pause[best] / pause["trainsnap"]
        ratios["_best_dcp"] = best  # type: ignore[assignment]
    return {
        "results": results,
        "ratios": ratios,
        "orders": orders,
        "dcp_unavailable": unavailable,
    }, tsm


# -- part 2: slowdown while draining ---------------------------------------------------------------


class Compute:
    """A compute-bound training step: ``k`` matmuls of ``n`` x ``n`` fp32, ``k`` chosen for a
    step of about ``target_s`` (at least one matmul)."""

    def __init__(self, n: int = 1024, target_s: float = 0.03) -> None:
        g = torch.Generator().manual_seed(1)
        self.a = torch.randn(n, n, generator=g)
        self.b = torch.randn(n, n, generator=g)
        self.c = torch.empty(n, n)
        self.n = n
        self.k = 1
        for _ in range(3):
            self.step()
        one = median([self.timed_step() for _ in range(7)])
        self.k = max(1, round(target_s / one))

    def step(self) -> None:
        for _ in range(self.k):
            torch.mm(self.a, self.b, out=self.c)

    def timed_step(self) -> float:
        t0 = time.perf_counter()
        self.step()
        return time.perf_counter() - t0


@dataclass
class Drain:
    io_threads: int
    pause: float
    drain: float
    before: list[float]  # steps with no save, just before it
    steps: list[float]  # steps that started before the save was committed
    after: list[float]  # steps with no save, just after it

    @property
    def base(self) -> float:
        """The step time with no save around this one (median of the steps before and after)."""
        return median(self.before + self.after)

    @property
    def lost(self) -> float:
        """Compute seconds lost to this save while it drained."""
        return sum(self.steps) - len(self.steps) * self.base


def drain_run(
    comp: Compute, tsm: Trainsnap, state: State, d: Path, io_threads: int, around: int
) -> Drain:
    """``around`` steps, then a save and steps until it is committed, then ``around`` steps."""
    before = [comp.timed_step() for _ in range(around)]
    prev = tunables.get()
    tunables.set_for_testing(dataclasses.replace(prev, io_threads=io_threads))
    try:
        h, _ = tsm.start(state, d)
        t_ret = time.perf_counter()
        done: list[float] = []

        def watch() -> None:
            try:
                h.wait()
            finally:
                done.append(time.perf_counter())

        w = threading.Thread(target=watch, name="drain-watch", daemon=True)
        w.start()
        steps: list[float] = []
        while not done:
            steps.append(comp.timed_step())
        w.join()
        h.wait()  # raises a failed save
    finally:
        tunables.set_for_testing(prev)
    after = [comp.timed_step() for _ in range(around)]
    return Drain(io_threads, h.pause, done[0] - t_ret, before, steps, after)


def measure_drain(
    state: State, root: Path, tsm: Trainsnap, reps: int, around: int
) -> dict[str, Any]:
    comp = Compute()
    io_default = tunables.get().io_threads
    modes = [(f"io_threads={io_default}", io_default)]
    if io_default != 2:
        modes.append(("io_threads=2", 2))
    drains: dict[str, list[Drain]] = {name: [] for name, _ in modes}
    orders = []
    for rep in range(reps):
        order = rotated(modes, rep)
        orders.append([n for n, _ in order])
        for name, nio in order:
            gc.collect()
            with fresh_dir(root, "drain-") as d:
                drains[name].append(drain_run(comp, tsm, state, d, nio, around))
        print(
            f"drain rep {rep + 1}/{reps} "
            + "  ".join(
                f"{n}: {1e3 * ds[-1].base:.1f} -> {1e3 * median(ds[-1].steps):.1f} ms/step, "
                f"drain {ds[-1].drain:.2f}s"
                for n, ds in drains.items()
            )
            + "  (no save -> draining)",
            flush=True,
        )
    base = [x for ds in drains.values() for dr in ds for x in dr.before + dr.after]
    out: dict[str, Any] = {
        "step": {
            "matmul_n": comp.n,
            "matmuls_per_step": comp.k,
            "torch_threads": torch.get_num_threads(),
            "steps_around_each_save": around,
        },
        "no_save": {"step_s": base, "step_median_s": median(base)},
        "orders": orders,
        "cases": {},
    }
    for name, ds in drains.items():
        steps = [x for dr in ds for x in dr.steps]
        out["cases"][name] = {
            "io_threads": ds[0].io_threads,
            "pause_s": [dr.pause for dr in ds],
            "drain_s": [dr.drain for dr in ds],
            "drain_median_s": median([dr.drain for dr in ds]),
            "steps_during_drain": [len(dr.steps) for dr in ds],
            "no_save_step_median_s": [dr.base for dr in ds],
            "step_s": steps,
            "step_median_s": median(steps),
            "step_mean_s": sum(steps) / len(steps),
            "step_median_per_save_s": [median(dr.steps) for dr in ds],
            # per save, against the steps just around it; then the median over the saves
            "slowdown_median": median([median(dr.steps) / dr.base for dr in ds]),
            "slowdown_mean": median([sum(dr.steps) / len(dr.steps) / dr.base for dr in ds]),
            "lost_compute_s": [dr.lost for dr in ds],
            "lost_fraction_of_drain": median([dr.lost / dr.drain for dr in ds if dr.drain > 0]),
        }
    return out


# -- profile ---------------------------------------------------------------------------------------


def profile_pause(state: State, root: Path, tsm: Trainsnap, top: int) -> str:
    """cProfile of one warm ``ts.async_save(...)`` call (the pause only)."""
    with fresh_dir(root, "profile-") as d:
        gc.collect()
        pr = cProfile.Profile()
        tsm.step += 1
        pr.enable()
        h: Any = ts.async_save(state, d, step=tsm.step, saver=tsm.saver)
        pr.disable()
        h.wait()
    buf = io.StringIO()
    st = pstats.Stats(pr, stream=buf).strip_dirs()
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return (
        f"cProfile of one warm ts.async_save(...) call (pause under the profiler: "
        f"{h.pause:.3f}s; the profiler inflates Python-heavy code):\n{buf.getvalue()}"
    )


# -- the run ---------------------------------------------------------------------------------------


def _loadavg() -> str:
    """The 1/5/15-minute load averages (other processes competing for the CPUs skew timings)."""
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except (OSError, AttributeError):
        return "n/a"


def _proc_cpu(stat: str) -> tuple[int, int]:
    """(parent pid, utime + stime in clock ticks) from the text of ``/proc/<pid>/stat``."""
    f = stat[stat.rindex(")") + 2 :].split()
    return int(f[1]), int(f[11]) + int(f[12])


def _cpu_times() -> dict[str, float] | None:
    """CPU seconds so far (Linux ``/proc``): ``busy`` of every CPU (user, nice, system), this
    process's, the kernel threads' (writeback, journaling: mostly work this run causes), and the
    host's ``steal``; or None where ``/proc`` cannot be read."""
    try:
        with open("/proc/stat") as f:
            cpu = [int(x) for x in f.readline().split()[1:]]
        kticks = 0
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid, ticks = _proc_cpu(f.read())
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
            if ppid == 2 or pid == "2":
                kticks += ticks
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system = cpu[:3]
    t = os.times()
    return {
        "busy": (user + nice + system) / hz,
        "self": t.user + t.system,
        "kernel_threads": kticks / hz,
        "steal": cpu[7] / hz if len(cpu) > 7 else 0.0,
    }


def _others(start: dict[str, float] | None, wall: float) -> dict[str, Any] | None:
    """CPU time used by other processes (and stolen by the host) while this run went on: all
    the CPUs' busy time less this process's and the kernel threads'."""
    end = _cpu_times()
    if start is None or end is None:
        return None
    d = {k: end[k] - start[k] for k in end}
    others = max(0.0, d["busy"] - d["self"] - d["kernel_threads"])
    cpus = os.cpu_count() or 1
    return {
        "wall_s": round(wall, 1),
        "self_cpu_s": round(d["self"], 1),
        "kernel_threads_cpu_s": round(d["kernel_threads"], 1),
        "other_processes_cpu_s": round(others, 1),
        "other_processes_share": round(others / (wall * cpus), 3),
        "steal_s": round(d["steal"], 1),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    threads = tunables.get().io_threads
    print(f"making the state ({args.gib} GiB, seed {args.seed}) ...", flush=True)
    state = make_state(args.gib, seed=args.seed)
    nbytes = state_nbytes(state)
    desc = describe_state(state)

    machine = machine_info()
    machine["trainsnap"] = ts.__version__
    machine["io_threads"] = threads
    machine["loadavg_start"] = _loadavg()

    root, free = scratch_root(args.dir, nbytes * 2.5, "trainsnap-async-")
    print(f"machine: {kv(machine)}")
    print(f"state: {kv(desc)}")
    print(f"directory: {root} ({free / GiB:.0f} GiB free)", flush=True)

    cpu0, t0 = _cpu_times(), time.perf_counter()
    was_tracing = trace.enabled()
    trace.enable()
    try:
        print("part 1: pause", flush=True)
        pause, tsm = measure_pause(state, root, threads, args.reps, args.skip_dcp)
        pause["contention"] = _others(cpu0, time.perf_counter() - t0)
        drain = None
        if not args.skip_drain:
            print("part 2: slowdown while draining", flush=True)
            cpu2, t2 = _cpu_times(), time.perf_counter()
            drain = measure_drain(state, root, tsm, args.reps, args.around)
            drain["contention"] = _others(cpu2, time.perf_counter() - t2)
        prof = profile_pause(state, root, tsm, args.profile) if args.profile else None
        tsm.close()
    finally:
        if not was_tracing:
            trace.disable()
        shutil.rmtree(root, ignore_errors=True)
    machine["loadavg_end"] = _loadavg()
    machine["contention"] = _others(cpu0, time.perf_counter() - t0)
    return {
        "machine": machine,
        "config": {
            "gib": args.gib,
            "reps": args.reps,
            "seed": args.seed,
            "io_threads": threads,
            "skip_dcp": args.skip_dcp,
        },
        "state": desc,
        "pause": pause,
        "drain": drain,
        "profile": prof,
        "targets": TARGETS,
    }


def _verdict(name: str, value: float) -> tuple[str, str]:
    op, target = TARGETS[name]
    ok = value <= target if op == "<=" else value >= target
    return f"{op} {target:g}", "met" if ok else "MISSED"


def _ms(x: float | None) -> float:
    return float("nan") if x is None else 1e3 * x


def _contention(part: str, c: dict[str, Any], cpus: int) -> str:
    return (
        f"CPU time during {part} ({c['wall_s']}s x {cpus} CPUs): this process "
        f"{c['self_cpu_s']}s, kernel threads {c['kernel_threads_cpu_s']}s, other processes "
        f"{c['other_processes_cpu_s']}s ({100 * c['other_processes_share']:.1f}% of the CPUs), "
        f"stolen by the host {c['steal_s']}s"
    )


def report(out: dict[str, Any]) -> str:
    p = out["pause"]
    res, ratios = p["results"], p["ratios"]
    nbytes = out["state"]["bytes"]
    lines = [
        "",
        f"state {nbytes / GiB:.3f} GiB ({nbytes} bytes, {out['state']['tensors']} tensors), "
        f"{out['config']['reps']} repetitions, io_threads={out['config']['io_threads']}, "
        f"load average (1/5/15 min) at start {out['machine']['loadavg_start']}, at end "
        f"{out['machine']['loadavg_end']}",
    ]
    for part, c in (
        ("the run", out["machine"].get("contention")),
        ("part 1 (with the warm-ups)", out["pause"].get("contention")),
        ("part 2", (out["drain"] or {}).get("contention")),
    ):
        if c:
            lines.append(_contention(part, c, out["machine"]["cpu_count"]))
    lines += [
        "",
        "part 1: pause (seconds the caller is blocked; median)",
    ]
    rows = []
    for n, r in res.items():
        rows.append(
            [
                n,
                r["pause_median_s"],
                r["pause_GBps"],
                r.get("call_median_s", float("nan")),
                r.get("returned_median_s", float("nan")),
                r.get("drain_median_s", float("nan")),
            ]
        )
    lines.append(
        format_table(
            ["method", "pause s", "GB/s", "call s", "returns s", "drain s (idle)"], rows, digits=3
        )
    )
    lines.append(
        "  pause: trainsnap: handle.pause; dcp: until async_save returns (dcp-background: until "
        "staging_completion); call: wall time of ts.save; returns: when async_save returned; "
        "drain: from the end of the pause to the commit, the caller idle"
    )
    for n, r in res.items():
        if "label" in r:
            lines.append(f"  {n}: {r['label']}")
    for n, why in p["dcp_unavailable"].items():
        lines.append(f"  {n}: unavailable here: {why}")

    ph = res["trainsnap"].get("phases_median_s", {})
    if ph:
        front = [k for k in ("capture", "plan", "stage") if k in ph]
        other = res["trainsnap"]["pause_median_s"] - sum(ph[k] for k in front)
        lines += [
            "",
            "trainsnap phases (median seconds; trainsnap.trace spans): "
            + ", ".join(f"{k} {ph[k]:.3f}" for k in front)
            + f"; the median pause less these: {other:.3f}"
            + "; in the background: "
            + ", ".join(f"{k} {ph[k]:.3f}" for k in ("write", "commit") if k in ph),
        ]

    lines += ["", "ratios (medians):"]
    rrows: list[list[object]] = []
    v = ratios["trainsnap/memcpy"]
    rrows.append(["trainsnap pause / memcpy limit", v, *_verdict("trainsnap/memcpy", v)])
    rrows.append(["trainsnap call / memcpy limit", ratios["trainsnap call/memcpy"], "-", "-"])
    rrows.append(["trainsnap pause / np.copyto", ratios["trainsnap/np.copyto"], "-", "-"])
    if "dcp/trainsnap" in ratios:
        v = ratios["dcp/trainsnap"]
        rrows.append(["dcp (default) pause / trainsnap pause", v, *_verdict("dcp/trainsnap", v)])
        best = ratios["_best_dcp"]
        v = ratios["dcp best/trainsnap"]
        rrows.append(
            [f"{best} (best dcp) pause / trainsnap pause", v, *_verdict("dcp/trainsnap", v)]
        )
    lines.append(format_table(["ratio", "value", "target", "result"], rrows, digits=2))

    lines += ["", "individual pauses (seconds, in repetition order):"]
    lines.append(
        format_table(
            ["method", "pauses"],
            [[n, " ".join(f"{x:.3f}" for x in r["pause_s"])] for n, r in res.items()],
        )
    )
    lines.append("orders: " + "; ".join(" ".join(o) for o in p["orders"]))

    d = out["drain"]
    if d is not None:
        st = d["step"]
        base = d["no_save"]["step_median_s"]
        lines += [
            "",
            f"part 2: compute steps ({st['matmuls_per_step']} x matmul {st['matmul_n']}x"
            f"{st['matmul_n']} fp32, torch threads {st['torch_threads']}) while an async "
            f"trainsnap save of the state drains ({out['machine'].get('cpus_usable', '?')} "
            "usable CPUs)",
        ]
        nan = float("nan")
        base_mean = sum(d["no_save"]["step_s"]) / len(d["no_save"]["step_s"])
        drows: list[list[object]] = [
            ["no save", _ms(base), _ms(base_mean), 1.0, nan, nan, "-", nan, nan, nan]
        ]
        for name, r in d["cases"].items():
            drows.append(
                [
                    f"draining, {name}",
                    _ms(r["step_median_s"]),
                    _ms(r["step_mean_s"]),
                    r["slowdown_median"],
                    r["slowdown_mean"],
                    median(r["pause_s"]),
                    " ".join(str(n) for n in r["steps_during_drain"]),
                    r["drain_median_s"],
                    median(r["lost_compute_s"]),
                    r["lost_fraction_of_drain"],
                ]
            )
        lines.append(
            format_table(
                [
                    "case",
                    "step ms (med)",
                    "step ms (mean)",
                    "slowdown (med)",
                    "slowdown (mean)",
                    "pause s",
                    "steps in drain",
                    "drain s",
                    "lost s",
                    "lost/drain",
                ],
                drows,
                digits=2,
            )
        )
        idle = res["trainsnap"].get("drain_median_s")
        n = st["steps_around_each_save"]
        lines.append(
            f"  no save: the {n} steps just before and the {n} just after each save; slowdown: "
            "per save, the median (mean) step time while it drains / the median of the steps "
            "around it, then the median over the saves; lost: compute seconds lost per save "
            "(the drain's step times - their count x the median around it); drain: from the "
            "end of the pause to the commit, while the steps run"
        )
        lines.append(
            f"  drain with the caller idle (part 1, io_threads={out['config']['io_threads']}): "
            f"{idle:.2f}s; per save (no save -> draining, ms/step): "
            + "; ".join(
                f"{name}: "
                + " ".join(
                    f"{1e3 * b:.0f}->{1e3 * m:.0f}"
                    for b, m in zip(
                        r["no_save_step_median_s"], r["step_median_per_save_s"], strict=True
                    )
                )
                for name, r in d["cases"].items()
            )
        )
        lines.append("orders: " + "; ".join(" | ".join(o) for o in d["orders"]))
    if out["profile"]:
        lines += ["", out["profile"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
    p.add_argument("--reps", type=int, default=5, help="repetitions (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the state's values")
    p.add_argument(
        "--dir", default=None, help="where to write (default: the system's temporary directory)"
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--skip-dcp", action="store_true", help="no torch.distributed.checkpoint")
    p.add_argument("--skip-drain", action="store_true", help="part 1 only")
    p.add_argument(
        "--around",
        type=int,
        default=10,
        help="compute steps timed with no save just before and after each save (default 10)",
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also cProfile one warm async save call and print its top N functions",
    )
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be at least 1")
    if args.around < 1:
        p.error("--around must be at least 1")

    out = run(args)
    emit(out, report(out), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
