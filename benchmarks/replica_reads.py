"""Bytes a restore pulls from storage when ranks hold replicas: trainsnap with replicas sharing
their reads, trainsnap by default, and torch.distributed.checkpoint, on 4 gloo ranks.

Two layouts of the DTensor state of ``benchmarks.distributed`` (``--gib`` GiB, global):

- ``ddp``: every tensor replicated on all 4 ranks (a data-parallel model: 4 replicas);
- ``mesh``: the (dp=2, tp=2) placements of ``benchmarks.distributed`` (2 replicas of most bytes).

Each layout is saved once by each method; then every repetition loads it with each method, in
an order rotating between repetitions (after ``--warmup`` uncounted ones: the first load of a
process also reads the modules it imports), into zeroed destinations, the page cache evicted
first. Each rank counts the bytes its read syscalls returned during the load (``rchar`` of
``/proc/self/io``: it counts file reads, not the sockets the replicas exchange over), the bytes
it made the device read (``read_bytes``: what the disk served; a page already cached by another
rank costs none) and the load's time between barriers. Reported: both summed over the ranks /
the bytes the method stored (target <= 1.3 for trainsnap-shared's reads), the slowest rank's
load time (median), and
every load checked bit for bit in the first repetition. The ranks of this benchmark share one
host and its page cache, so reading alone is cheaper here than on a cluster, where each node
pulls what its ranks read from storage: ``trainsnap`` (the default, sharing only where it
helps) does not share here, ``trainsnap-shared`` is forced to.

    python -m benchmarks.replica_reads                 # 0.5 GiB, 3 repetitions
    python -m benchmarks.replica_reads --smoke         # tiny: does it run?
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
from pathlib import Path
from typing import Any

from benchmarks._framework import cli
from benchmarks._framework.adapters import Dcp, Trainsnap
from benchmarks._framework.method import Method, rotated
from benchmarks._framework.report import Check, Target, emit, format_table, verdicts
from benchmarks._framework.sharded_state import (
    Spec,
    build_state,
    check_state,
    state_specs,
)
from benchmarks._framework.state import GiB
from benchmarks._framework.system import evict, iter_files, machine_info, scratch_root
from benchmarks.distributed import _barrier_timer
from trainsnap.testing import assert_all_ok, run_ranks

WORLD = 4
TARGET = 1.3
"""trainsnap's bytes read summed over ranks / bytes stored, at most."""
SMOKE = {"gib": 0.01, "reps": 1}


def _io() -> tuple[int, int]:
    """(bytes this process's read syscalls returned, bytes it made the device read)."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ", 1) for line in f.read().splitlines())
    return int(fields["rchar"]), int(fields["read_bytes"])


def _specs(layout: str, gib: float) -> list[Spec]:
    specs = state_specs(gib)
    if layout == "ddp":
        return [dataclasses.replace(spec, placement="RR") for spec in specs]
    return specs


class _Shared(Trainsnap):
    """trainsnap with replicas' read sharing forced on (``TRAINSNAP_REPLICA_READS=2``). By
    default (1) it is on only where it helps: on one host reading a local file system the
    page cache already shares what one replica read, so this host's default is not to share."""

    def load(self, destination: Any, directory: Path) -> None:
        from trainsnap import tunables

        tunables.set_for_testing(dataclasses.replace(tunables.get(), replica_reads=2))
        try:
            super().load(destination, directory)
        finally:
            tunables.set_for_testing(None)


def _methods() -> list[Method]:
    return [Trainsnap(), _Shared(name="trainsnap-shared"), Dcp(8, distributed=True)]


def rank_main(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    """Save the layout with each method, then load it ``reps`` times with each."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    specs = _specs(config["layout"], config["gib"])
    root = Path(config["dir"])
    methods = _methods()
    saved = {"trainsnap": root / "trainsnap", "dcp": root / "dcp"}
    for method in methods:
        if method.name in saved:
            _barrier_timer(
                lambda m=method: m.save(build_state(specs, mesh, fill=True), saved[m.name])
            )
    records: list[dict[str, Any]] = []
    for repetition in range(-config["warmup"], config["reps"]):
        for method in rotated(methods, repetition):
            directory = saved["dcp" if method.name == "dcp" else "trainsnap"]
            destination = build_state(specs, mesh, fill=False)
            _barrier_timer(lambda d=directory: evict(d) if rank == 0 else None)
            before = _io()
            seconds = _barrier_timer(lambda m=method, d=directory, t=destination: m.load(t, d))
            after = _io()
            read, device = after[0] - before[0], after[1] - before[1]
            if repetition == 0:
                check_state(specs, destination, mesh, f"{method.name} load")
            if repetition >= 0:
                records.append(
                    {"method": method.name, "seconds": seconds, "read": read, "device": device}
                )
    return {"records": records}


def _stored(directory: Path) -> int:
    return sum(path.stat().st_size for path in iter_files(directory))


def run_layout(layout: str, args: Any, scratch: Path) -> dict[str, Any]:
    directory = scratch / layout
    directory.mkdir()
    config = {
        "layout": layout,
        "gib": args.gib,
        "reps": args.reps,
        "warmup": args.warmup,
        "dir": str(directory),
    }
    per_rank = assert_all_ok(
        run_ranks(rank_main, WORLD, args=(config,), timeout=1800, rendezvous="tcp")
    )
    stored = {"trainsnap": _stored(directory / "trainsnap"), "dcp": _stored(directory / "dcp")}
    shutil.rmtree(directory)
    out: dict[str, Any] = {}
    for name in [m.name for m in _methods()]:
        rows = [[r for r in rank["records"] if r["method"] == name] for rank in per_rank]
        reads = [sum(rank[i]["read"] for rank in rows) for i in range(args.reps)]
        device = [sum(rank[i]["device"] for rank in rows) for i in range(args.reps)]
        seconds = [max(rank[i]["seconds"] for rank in rows) for i in range(args.reps)]
        base = stored["dcp" if name == "dcp" else "trainsnap"]
        out[name] = {
            "stored": base,
            "read_ratio": statistics.median(reads) / base,
            "device_ratio": statistics.median(device) / base,
            "seconds": statistics.median(seconds),
            "all_seconds": seconds,
        }
    return out


def report(out: dict[str, Any]) -> tuple[str, list[Check]]:
    lines = [f"machine: {out['machine']}", f"state: {out['gib']} GiB global, {WORLD} gloo ranks"]
    checks: list[Check] = []
    for layout, methods in out["layouts"].items():
        rows = [
            [
                name,
                m["stored"] / 2**20,
                m["read_ratio"],
                m["device_ratio"],
                m["seconds"],
                " ".join(f"{s:.3f}" for s in m["all_seconds"]),
            ]
            for name, m in methods.items()
        ]
        lines += ["", f"{layout}:"]
        lines.append(
            format_table(
                [
                    "method",
                    "stored MiB",
                    "read / stored",
                    "device read / stored",
                    "load s (median)",
                    "load s (each)",
                ],
                rows,
            )
        )
        shared, default = methods["trainsnap-shared"], methods["trainsnap"]
        lines.append(
            f"  load time, trainsnap-shared / trainsnap (default: this host does not share): "
            f"{shared['seconds'] / default['seconds']:.2f}; trainsnap / dcp: "
            f"{default['seconds'] / methods['dcp']['seconds']:.2f}"
        )
        checks.append(
            Check(
                f"{layout}: trainsnap-shared bytes read / stored",
                shared["read_ratio"],
                Target("<=", TARGET),
            )
        )
    lines += ["", verdicts(checks)]
    return "\n".join(lines), checks


def main(argv: list[str] | None = None) -> int:
    arguments = cli.parser(__doc__, reps=3, seed=False)
    arguments.add_argument("--gib", type=float, default=0.5, help="global state size (GiB)")
    arguments.add_argument(
        "--warmup", type=int, default=1, help="repetitions run first, not counted (default 1)"
    )
    arguments.add_argument("--layouts", default="ddp,mesh", help="comma-separated: ddp, mesh")
    args = cli.parse(arguments, argv, SMOKE)
    out: dict[str, Any] = {"machine": machine_info(), "gib": args.gib, "layouts": {}}
    with scratch_root(args.dir, 3 * args.gib * GiB, "replica-reads-") as scratch:
        for layout in args.layouts.split(","):
            out["layouts"][layout] = run_layout(layout, args, scratch)
    text, checks = report(out)
    emit(out, text, args.json)
    return 0 if args.smoke or all(check.result != "MISSED" for check in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
