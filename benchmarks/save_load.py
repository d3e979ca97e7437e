"""Save and load of one process's state: trainsnap against torch.save, DCP and the disk's limit.

On the same state in the same run, each repetition saves with every method (each into a fresh
directory), then loads every method's snapshot into preallocated destination tensors ``--loads``
times (3 by default), the order of methods rotating from one repetition, and one round of loads,
to the next. Before each load every method's files are dropped from the page cache
(``posix_fadvise(DONTNEED)``; ``--warm`` skips that), and each load is checked bit for bit
against the source (outside the timing). A cold load's time swings with the disk's other tenants
(the same raw read of 1 GiB took 0.5 s and 1.4 s minutes apart here): the load medians are taken
over repetitions times loads.

Methods (``benchmarks._framework.adapters`` and ``.raw``):

- ``trainsnap``: ``trainsnap.save`` (checksums on, the default) / ``trainsnap.load``.
- ``torch``: ``torch.save`` of the whole dict to one file, then fsync (file and directory) /
  ``torch.load(mmap=False, weights_only=True)`` then a copy into the destinations.
- ``dcp``: ``torch.distributed.checkpoint.save`` with ``FileSystemWriter(thread_count=<io
  threads>, sync_files=True)`` / ``dcp.load`` with ``FileSystemReader``, no process group.
- ``raw``: the same bytes written by a pool of <io threads> threads into one file per thread
  (writev, fsync each, fsync the directory) / read back with preadv into the destinations; no
  format and no hashing: the disk's limit.

<io threads> is trainsnap's ``io_threads`` tunable (``TRAINSNAP_IO_THREADS`` overrides it).

    python -m benchmarks.save_load                 # 1 GiB, 5 repetitions of 1 save, 3 loads
    python -m benchmarks.save_load --gib 0.25 --reps 3 --json out.json
    python -m benchmarks.save_load --smoke         # tiny: does it run and verify?

At most one copy of the state per method is on disk at a time (removed after the repetition's
loads), under a temporary directory of ``--dir`` that is removed at the end.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks._framework import cli
from benchmarks._framework.adapters import Dcp, TorchSave, Trainsnap
from benchmarks._framework.method import (
    Measurements,
    Method,
    SaveLoadRound,
    rotated,
    set_up,
    timed,
)
from benchmarks._framework.raw import RawLimit
from benchmarks._framework.report import Ratio, Target, compare, emit, facts, gbps
from benchmarks._framework.state import (
    GiB,
    Tensors,
    check_bitwise_equal,
    clear_state,
    describe_state,
    empty_like_state,
    make_state,
    state_nbytes,
)
from benchmarks._framework.system import (
    evict,
    fresh_dir,
    load_average,
    machine_info,
    percent,
    resident_fraction,
    scratch_root,
)
from trainsnap import tunables

# trainsnap time / the other method's time, at most. A cold load waits for the disk, which
# trainsnap must keep as busy as a raw read does; a warm one is a memory copy, and trainsnap
# also hashes every byte and places every tensor.
TARGETS: dict[tuple[str, str], float] = {
    ("save", "dcp"): 1.0,
    ("save", "raw"): 1.3,
    ("load", "dcp"): 0.5,
}
LOAD_RAW_TARGET = {"cold": 1.1, "warm": 2.0}
SMOKE = {"gib": 0.01, "reps": 2, "loads": 2}


def methods(threads: int) -> list[Method]:
    return [Trainsnap(), TorchSave(), Dcp(threads), RawLimit(threads)]


def ratios(warm: bool = False) -> list[Ratio]:
    targets = TARGETS | {("load", "raw"): LOAD_RAW_TARGET["warm" if warm else "cold"]}
    out = []
    for operation in ("save", "load"):
        labels = {"dcp": "DCP", "raw": "raw", "torch": f"torch.{operation}"}
        for other, label in labels.items():
            bound = targets.get((operation, other))
            out.append(
                Ratio(
                    f"{operation}: trainsnap/{label}",
                    ("trainsnap", operation),
                    (other, operation),
                    None if bound is None else Target("<=", bound),
                )
            )
    return out


def probe_eviction(state: Tensors, destination: Tensors, root: Path) -> dict[str, Any]:
    """Write the state raw, read it back warm (just written: in the page cache), evict, read it
    again: whether DONTNEED drops the pages, and what a cold read costs against a warm one."""
    raw = RawLimit(tunables.get().io_threads)
    nbytes = state_nbytes(state)
    with fresh_dir(root, "probe-") as directory:
        raw.save(state, directory)
        before = resident_fraction(directory)
        warm_s, _ = timed(lambda: raw.load(destination, directory))
        evict(directory)
        after = resident_fraction(directory)
        cold_s, _ = timed(lambda: raw.load(destination, directory))
        evict(directory)
    check_bitwise_equal(state, destination, "raw (eviction probe)")
    probe = {"resident_before": before, "resident_after_evict": after}
    probe |= {"warm_read_s": warm_s, "warm_read_GBps": gbps(nbytes, warm_s)}
    probe |= {"cold_read_s": cold_s, "cold_read_GBps": gbps(nbytes, cold_s)}
    print(
        "eviction probe (raw read of the state): "
        f"warm {warm_s:.3f}s ({probe['warm_read_GBps']:.2f} GB/s), "
        f"after DONTNEED {cold_s:.3f}s ({probe['cold_read_GBps']:.2f} GB/s); "
        f"resident pages before {percent(before)}, after eviction {percent(after)}"
    )
    return probe


def _evictor(warm: bool, root: Path) -> Any:
    """Before each cold load, every method's files are dropped from the page cache, not only
    those about to be read: the memory a load's page cache then takes is in the same state for
    every method. Dropping only the next method's files left the previous load's gigabyte
    cached, and the load after it ran slower (the same trainsnap and raw loads alternating,
    4 repetitions of 3 each: trainsnap/raw 1.37 and 1.30 evicting only the files read next,
    1.12 and 1.15 evicting all; this machine's memory is reclaimed by the host when idle)."""

    def before_load(directory: Path) -> float | None:
        if not warm:
            evict(root)
        return resident_fraction(directory)

    return before_load


def repeat(
    compared: list[Method], state: Tensors, destination: Tensors, root: Path, args: Any
) -> Measurements:
    """``args.reps`` rounds of saves then loads, every load verified."""
    results = Measurements()
    for repetition in range(args.reps):

        def verify(method: Method, repetition: int = repetition) -> None:
            check_bitwise_equal(
                state, destination, f"{method.name} load, repetition {repetition + 1}"
            )

        one = SaveLoadRound(
            state=state,
            destination=destination,
            clear=clear_state,
            before_load=_evictor(args.warm, root),
            verify=verify,
            loads=args.loads,
        )
        order = rotated(compared, repetition)
        with ExitStack() as stack:
            directories = {
                m.name: stack.enter_context(fresh_dir(root, f"{m.name}-")) for m in order
            }
            one.run(order, directories, results)
        print(
            f"rep {repetition + 1}/{args.reps} [{' '.join(results.orders[-1])}] "
            + "  ".join(
                f"{m.name} {results.series(m.name, 'save')[-1]:.2f}/"
                + ",".join(f"{x:.2f}" for x in results.series(m.name, "load")[-args.loads :])
                + "s"
                for m in compared
            )
            + "  (save/load, verified)",
            flush=True,
        )
    return results


def run(args: Any) -> dict[str, Any]:
    print(f"making the state ({args.gib} GiB, seed {args.seed}) ...", flush=True)
    state = make_state(args.gib, seed=args.seed)
    destination = empty_like_state(state)
    machine = machine_info() | {"loadavg_start": load_average()}
    description = describe_state(state)
    print(facts("machine", machine))
    print(facts("state", description))
    compared = methods(machine["io_threads"])
    need = state_nbytes(state) * (len(compared) + 1.2)
    with scratch_root(args.dir, need, "trainsnap-bench-") as root, set_up(compared):
        cold = "posix_fadvise(DONTNEED) of every method's files before each load"
        eviction = "off (--warm)" if args.warm else cold
        print(f"eviction: {eviction}")
        probe = probe_eviction(state, destination, root)
        results = repeat(compared, state, destination, root, args)
    machine["loadavg_end"] = load_average()
    config = {"gib": args.gib, "reps": args.reps, "loads": args.loads, "seed": args.seed}
    config["warm"] = args.warm
    return {
        "machine": machine,
        "config": config | {"io_threads": machine["io_threads"]},
        "state": description,
        "eviction_probe": probe,
        "results": results,
    }


def report(out: dict[str, Any]) -> tuple[str, list[Any]]:
    results: Measurements = out["results"]
    nbytes, config = out["state"]["bytes"], out["config"]
    comparison = compare(
        results,
        nbytes=nbytes,
        metrics=("save", "load"),
        ratios=ratios(config["warm"]),
        ratio_title="trainsnap time / other's time (median; lower is better for trainsnap):",
    )
    cache = "warm page cache" if config["warm"] else "page cache evicted before loads"
    lines = [
        "",
        f"state {nbytes / GiB:.3f} GiB ({nbytes} bytes, {out['state']['tensors']} tensors), "
        f"{config['reps']} repetitions of 1 save and {config['loads']} loads, "
        f"io_threads={config['io_threads']}, {cache}; load "
        f"average (1/5/15 min) at start {out['machine']['loadavg_start']}, at end "
        f"{out['machine']['loadavg_end']}",
        "",
        *comparison.lines,
    ]
    resident = [x for m in results.methods for x in results.series(m, "resident") if x == x]
    if resident:
        lines.append(
            f"page-cache residency of the files when each load started: "
            f"max {percent(max(resident))}, mean {percent(sum(resident) / len(resident))}"
        )
    return "\n".join(lines), comparison.checks


def main(argv: list[str] | None = None) -> int:
    arguments = cli.parser(__doc__, reps=5)
    arguments.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
    arguments.add_argument("--warm", action="store_true", help="do not evict files before loads")
    arguments.add_argument(
        "--loads", type=int, default=3, help="loads of each snapshot per repetition (default 3)"
    )
    args = cli.parse(
        arguments, argv, SMOKE, lambda a: "--loads must be at least 1" if a.loads < 1 else None
    )
    out = run(args)
    text, out["checks"] = report(out)
    emit(out, text, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
