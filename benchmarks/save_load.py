"""Save and load of one process's state: trainsnap against torch.save, DCP and the disk's limit.

On the same state in the same run, each repetition saves with every method (each into a fresh
directory), then loads every method's snapshot into preallocated destination tensors, the order
of methods rotating from one repetition to the next. Before each load the files about to be read
are dropped from the page cache (``posix_fadvise(DONTNEED)``; ``--warm`` skips that), and each
load is checked bit for bit against the source (outside the timing).

Methods:

- ``trainsnap``: ``trainsnap.save`` (checksums on, the default) / ``trainsnap.load``.
- ``torch``: ``torch.save`` of the whole dict to one file, then fsync (file and directory) /
  ``torch.load(mmap=False, weights_only=True)`` then a copy into the destinations.
- ``dcp``: ``torch.distributed.checkpoint.save`` with ``FileSystemWriter(thread_count=<io
  threads>, sync_files=True)`` / ``dcp.load`` with ``FileSystemReader``, no process group.
- ``raw``: the same bytes written by a pool of <io threads> threads into one file per thread
  (writev, fsync each, fsync the directory) / read back with preadv into the destinations; no
  format and no hashing: the disk's limit.

<io threads> is trainsnap's ``io_threads`` tunable (``TRAINSNAP_IO_THREADS`` overrides it).

    python benchmarks/save_load.py                 # 1 GiB, 5 repetitions
    python benchmarks/save_load.py --gib 0.25 --reps 3 --json out.json

At most one copy of the state per method is on disk at a time (removed after the repetition's
loads), under a temporary directory of ``--dir`` that is removed at the end.
"""

from __future__ import annotations

import argparse
import inspect
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed.checkpoint as dcp

import trainsnap as ts
from common import (
    GiB,
    check_bitwise_equal,
    clear_state,
    describe_state,
    emit,
    empty_like_state,
    evict,
    format_table,
    fresh_dir,
    fsync_dir,
    gbps,
    kv,
    machine_info,
    make_state,
    median,
    raw_read,
    raw_write,
    resident_fraction,
    rotated,
    scratch_root,
    state_nbytes,
    timed,
)
from trainsnap import tunables

State = dict[str, torch.Tensor]

# The targets this benchmark checks (trainsnap time / other method's time, at most).
TARGETS: dict[str, dict[str, float]] = {
    "save": {"dcp": 1.0, "raw": 1.3},
    "load": {"dcp": 0.5, "raw": 2.0},
}

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load).*")


# -- the methods -----------------------------------------------------------------------------------


def _dcp_kwargs(fn: Callable[..., Any]) -> dict[str, Any]:
    """``no_dist=True`` where this torch's DCP takes it (older versions need it without a
    process group; newer ones infer it)."""
    return {"no_dist": True} if "no_dist" in inspect.signature(fn).parameters else {}


@dataclass(frozen=True)
class Method:
    name: str
    save: Callable[[State, Path], None]
    load: Callable[[State, Path], None]


def trainsnap_save(state: State, d: Path) -> None:
    ts.save(state, d, step=1)


def trainsnap_load(dst: State, d: Path) -> None:
    ts.load(dst, d)


def torch_save(state: State, d: Path) -> None:
    with open(d / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(d)


def torch_load(dst: State, d: Path) -> None:
    loaded = torch.load(d / "state.pt", map_location="cpu", mmap=False, weights_only=True)
    with torch.no_grad():
        for k, t in dst.items():
            t.copy_(loaded[k])
    del loaded


def make_dcp(threads: int) -> tuple[Callable[[State, Path], None], Callable[[State, Path], None]]:
    save_kw, load_kw = _dcp_kwargs(dcp.save), _dcp_kwargs(dcp.load)

    def save(state: State, d: Path) -> None:
        writer = dcp.FileSystemWriter(d, thread_count=threads, sync_files=True)
        dcp.save(state, storage_writer=writer, **save_kw)

    def load(dst: State, d: Path) -> None:
        dcp.load(dst, storage_reader=dcp.FileSystemReader(d), **load_kw)

    return save, load


def make_raw(threads: int) -> tuple[Callable[[State, Path], None], Callable[[State, Path], None]]:
    def save(state: State, d: Path) -> None:
        raw_write(list(state.values()), d, threads)

    def load(dst: State, d: Path) -> None:
        raw_read(list(dst.values()), d, threads)

    return save, load


def methods(threads: int) -> list[Method]:
    return [
        Method("trainsnap", trainsnap_save, trainsnap_load),
        Method("torch", torch_save, torch_load),
        Method("dcp", *make_dcp(threads)),
        Method("raw", *make_raw(threads)),
    ]


# -- the run ---------------------------------------------------------------------------------------


def probe_eviction(state: State, dst: State, root: Path, threads: int) -> dict[str, Any]:
    """Write the state raw, read it back warm (just written: in the page cache), evict, read it
    again: whether DONTNEED drops the pages, and what a cold read costs against a warm one."""
    nbytes = state_nbytes(state)
    with fresh_dir(root, "probe-") as d:
        raw_write(list(state.values()), d, threads)
        before = resident_fraction(d)
        warm_s, _ = timed(lambda: raw_read(list(dst.values()), d, threads))
        evict(d)
        after = resident_fraction(d)
        cold_s, _ = timed(lambda: raw_read(list(dst.values()), d, threads))
        evict(d)
    check_bitwise_equal(state, dst, "raw (eviction probe)")
    return {
        "resident_before": before,
        "resident_after_evict": after,
        "warm_read_s": warm_s,
        "warm_read_GBps": gbps(nbytes, warm_s),
        "cold_read_s": cold_s,
        "cold_read_GBps": gbps(nbytes, cold_s),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    threads = tunables.get().io_threads
    print(f"making the state ({args.gib} GiB, seed {args.seed}) ...", flush=True)
    state = make_state(args.gib, seed=args.seed)
    nbytes = state_nbytes(state)
    dst = empty_like_state(state)
    desc = describe_state(state)
    ms = methods(threads)
    names = [m.name for m in ms]

    machine = machine_info()
    machine["trainsnap"] = ts.__version__
    machine["io_threads"] = threads

    root, free = scratch_root(args.dir, nbytes * (len(ms) + 1.2), "trainsnap-bench-")

    print(f"machine: {kv(machine)}")
    print(f"state: {kv(desc)}")
    print(f"directory: {root} ({free / GiB:.0f} GiB free)")
    print(
        f"eviction: {'off (--warm)' if args.warm else 'posix_fadvise(DONTNEED) before each load'}"
    )

    save_s: dict[str, list[float]] = {n: [] for n in names}
    load_s: dict[str, list[float]] = {n: [] for n in names}
    resident: dict[str, list[float | None]] = {n: [] for n in names}
    orders: list[list[str]] = []
    try:
        probe = probe_eviction(state, dst, root, threads)
        print(
            "eviction probe (raw read of the state): "
            f"warm {probe['warm_read_s']:.3f}s ({probe['warm_read_GBps']:.2f} GB/s), "
            f"after DONTNEED {probe['cold_read_s']:.3f}s ({probe['cold_read_GBps']:.2f} GB/s); "
            f"resident pages before {_pct(probe['resident_before'])}, "
            f"after eviction {_pct(probe['resident_after_evict'])}"
        )
        for rep in range(args.reps):
            order = rotated(ms, rep)
            orders.append([m.name for m in order])
            with ExitStack() as stack:
                dirs: dict[str, Path] = {}
                for m in order:
                    d = stack.enter_context(fresh_dir(root, f"{m.name}-"))
                    dirs[m.name] = d
                    s, _ = timed(lambda m=m, d=d: m.save(state, d))
                    save_s[m.name].append(s)
                for m in order:
                    clear_state(dst)
                    if not args.warm:
                        evict(dirs[m.name])
                    resident[m.name].append(resident_fraction(dirs[m.name]))
                    s, _ = timed(lambda m=m, d=dirs[m.name]: m.load(dst, d))
                    load_s[m.name].append(s)
                    check_bitwise_equal(state, dst, f"{m.name} load, repetition {rep + 1}")
            print(
                f"rep {rep + 1}/{args.reps} [{' '.join(orders[-1])}] "
                + "  ".join(f"{n} {save_s[n][-1]:.2f}/{load_s[n][-1]:.2f}s" for n in names)
                + "  (save/load, verified)",
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)

    results: dict[str, Any] = {}
    for n in names:
        sm, lm = median(save_s[n]), median(load_s[n])
        results[n] = {
            "save_s": save_s[n],
            "load_s": load_s[n],
            "save_median_s": sm,
            "load_median_s": lm,
            "save_GBps": gbps(nbytes, sm),
            "load_GBps": gbps(nbytes, lm),
            "resident_before_load": resident[n],
        }
    ratios = {
        op: {
            other: results["trainsnap"][f"{op}_median_s"] / results[other][f"{op}_median_s"]
            for other in ("dcp", "raw", "torch")
        }
        for op in ("save", "load")
    }
    return {
        "machine": machine,
        "config": {
            "gib": args.gib,
            "reps": args.reps,
            "seed": args.seed,
            "warm": args.warm,
            "io_threads": threads,
        },
        "state": desc,
        "eviction_probe": probe,
        "orders": orders,
        "results": results,
        "ratios": ratios,
        "targets": TARGETS,
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def report(out: dict[str, Any]) -> str:
    res, ratios = out["results"], out["ratios"]
    nbytes = out["state"]["bytes"]
    lines = [
        "",
        f"state {nbytes / GiB:.3f} GiB ({nbytes} bytes, {out['state']['tensors']} tensors), "
        f"{out['config']['reps']} repetitions, io_threads={out['config']['io_threads']}, "
        f"{'warm page cache' if out['config']['warm'] else 'page cache evicted before loads'}",
        "",
    ]
    rows = [
        [n, r["save_median_s"], r["save_GBps"], r["load_median_s"], r["load_GBps"]]
        for n, r in res.items()
    ]
    lines.append(
        format_table(
            ["method", "save s (median)", "save GB/s", "load s (median)", "load GB/s"], rows
        )
    )
    lines += ["", "trainsnap time / other's time (median; lower is better for trainsnap):"]
    rrows = []
    for op in ("save", "load"):
        for other, label in (("dcp", "DCP"), ("raw", "raw"), ("torch", f"torch.{op}")):
            target = TARGETS[op].get(other)
            verdict = (
                "-" if target is None else ("met" if ratios[op][other] <= target else "MISSED")
            )
            tgt = "-" if target is None else f"<= {target:g}"
            rrows.append([f"{op}: trainsnap/{label}", ratios[op][other], tgt, verdict])
    lines.append(format_table(["ratio", "value", "target", "result"], rrows, digits=2))
    lines += ["", "individual times (seconds, in repetition order):"]
    trows = []
    for n, r in res.items():
        trows.append([f"{n} save", " ".join(f"{x:.3f}" for x in r["save_s"])])
        trows.append([f"{n} load", " ".join(f"{x:.3f}" for x in r["load_s"])])
    lines.append(format_table(["method", "times"], trows))
    res_after = [x for r in res.values() for x in r["resident_before_load"] if x is not None]
    if res_after:
        lines.append(
            f"\npage-cache residency of the files when each load started: "
            f"max {_pct(max(res_after))}, mean {_pct(sum(res_after) / len(res_after))}"
        )
    lines.append("orders: " + "; ".join(" ".join(o) for o in out["orders"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
    p.add_argument("--reps", type=int, default=5, help="repetitions (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the state's values")
    p.add_argument(
        "--dir", default=None, help="where to write (default: the system's temporary directory)"
    )
    p.add_argument("--warm", action="store_true", help="do not evict files before loads")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be at least 1")

    out = run(args)
    emit(out, report(out), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
