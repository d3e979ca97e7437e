"""The control plane at scale, simulated: N logical ranks (threads in a few processes, each a
client of one real ``torch.distributed.TCPStore``) run the real save and load protocols.

Each rank is a ``StoreComm`` over its own store client (counted by a thin wrapper) and runs
``save_protocol.run_save`` (a first save, then a cached one: same layout, values changed) and
``load_protocol.run_load``, as ``trainsnap.save`` / ``trainsnap.load`` do, on one POSIX root
(in ``/dev/shm`` when there is one). The metadata is shaped like TP 8 x PP 16 x DP (N / 128) of
the planner simulation's 20,000-parameter model (:mod:`benchmarks.planner_sim`); each shard
holds 2 x 2 elements. Reported per save and per load: store operations and bytes per rank and at
the coordinator, the coordinator's CPU time, each rank's time in the protocol's phases (trace
spans), heartbeat operations per rank per second, manifest bytes read from storage, and wall time,
against the targets of issue 17.

The simulation puts hundreds of ranks on each core, so two figures are taken with that in mind:
each rank's load planning is timed again alone for a few ranks a worker after the load (its
time during the load mostly measures its share of a crowded core), and a rank is taken as dead
after 600 s without a beat rather than 60 s (the beat itself is the default's, every 5 s).
The coordinator runs in a process of its own, as it does on a real job.

    python -m benchmarks.scale                      # 256, 1,024 and 4,096 ranks
    python -m benchmarks.scale --ranks 256,10000    # 10,000 is TP 8 x PP 16 x DP 78 = 9,984
    python -m benchmarks.scale --ranks 4096 --metadata-load  # loads skip the tensors' bytes
    python -m benchmarks.scale --smoke              # 16 ranks of a small model: does it run?
"""

from __future__ import annotations

import contextlib
import multiprocessing
import sys
import time
from typing import Any

from benchmarks._framework import cli
from benchmarks._framework.report import Check, Target, emit, facts, format_table, verdicts
from benchmarks._framework.scale_ranks import STORE_TIMEOUT, _raise_open_files, serve
from benchmarks._framework.state import MiB
from benchmarks._framework.system import load_average, machine_info, scratch_root
from benchmarks.planner_sim import World
from trainsnap.testing.loopback import master_store

KiB = 1024
TARGETS = {
    "cached_sent": Target("<", 1 * KiB),  # control-plane bytes sent per rank
    "cached_ingest": Target("<", 16),  # MiB into the coordinator
    "cached_plan": Target("<", 0.5),  # seconds
    "first_plan": Target("<", 5.0),  # seconds
    "manifest_read": Target("<=", 2.0),  # manifest bytes read from storage / manifest size
    "load_plan": Target("<", 0.05),  # seconds, each rank
    "load_memory": Target("<", 4),  # MiB of metadata per rank
    "heartbeat": Target("<=", 0.5),  # store operations per rank per second
}
SMOKE = {"ranks": "16", "processes": 2, "tp": 2, "pp": 2, "params_per_stage": 20}
PHASES = ("save", "change", "save", "load")


def world_of(ranks: int, tp: int, pp: int, params_per_stage: int) -> World:
    """TP x PP x DP with DP = ranks // (TP x PP): the nearest world not above ``ranks``."""
    return World(tp, pp, max(1, ranks // (tp * pp)), params_per_stage)


def run_world(
    world: World,
    processes: int,
    root: str,
    load_timeout: float,
    memory_gib: float,
    load_data: bool = True,
) -> dict[str, Any]:
    """One simulation: the store, the workers, the phases; every phase's figures."""
    _raise_open_files()
    # IPv4 only (see trainsnap.testing.loopback); on every loopback address past 8,000 ranks
    master = master_store(timeout=STORE_TIMEOUT, host=_store_host(world.size, 0))
    context = multiprocessing.get_context("spawn")
    # The coordinator (rank 0) in a process of its own, as on a real job: its threads do not
    # share an interpreter lock with hundreds of other ranks'.
    rest = world.size - 1
    bounds = [0, *(1 + rest * p // processes for p in range(processes + 1))]
    pipes, workers = [], []
    started = time.perf_counter()
    for p in range(len(bounds) - 1):
        parent, child = context.Pipe()
        ranks = range(bounds[p], bounds[p + 1])
        # Past ~8,000 ranks each worker's clients connect to an address of its own: 3
        # connections a rank exhaust the ephemeral ports of one address pair. (Not below:
        # connecting to 127.0.0.2 and up waits on a reverse name lookup.)
        host = _store_host(world.size, p + 1)
        proc = context.Process(
            target=serve,
            args=(
                child,
                world,
                ranks,
                host,
                master.port,
                root,
                int(memory_gib * 2**30 / processes),
                load_data,
            ),
        )
        proc.start()
        pipes.append(parent)
        workers.append(proc)
    results: dict[str, Any] = {"world": world.size, "tp": world.tp, "pp": world.pp, "dp": world.dp}
    results["load_data"] = load_data
    try:
        for pipe in pipes:
            assert pipe.recv() == "ready"
        results["build_s"] = time.perf_counter() - started
        print(f"  {world.size} ranks built in {results['build_s']:.1f} s", flush=True)
        for name, phase, step in [("connect", "connect", 0), *_phases()]:
            timeout = load_timeout if phase == "load" else 3600.0
            results[name] = _phase(pipes, phase, step, timeout)
            _progress(name, results[name])
            if results[name].get("aborted"):
                break
    finally:
        for pipe, proc in zip(pipes, workers, strict=True):
            if proc.is_alive():
                with contextlib.suppress(OSError):
                    pipe.send(None)
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        del master
    return results


def _store_host(ranks: int, worker: int) -> str:
    """Where worker ``worker`` (1 and up) connects, or (0) where the store listens."""
    if ranks <= 8000:
        return "127.0.0.1"
    return "0.0.0.0" if worker == 0 else f"127.0.0.{worker}"


def _phases() -> list[tuple[str, str, int]]:
    return [
        ("first save", "save", 100),
        ("change", "change", 0),
        ("cached save", "save", 101),
        ("load", "load", 0),
    ]


def _phase(pipes: list[Any], phase: str, step: int, timeout: float) -> dict[str, Any]:
    started = time.perf_counter()
    for pipe in pipes:
        pipe.send((phase, step))
    answers = []
    for pipe in pipes:
        left = timeout - (time.perf_counter() - started)
        if left <= 0 or not pipe.poll(left):
            return {"aborted": f"not done within {timeout:.0f} s", "wall_s": timeout}
        try:
            answers.append(pipe.recv())
        except EOFError:
            return {"aborted": "a worker went past its memory limit (--memory-gib)", "wall_s": 0.0}
    wall = time.perf_counter() - started
    records = {r: rec for answer in answers for r, rec in answer["records"].items()}
    return {
        "wall_s": wall,
        "records": records,
        "manifest_bytes": sum(a["manifest_bytes"] for a in answers),
        "report_bytes": sum(a["report_bytes"] for a in answers),
        "plan_s": [s for a in answers for s in a["plan_s"]],
        "rss_growth": [a["rss_peak"] - a["rss_start"] for a in answers],
        "ranks_per_process": [len(a["records"]) for a in answers],
    }


def _progress(name: str, phase: dict[str, Any]) -> None:
    errors = [r for r, rec in phase.get("records", {}).items() if rec["error"]]
    extra = (
        f", {len(errors)} rank(s) failed: {phase['records'][errors[0]]['error'][:300]}"
        if errors
        else ""
    )
    print(f"  {name}: {phase['wall_s']:.1f} s{extra}{phase.get('aborted', '')}", flush=True)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else float("nan")


def summarize(results: dict[str, Any], manifest_size: int) -> dict[str, Any]:
    """The figures of each phase: per rank (median, max over the ranks but the coordinator) and
    at the coordinator (rank 0)."""
    out: dict[str, Any] = {"world": results["world"], "build_s": results.get("build_s")}
    out["load_data"] = results.get("load_data", True)
    out["manifest_size"] = manifest_size
    for name in ("first save", "cached save", "load"):
        phase = results.get(name)
        if phase is None or phase.get("aborted") or not phase.get("records"):
            out[name] = {"skipped": (phase or {}).get("aborted", "not run")}
            continue
        records = phase["records"]
        others = [rec for r, rec in records.items() if r != 0]
        coordinator = records[0]

        def per_rank(kind: str, field: str, recs: list[dict[str, Any]] = others) -> list[float]:
            return [rec["counts"][kind][field] for rec in recs]

        wall = phase["wall_s"]
        beats = sum(per_rank("heartbeat", "adds", list(records.values())))
        liveness = sum(per_rank("heartbeat", "ops", list(records.values())))
        spans: dict[str, list[float]] = {}
        for rec in records.values():
            for span, seconds in rec["spans"].items():
                spans.setdefault(span, []).append(seconds)
        # The first process holds the coordinator alone, which reads the whole manifest.
        growth = [
            g / n
            for g, n in zip(phase["rss_growth"][1:], phase["ranks_per_process"][1:], strict=True)
            if n
        ]
        out[name] = {
            "wall_s": wall,
            "errors": sum(1 for rec in records.values() if rec["error"]),
            "first_error": next((rec["error"] for rec in records.values() if rec["error"]), None),
            "ops_rank_median": _median(per_rank("exchange", "ops")),
            "ops_rank_max": max(per_rank("exchange", "ops"), default=0),
            "sent_rank_median": _median(per_rank("exchange", "sent")),
            "sent_rank_max": max(per_rank("exchange", "sent"), default=0),
            "meta_sent_rank_max": max(
                (rec["counts"]["sent_by_tag"].get("meta", 0) for rec in others), default=0
            ),
            "report_sent_rank_max": max(
                (rec["counts"]["sent_by_tag"].get("report", 0) for rec in others), default=0
            ),
            "received_rank_max": max(per_rank("exchange", "received"), default=0),
            "coordinator_ops": coordinator["counts"]["exchange"]["ops"],
            "coordinator_ingest": coordinator["counts"]["exchange"]["received"],
            "coordinator_sent": coordinator["counts"]["exchange"]["sent"],
            "coordinator_cpu_s": coordinator["cpu_s"],
            "rank_cpu_median": _median([rec["cpu_s"] for rec in others]),
            "rank_cpu_max": max((rec["cpu_s"] for rec in others), default=0.0),
            "planning_alone": [
                rec["planning_alone_s"] for rec in others if "planning_alone_s" in rec
            ],
            "planning_cpu_median": _median([rec.get("planning_cpu_s", 0.0) for rec in others]),
            "planning_cpu_max": max(
                (rec.get("planning_cpu_s", 0.0) for rec in others), default=0.0
            ),
            "beats_rank_s": beats / len(records) / wall,
            "heartbeat_ops_rank_s": liveness / len(records) / wall,
            "coordinator_plan_s": phase["plan_s"][-1]
            if phase["plan_s"] and name != "load"
            else None,
            "spans": {s: (_median(v), max(v)) for s, v in spans.items()},
            "manifest_read_bytes": phase["manifest_bytes"],
            "report_read_bytes": phase["report_bytes"],
            "rss_growth_per_rank": max(growth, default=0.0),
            "coordinator_rss_growth": phase["rss_growth"][0],
        }
    return out


def _cell(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}{unit}"
    return f"{value:,}{unit}"


def _row_sources() -> list[tuple[str, str, Any, str | None]]:
    """(label, phase, figure of the phase's summary, target name)."""

    def span(name: str, which: int) -> Any:
        return lambda s: s["spans"].get(name, (None, None))[which]

    rows: list[tuple[str, str, Any, str | None]] = []
    for phase in ("first save", "cached save"):
        rows += [
            (f"{phase}: wall (s)", phase, lambda s: s["wall_s"], None),
            (
                f"{phase}: coordinator plan (s)",
                phase,
                lambda s: s["coordinator_plan_s"],
                "first_plan" if phase == "first save" else "cached_plan",
            ),
            (f"{phase}: coordinator CPU (s)", phase, lambda s: s["coordinator_cpu_s"], None),
            (f"{phase}: rank describe median (s)", phase, span("capture", 0), None),
            (f"{phase}: rank describe max (s)", phase, span("capture", 1), None),
            (f"{phase}: store ops per rank (max)", phase, lambda s: s["ops_rank_max"], None),
            (
                f"{phase}: bytes sent per rank (max)",
                phase,
                lambda s: s["sent_rank_max"],
                "cached_sent" if phase == "cached save" else None,
            ),
            (
                f"{phase}: of which its description (max)",
                phase,
                lambda s: s["meta_sent_rank_max"],
                None,
            ),
            (
                f"{phase}: of which its write report (max)",
                phase,
                lambda s: s["report_sent_rank_max"],
                None,
            ),
            (f"{phase}: coordinator store ops", phase, lambda s: s["coordinator_ops"], None),
            (
                f"{phase}: write reports read from storage (MiB)",
                phase,
                lambda s: s["report_read_bytes"] / MiB,
                None,
            ),
            (
                f"{phase}: coordinator ingest (MiB)",
                phase,
                lambda s: s["coordinator_ingest"] / MiB,
                "cached_ingest" if phase == "cached save" else None,
            ),
            (f"{phase}: coordinator sent (B)", phase, lambda s: s["coordinator_sent"], None),
            (
                f"{phase}: heartbeat ops per rank per s",
                phase,
                lambda s: s["heartbeat_ops_rank_s"],
                "heartbeat",
            ),
        ]
    rows += [
        ("load: wall (s)", "load", lambda s: s["wall_s"], None),
        ("load: coordinator CPU (s)", "load", lambda s: s["coordinator_cpu_s"], None),
        ("load: rank open median, wall (s)", "load", span("open", 0), None),
        # Each rank's own work (thread CPU time: its wall time is mostly its turn at the GIL
        # among the worker's threads): receiving its part, planning, reading, applying.
        ("load: rank CPU, whole load, median (s)", "load", lambda s: s["rank_cpu_median"], None),
        ("load: rank CPU, whole load, max (s)", "load", lambda s: s["rank_cpu_max"], None),
        ("load: rank CPU, planning, median (s)", "load", lambda s: s["planning_cpu_median"], None),
        ("load: rank CPU, planning, max (s)", "load", lambda s: s["planning_cpu_max"], None),
        # The same planning of a few ranks a worker, run again alone after the load: the
        # figure above is inflated by hundreds of threads sharing a core (and its caches).
        (
            "load: rank CPU, planning alone, median (s)",
            "load",
            lambda s: _median(s["planning_alone"]),
            None,
        ),
        (
            "load: rank CPU, planning alone, max (s)",
            "load",
            lambda s: max(s["planning_alone"], default=float("nan")),
            "load_plan",
        ),
        ("load: store ops per rank (max)", "load", lambda s: s["ops_rank_max"], None),
        ("load: bytes received per rank (max)", "load", lambda s: s["received_rank_max"], None),
        ("load: coordinator ingest (B)", "load", lambda s: s["coordinator_ingest"], None),
        (
            "load: manifest bytes read / manifest size",
            "load",
            lambda s: s["manifest_read_bytes"] / s["manifest_size"],
            "manifest_read",
        ),
        (
            "load: memory growth per rank (MiB)",
            "load",
            lambda s: s["rss_growth_per_rank"] / MiB,
            "load_memory",
        ),
        (
            "load: coordinator memory growth (MiB)",
            "load",
            lambda s: s["coordinator_rss_growth"] / MiB,
            None,
        ),
        (
            "load: heartbeat ops per rank per s",
            "load",
            lambda s: s["heartbeat_ops_rank_s"],
            "heartbeat",
        ),
    ]
    return rows


def report(summaries: list[dict[str, Any]]) -> tuple[str, list[Check]]:
    """The table (a column per world) and the checks of the largest world with each figure."""
    headers = ["figure", *[f"{s['world']:,} ranks" for s in summaries], "target", "result"]
    rows, checks = [], []
    for label, phase, figure, target_name in _row_sources():
        values = []
        for s in summaries:
            part = s.get(phase, {})
            values.append(
                None if "skipped" in part else figure({**part, "manifest_size": s["manifest_size"]})
            )
        target = TARGETS.get(target_name) if target_name else None
        measured = [(s, v) for s, v in zip(summaries, values, strict=True) if v is not None]
        result = "-"
        if target is not None and measured:
            s, v = measured[-1]
            check = Check(f"{s['world']:,}-rank {label}", float(v), target)
            checks.append(check)
            result = f"{check.result} at {s['world']:,}"
        rows.append([label, *[_cell(v) for v in values], str(target) if target else "-", result])
    notes = [
        f"{s['world']:,} ranks, load: metadata only (--metadata-load: planned, values read, "
        "tensors' bytes not read)"
        for s in summaries
        if not s.get("load_data", True)
    ]
    notes += [
        f"{s['world']:,} ranks, {phase}: {s[phase]['skipped']}"
        for s in summaries
        for phase in ("first save", "cached save", "load")
        if "skipped" in s[phase]
    ]
    notes += [
        f"{s['world']:,} ranks, {phase}: {s[phase]['errors']} rank(s) failed: "
        f"{s[phase]['first_error'][:300]}"
        for s in summaries
        for phase in ("first save", "cached save", "load")
        if s[phase].get("errors")
    ]
    return "\n".join([format_table(headers, rows), *notes]), checks


def _manifest_size(root: str) -> int:
    import pathlib

    sizes = [p.stat().st_size for p in pathlib.Path(root).glob("snapshots/*/manifest*")]
    return max(sizes, default=0)


def main(argv: list[str] | None = None) -> int:
    arguments = cli.parser(__doc__, seed=False)
    arguments.add_argument("--ranks", default="256,1024,4096", help="worlds, comma-separated")
    arguments.add_argument(
        "--processes",
        type=int,
        default=4,
        help="worker processes besides the coordinator's (default 4)",
    )
    arguments.add_argument("--tp", type=int, default=8)
    arguments.add_argument("--pp", type=int, default=16)
    arguments.add_argument("--params-per-stage", type=int, default=1250)
    arguments.add_argument(
        "--load-timeout",
        type=float,
        default=900.0,
        help="seconds a load may take before it is abandoned (and reported so)",
    )
    arguments.add_argument(
        "--memory-gib",
        type=float,
        default=14.0,
        help="memory all workers together may use; a phase past it is abandoned (default 14)",
    )
    arguments.add_argument(
        "--metadata-load",
        action="store_true",
        help="loads plan and read values but skip the tensors' bytes (the data path of "
        "thousands of simulated ranks on a few cores outlasts the metadata being measured)",
    )
    args = cli.parse(arguments, argv, SMOKE)
    machine = machine_info() | {"loadavg_start": load_average()}
    print(facts("machine", machine), flush=True)
    summaries = []
    worlds = [int(n) for n in str(args.ranks).split(",")]
    for ranks in worlds:
        world = world_of(ranks, args.tp, args.pp, args.params_per_stage)
        print(
            f"control plane simulation: {world.size} ranks (TP {world.tp} x PP {world.pp} x "
            f"DP {world.dp}), {world.pp * world.params_per_stage} parameters",
            flush=True,
        )
        with scratch_root(args.dir or _shm(), 0, "scale-") as root:
            started = time.perf_counter()
            results = run_world(
                world,
                min(args.processes, world.size),
                str(root),
                args.load_timeout,
                args.memory_gib,
                load_data=not args.metadata_load,
            )
            summary = summarize(results, _manifest_size(str(root)))
            summary["run_s"] = time.perf_counter() - started
        print(f"  done in {summary['run_s']:.0f} s", flush=True)
        summaries.append(summary)
        if len(summaries) < len(worlds):  # so far, in case a larger world never ends
            print(report(summaries)[0], flush=True)
    table, checks = report(summaries)
    text = "\n".join(
        ["", "== control plane at scale", table, "", "== targets", verdicts(checks, digits=3)]
    )
    emit({"machine": machine, "summaries": summaries, "checks": checks}, text, args.json)
    return 0


def _shm() -> str | None:
    import os

    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


if __name__ == "__main__":
    sys.exit(main())
