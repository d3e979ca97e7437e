"""The MLPerf Storage v3.0 checkpointing workload: a Llama model's checkpoint written and read by
every rank, with raw per-rank ``torch.save`` files, DCP and trainsnap on the same bytes.

The workload (as MLPerf Storage's checkpointing benchmark, DLIO, defines it):

- **The model** is sized by the Llama formula from ``--hidden``, ``--ffn``, ``--heads``,
  ``--kv-heads``, ``--layers`` and ``--vocab``: per layer the q and o projections (hidden x
  hidden), k and v (hidden x hidden / heads x kv_heads), the three MLP matrices (hidden x ffn)
  and two norms (hidden); the embedding and the output head (vocab x hidden, untied) and the
  final norm. Each parameter is checkpointed as fp16 weights (the model) and an fp32 master copy,
  ``exp_avg`` and ``exp_avg_sq`` (the optimizer): 14 bytes a parameter. The default (hidden
  1024, ffn 3584, 8 heads, 2 kv heads, 4 layers, vocab 10,816) is 1.000 GiB a checkpoint.
- **The parallelism** is ``--tp`` x ``--pp`` x ``--dp`` ranks (a (pp, tp, dp) mesh, the rank
  ``(pp_index * tp + tp_index) * dp + dp_index``): pipeline stages own consecutive layers (the
  embedding the first, the head and final norm the last), tensor parallelism splits every
  parameter in ``tp`` equal parts, and ``--zero`` says what data parallelism shards: stage 3 the
  weights and the optimizer, stages 1 and 2 the optimizer only (the weights are replicated over
  dp), stage 0 nothing. Every parameter is a flat DTensor ``[tp, n]`` on the stage's (tp, dp)
  mesh (``Shard(0)`` over tp; ``Shard(1)`` over dp where sharded, else ``Replicate()``; ``n``
  padded to a multiple of dp as ZeRO pads). Replicated parts are stored once by every method
  (by the dp-rank 0 of the replicas for the raw files), so each checkpoint stores the model's
  bytes once.
- **Fresh random bytes** fill every rank's shards before each checkpoint (untimed).

Methods, each writing every checkpoint into its own fresh directory:

- ``raw``: what DLIO does with PyTorch: two files per rank, the model's and the optimizer's
  (``model_states-rank<r>.pt``, ``optim_states-rank<r>.pt``, the rank's local shards as a dict),
  each ``torch.save``d and fsynced, then the directory fsynced; read back with ``torch.load``
  into new tensors (nothing verified, nothing placed).
- ``dcp``: ``torch.distributed.checkpoint.save`` with ``FileSystemWriter(thread_count=<io
  threads>, sync_files=True)`` / ``dcp.load`` into the DTensors in place.
- ``trainsnap``: ``trainsnap.save`` (checksums on) / ``trainsnap.load`` into the DTensors in
  place, every block verified.

Each checkpoint: the bytes refilled, every method saves (in an order rotating from one checkpoint
to the next, so that each sees the same noise), then every method loads (rotating too) after the
page cache is dropped (rank 0 syncs and writes ``3`` to ``/proc/sys/vm/drop_caches`` where it may,
else drops the checkpoint's files with ``posix_fadvise(DONTNEED)``). Every phase is timed on every
rank between two barriers; throughput is the checkpoint's bytes / the slowest rank's time, given
as mean +- stdev over the checkpoints. The first checkpoint's loads are checked bit for bit.
trainsnap's phases (``trainsnap.trace``: capture, plan, write, commit; resolve, open, read) are
reported per checkpoint for the slowest rank, with each method's process CPU time per call;
``--profile N`` adds a cProfile of trainsnap's last save and load (each rank's calling thread).
Run with ``--dp 1`` to compare a rank's fixed costs with one process holding the same tensors.

For context, the published v3.0 results of a single node's local NVMe (8B model): 15.9 GiB/s
write, 17.8 GiB/s read; this benchmark's small scale tests the software path on one machine.

    python -m benchmarks.mlperf_checkpointing        # 1 GiB, 4 ranks ZeRO-3, 5 checkpoints
    python -m benchmarks.mlperf_checkpointing --dp 1 # the same tensors in one process
    python -m benchmarks.mlperf_checkpointing --tp 2 --dp 2 --zero 1 --checkpoints 3
    python -m benchmarks.mlperf_checkpointing --smoke  # tiny: does it run and verify?

The ranks are spawned by ``trainsnap.testing.run_ranks`` (gloo, a TCPStore on loopback).
Checkpoints live in a temporary directory under ``--dir``, removed at the end.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import shutil
import statistics
import sys
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks._framework import cli
from benchmarks._framework.adapters import Dcp, Trainsnap
from benchmarks._framework.method import Measurements, Method, State, rotated
from benchmarks._framework.report import Check, Target, emit, facts, format_table, verdicts
from benchmarks._framework.state import GiB, bitwise_problem, raise_problems
from benchmarks._framework.system import evict, fsync_dir, load_average, machine_info, scratch_root
from trainsnap import trace, tunables
from trainsnap.testing import assert_all_ok, run_ranks

warnings.filterwarnings("ignore", category=FutureWarning)

METHODS = ("raw", "dcp", "trainsnap")
TARGETS = {"raw": Target(">=", 1.0), "dcp": Target(">=", 1.5)}
"""trainsnap's throughput / the method's, at least (write and read)."""
SAVE_PHASES = ("capture", "plan", "write", "commit")
LOAD_PHASES = ("resolve", "open", "read")
PUBLISHED = "MLPerf Storage v3.0, a single node's local NVMe, 8B model: write 15.9 GiB/s, read 17.8"
SMOKE = {"hidden": 64, "ffn": 224, "layers": 2, "vocab": 128, "dp": 2, "checkpoints": 1}
OPTIMIZER = ("master", "exp_avg", "exp_avg_sq")
CHECKED: list[str] = []
"""The methods whose load of the first checkpoint this rank checked bit for bit."""


# == the model =====================================================================================


@dataclass(frozen=True, slots=True)
class Model:
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    layers: int
    vocab: int

    def parameters(self) -> list[tuple[str, int, int]]:
        """(name, elements, layer) of every parameter; the embedding is layer -1, the head
        and final norm layer ``layers`` (what the first and last pipeline stages own)."""
        kv = self.hidden // self.heads * self.kv_heads
        out = [("embed", self.vocab * self.hidden, -1)]
        for layer in range(self.layers):
            shapes = {"wq": self.hidden**2, "wk": self.hidden * kv, "wv": self.hidden * kv}
            shapes |= {"wo": self.hidden**2, "w1": self.hidden * self.ffn}
            shapes |= {"w2": self.hidden * self.ffn, "w3": self.hidden * self.ffn}
            shapes |= {"attn_norm": self.hidden, "ffn_norm": self.hidden}
            out += [(f"layers.{layer}.{name}", n, layer) for name, n in shapes.items()]
        return [
            *out,
            ("norm", self.hidden, self.layers),
            ("lm_head", self.vocab * self.hidden, self.layers),
        ]

    def nparams(self) -> int:
        return sum(n for _, n, _ in self.parameters())


@dataclass(frozen=True, slots=True)
class Layout:
    """The parallelism and what ZeRO shards."""

    tp: int
    pp: int
    dp: int
    zero: int

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(pp, tp, dp) index of ``rank``."""
        return rank // (self.tp * self.dp), rank // self.dp % self.tp, rank % self.dp

    def stage_of(self, layer: int, layers: int) -> int:
        if layer < 0:
            return 0
        if layer >= layers:
            return self.pp - 1
        return layer * self.pp // layers


@dataclass(frozen=True, slots=True)
class Piece:
    """One checkpointed tensor: a parameter's weights (fp16) or one of its optimizer states."""

    key: str
    file: str  # "model" or "optim": the raw method's file
    dtype: torch.dtype
    columns: int  # n: the global shape is [tp, n]
    sharded: bool  # over dp


def pieces_of(model: Model, layout: Layout, stage: int) -> list[Piece]:
    """The tensors pipeline stage ``stage`` holds, in a fixed order."""
    out = []
    for name, elements, layer in model.parameters():
        if layout.stage_of(layer, model.layers) != stage:
            continue
        per_tp = -(-elements // layout.tp)
        padded = -(-per_tp // layout.dp) * layout.dp
        out.append(Piece(f"model.{name}", "model", torch.float16, padded, layout.zero >= 3))
        for state in OPTIMIZER:
            key = f"optim.{name}.{state}"
            out.append(Piece(key, "optim", torch.float32, padded, layout.zero >= 1))
    return out


def checkpoint_bytes(model: Model, layout: Layout) -> int:
    """The bytes one checkpoint stores (every replicated part once)."""
    pieces = [p for stage in range(layout.pp) for p in pieces_of(model, layout, stage)]
    return sum(layout.tp * p.columns * p.dtype.itemsize for p in pieces)


# == on each rank ==================================================================================


@dataclass
class RankState:
    """This rank's DTensors (source and destination) and which of them its raw files hold."""

    source: State
    destination: State
    pieces: list[Piece]
    owned: dict[str, list[str]]  # raw file -> keys this rank writes
    coordinates: tuple[int, int, int]


def build(model: Model, layout: Layout, rank: int) -> RankState:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    shape = (layout.pp, layout.tp, layout.dp)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "tp", "dp"))["tp", "dp"]
    stage, _, dp_index = layout.coordinates(rank)
    pieces = pieces_of(model, layout, stage)
    source, destination = {}, {}
    owned: dict[str, list[str]] = {"model": [], "optim": []}
    for piece in pieces:
        columns = piece.columns // layout.dp if piece.sharded else piece.columns
        placements = [Shard(0), Shard(1) if piece.sharded else Replicate()]
        size = torch.Size((layout.tp, piece.columns))
        for state in (source, destination):
            local = torch.zeros((1, columns), dtype=piece.dtype)
            state[piece.key] = DTensor.from_local(
                local, mesh, placements, run_check=False, shape=size, stride=(piece.columns, 1)
            )
        if piece.sharded or dp_index == 0:
            owned[piece.file].append(piece.key)
    return RankState(source, destination, pieces, owned, layout.coordinates(rank))


def fill_random(rank_state: RankState, checkpoint: int, seed: int) -> None:
    """Fresh random bytes in every source shard; replicas of one part get the same bytes."""
    stage, tp_index, dp_index = rank_state.coordinates
    for piece in rank_state.pieces:
        shard = dp_index if piece.sharded else -1
        name = f"{seed}/{checkpoint}/{piece.key}/{stage}/{tp_index}/{shard}".encode()
        generator = torch.Generator().manual_seed(zlib.crc32(name))
        local = rank_state.source[piece.key].to_local()
        local.view(-1).view(torch.uint8).random_(0, 256, generator=generator)


class RawFiles(Method):
    """Two ``torch.save`` files a rank (model, optimizer), each fsynced; ``torch.load`` back."""

    name = label = "raw"
    verifiable = False

    def __init__(self, rank: int, owned: dict[str, list[str]]) -> None:
        self.rank, self.owned = rank, owned
        self.loaded: dict[str, torch.Tensor] = {}

    def _path(self, directory: Path, file: str) -> Path:
        return directory / f"{file}_states-rank{self.rank}.pt"

    def save(self, state: State, directory: Path) -> None:
        for file, keys in self.owned.items():
            with open(self._path(directory, file), "wb") as f:
                torch.save({key: state[key].to_local() for key in keys}, f)
                f.flush()
                os.fsync(f.fileno())
        fsync_dir(directory)

    def load(self, destination: State, directory: Path) -> None:
        self.loaded = {}
        for file in self.owned:
            path = self._path(directory, file)
            self.loaded |= torch.load(path, map_location="cpu", mmap=False, weights_only=True)


def _timed(operation: Callable[[], object]) -> float:
    """This rank's seconds for ``operation``, started with every rank (rank 0 flushes earlier
    work's dirty pages first) and followed by a barrier."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        os.sync()
    dist.barrier()
    start = time.perf_counter()
    operation()
    seconds = time.perf_counter() - start
    dist.barrier()
    return seconds


def drop_cache(directory: Path) -> str:
    """The page cache dropped (all of it where this process may; else the checkpoint's files)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        evict(directory)
        return "fadvise"


def _phases(first_event: int) -> dict[str, float]:
    """Seconds of the trace spans recorded since event ``first_event``, by name."""
    out: dict[str, float] = {}
    for event in trace.events()[first_event:]:
        out[event["name"]] = out.get(event["name"], 0.0) + event["dur"] / 1e6
    return out


def _check(rank_state: RankState, method: Method, rank: int) -> None:
    if isinstance(method, RawFiles):
        got = {key: tensor for key, tensor in method.loaded.items()}
        expected = {
            k: rank_state.source[k].to_local() for keys in method.owned.values() for k in keys
        }
    else:
        got = {k: t.to_local() for k, t in rank_state.destination.items()}
        expected = {k: t.to_local() for k, t in rank_state.source.items()}
    problems = [bitwise_problem(key, got[key], tensor) for key, tensor in expected.items()]
    raise_problems(f"{method.name} load of checkpoint 0, rank {rank}", problems)
    CHECKED.append(method.name)


PROFILES: dict[str, str] = {}
"""This rank's cProfile of trainsnap's calls (``--profile``), by metric."""


def _profiled(operation: Callable[[], object], metric: str, top: int) -> Callable[[], object]:
    """``operation`` under cProfile (the calling thread only: capture, plan, the exchanges and
    the commit, not the I/O threads' reads and writes); its top ``top`` functions by own time
    and by cumulative time go to :data:`PROFILES`."""

    def run() -> None:
        profiler = cProfile.Profile()
        profiler.enable()
        try:
            operation()
        finally:
            profiler.disable()
        buffer = io.StringIO()
        stats = pstats.Stats(profiler, stream=buffer).strip_dirs()
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats(top)
        PROFILES[metric] = buffer.getvalue()

    return run


def _one_call(
    method: Method,
    operation: Callable[[], object],
    results: Measurements,
    metric: str,
    profile: int = 0,
) -> None:
    first = len(trace.events())
    if profile and method.name == "trainsnap":
        operation = _profiled(operation, metric, profile)
    cpu = time.process_time()
    results.add(method.name, metric, _timed(operation))
    results.add(method.name, f"{metric}.cpu", time.process_time() - cpu)
    if method.name == "trainsnap":
        spans = _phases(first)
        for phase in SAVE_PHASES if metric == "save" else LOAD_PHASES:
            results.add("trainsnap", f"{metric}.{phase}", spans.get(phase, 0.0))


def checkpoint_round(
    rank: int,
    rank_state: RankState,
    methods: list[Method],
    root: Path,
    checkpoint: int,
    profile: int = 0,
) -> Measurements:
    import torch.distributed as dist

    results = Measurements()
    directories = {m.name: root / f"{m.name}-{checkpoint}" for m in methods}
    if rank == 0:
        for directory in directories.values():
            directory.mkdir(parents=True)
    dist.barrier()
    order = rotated(methods, checkpoint)
    results.orders.append([m.name for m in order])
    for method in order:
        save = lambda m=method: m.save(rank_state.source, directories[m.name])  # noqa: E731
        _one_call(method, save, results, "save", profile)
    for method in order:
        for tensor in rank_state.destination.values():
            tensor.to_local().zero_()
        dropped = drop_cache(directories[method.name]) if rank == 0 else None
        results.add(method.name, "fadvise", None if dropped is None else dropped == "fadvise")
        load = lambda m=method: m.load(rank_state.destination, directories[m.name])  # noqa: E731
        _one_call(method, load, results, "load", profile)
        if checkpoint == 0:
            _check(rank_state, method, rank)
        if isinstance(method, RawFiles):
            method.loaded = {}
    dist.barrier()
    if rank == 0:
        for directory in directories.values():
            shutil.rmtree(directory)
    return results


def rank_main(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    model, layout = Model(**config["model"]), Layout(**config["layout"])
    rank_state = build(model, layout, rank)
    methods: list[Method] = [
        RawFiles(rank, rank_state.owned),
        Dcp(config["threads"], distributed=True),
        Trainsnap(),
    ]
    trace.enable(rank)
    results = Measurements()
    root = Path(config["root"])
    for method in methods:
        method.setup()
    for checkpoint in range(config["checkpoints"]):
        fill_random(rank_state, checkpoint, config["seed"])
        last = checkpoint == config["checkpoints"] - 1
        profile = config["profile"] if last else 0
        one = checkpoint_round(rank, rank_state, methods, root, checkpoint, profile)
        for name, metrics in one.values.items():
            for metric, values in metrics.items():
                results.values.setdefault(name, {}).setdefault(metric, []).extend(values)
        results.orders += one.orders
    for method in methods:
        method.teardown()
    local = sum(t.to_local().nbytes for t in rank_state.source.values())
    out = {"rank": rank, "results": results, "local_bytes": local, "checked": CHECKED}
    return out | {"profiles": PROFILES if rank in (0, world_size - 1) else {}}


# == in the parent =================================================================================


def run(args: Any) -> dict[str, Any]:
    model = Model(args.hidden, args.ffn, args.heads, args.kv_heads, args.layers, args.vocab)
    layout = Layout(args.tp, args.pp, args.dp, args.zero)
    nbytes = checkpoint_bytes(model, layout)
    machine = machine_info() | {"loadavg_start": load_average()}
    print(facts("machine", machine))
    print(
        f"model: {model.nparams():,} parameters x 14 bytes = {nbytes / GiB:.3f} GiB a checkpoint; "
        f"tp={layout.tp} pp={layout.pp} dp={layout.dp} ZeRO-{layout.zero}: {layout.world} ranks",
        flush=True,
    )
    with scratch_root(args.dir, nbytes * 3.5, "trainsnap-mlperf-") as root:
        config = {
            "model": {f: getattr(model, f) for f in Model.__dataclass_fields__},
            "layout": {f: getattr(layout, f) for f in Layout.__dataclass_fields__},
            "root": str(root),
            "checkpoints": args.checkpoints,
            "seed": args.seed,
            "threads": tunables.get().io_threads,
            "profile": args.profile,
        }
        timeout = 600 + 300 * args.checkpoints * nbytes / GiB
        ranks = run_ranks(
            rank_main, layout.world, args=(config,), timeout=timeout, rendezvous="tcp"
        )
    per_rank = assert_all_ok(ranks)
    machine["loadavg_end"] = load_average()
    results = Measurements.slowest([record["results"] for record in per_rank])
    return {
        "machine": machine,
        "config": config | {"bytes": nbytes, "nparams": model.nparams()},
        "results": results,
        "local_bytes": [record["local_bytes"] for record in per_rank],
        "profiles": {r["rank"]: r["profiles"] for r in per_rank if r["profiles"]},
        "checked": sorted(set.intersection(*(set(record["checked"]) for record in per_rank))),
    }


# == the report ====================================================================================


def throughputs(results: Measurements, method: str, metric: str, nbytes: int) -> list[float]:
    return [nbytes / GiB / seconds for seconds in results.series(method, metric)]


def mean_stdev(values: list[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} +- {spread:.3f}"


def rate_lines(out: dict[str, Any]) -> tuple[list[str], list[Check]]:
    results, nbytes = out["results"], out["config"]["bytes"]
    rows, checks = [], []
    for name in METHODS:
        write = throughputs(results, name, "save", nbytes)
        read = throughputs(results, name, "load", nbytes)
        rows.append(
            [
                name,
                mean_stdev(write),
                mean_stdev(read),
                " ".join(f"{x:.2f}" for x in write),
                " ".join(f"{x:.2f}" for x in read),
            ]
        )
    for other in ("raw", "dcp"):
        for metric, word in (("save", "write"), ("load", "read")):
            mine = statistics.fmean(throughputs(results, "trainsnap", metric, nbytes))
            theirs = statistics.fmean(throughputs(results, other, metric, nbytes))
            checks.append(Check(f"trainsnap / {other} {word}", mine / theirs, TARGETS[other]))
    table = format_table(["method", "write GiB/s", "read GiB/s", "writes", "reads"], rows)
    return [
        "",
        "throughput (checkpoint bytes / slowest rank; mean +- stdev over checkpoints)",
        table,
        "",
        "ratios (means of the throughputs):",
        verdicts(checks, first="ratio"),
    ], checks


def phase_lines(out: dict[str, Any]) -> list[str]:
    results = out["results"]
    rows = []
    for metric, phases in (("save", SAVE_PHASES), ("load", LOAD_PHASES)):
        parts = [results.median("trainsnap", f"{metric}.{p}") for p in phases]
        cells = [f"{p} {1e3 * s:.1f}" for p, s in zip(phases, parts, strict=True)]
        total = results.median("trainsnap", metric)
        cpu = {m: results.median(m, f"{metric}.cpu") for m in METHODS}
        rows.append(
            [metric, f"{1e3 * total:.1f}", ", ".join(cells)] + [1e3 * cpu[m] for m in METHODS]
        )
    return [
        "",
        "trainsnap's phases (ms; each the median over the checkpoints of its slowest rank, from "
        f"trainsnap.trace), and each method's process CPU time per call (ms, slowest rank), "
        f"{out['config']['layout']}",
        format_table(["call", "total", "phases"] + [f"{m} cpu" for m in METHODS], rows, digits=1),
    ]


def report(out: dict[str, Any]) -> tuple[str, list[Check]]:
    config, machine, results = out["config"], out["machine"], out["results"]
    local = out["local_bytes"]
    fadvised = any(
        results.series(name, "fadvise") == [1.0] * config["checkpoints"] for name in METHODS
    )
    how = "fadvise on the checkpoint's files" if fadvised else "/proc/sys/vm/drop_caches"
    lines = [
        "",
        f"{config['bytes'] / GiB:.3f} GiB a checkpoint ({config['bytes']:,} bytes), "
        f"{config['checkpoints']} checkpoints, {len(local)} ranks (local bytes "
        f"{min(local):,}-{max(local):,}), page cache dropped before each read by {how}; "
        f"load average {machine['loadavg_start']} -> {machine['loadavg_end']}",
    ]
    rates, checks = rate_lines(out)
    lines += rates + phase_lines(out)
    lines += [
        "",
        "loads of the first checkpoint checked bit for bit on every rank: "
        + (", ".join(out["checked"]) or "none"),
        "orders: " + "; ".join(" ".join(o) for o in results.orders),
        "for context: " + PUBLISHED,
    ]
    for rank, profiles in out["profiles"].items():
        for metric, text in profiles.items():
            lines += ["", f"cProfile of trainsnap's {metric}, rank {rank} (calling thread):", text]
    return "\n".join(lines), checks


def main(argv: list[str] | None = None) -> int:
    arguments = cli.parser(__doc__)
    for name, default in (("hidden", 1024), ("ffn", 3584), ("heads", 8), ("kv-heads", 2)):
        arguments.add_argument(f"--{name}", type=int, default=default)
    for name, default in (("layers", 4), ("vocab", 10816), ("tp", 1), ("pp", 1), ("dp", 4)):
        arguments.add_argument(f"--{name}", type=int, default=default)
    arguments.add_argument("--zero", type=int, default=3, choices=(0, 1, 2, 3), help="ZeRO stage")
    arguments.add_argument("--checkpoints", type=int, default=5, help="checkpoints (default 5)")
    arguments.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="cProfile trainsnap's save and load of the last checkpoint on every rank (the "
        "calling thread) and print rank 0's and the last rank's top N functions",
    )

    def validate(a: Any) -> str | None:
        if a.pp > a.layers:
            return "--pp must not exceed --layers"
        if a.hidden % a.heads or a.heads % a.kv_heads:
            return "--heads must divide --hidden and be a multiple of --kv-heads"
        return "--checkpoints must be at least 1" if a.checkpoints < 1 else None

    args = cli.parse(arguments, argv, SMOKE, validate)
    out = run(args)
    text, out["checks"] = report(out)
    emit(out, text, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
