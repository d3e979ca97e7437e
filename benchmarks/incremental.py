"""Incremental snapshots under three kinds of training, and compression of trained state.

One process, CPU. Two parts:

1. **Incremental snapshots.** For each scenario a model and its optimizer are trained for a few
   real optimizer steps (``--steps-between``) before each of ``--snapshots`` synchronous saves
   (``ts.CheckpointManager(root, async_save=False, save_options=ts.SaveOptions(chunk_size=...))``,
   ``mgr.save``) of a ``ts.TrainState`` into a fresh root. Per snapshot: the bytes it references
   (its stored size, ``mgr.last_save_bytes[0]``), the bytes it wrote (``[1]``; both cross-checked
   against the ``saved snapshot ...`` line of the save protocol's logger), the dedup ratio and
   the save's wall time. Beside them, from a copy of the saved tensors kept from the previous
   snapshot: the bytes of the elements that changed, and the bytes a chunk-granular store must
   rewrite (each tensor of at least the pack threshold cut at multiples of the chunk size, a
   chunk counted whole when any of its bytes changed; the small tensors, packed together,
   counted whole when any changed). Scenarios:

   - ``full-ft``: full fine-tuning of a stack of pre-norm MLP blocks (LayerNorm, d -> 4d -> d,
     residual) of ``--mib`` MiB of fp32 parameters, AdamW over every parameter: every byte of
     weights and moments changes at every step.
   - ``lora``: the same stack frozen (``requires_grad=False``) with low-rank adapters on both
     linears of every block, AdamW over the adapters only: the base is ~98% of the state's bytes.
     Target: each snapshot after the first writes at most 5% of the bytes it references.
   - ``sparse-*``: an embedding of ``--mib`` MiB (rows of 1024 fp32) and a small classifier head;
     every optimizer step draws its tokens from one contiguous vocabulary window (1% of the rows,
     a new window for each interval between snapshots, chosen by a seeded generator): the rest of
     the vocabulary is never touched. With plain SGD (no momentum, no weight decay) only the
     rows touched in an interval change; it runs with the default chunk size and with 1 MiB
     chunks (``chunk_size=`` of the save options). With AdamW (no weight decay) a row touched
     once keeps moving at every later step (its first moment decays but stays non-zero), and its
     two moment rows with it.

2. **Compression of trained state**: ``benchmarks.compression`` (a stack of ``--mib``/8 MiB
   trained for ``--train-steps`` AdamW steps; weights, bf16 weights and both Adam moments saved
   and loaded with each codec; ``--part compression`` runs it alone).

    python -m benchmarks.incremental                        # 256 MiB, 5 snapshots
    python -m benchmarks.incremental --mib 32 --snapshots 3 --train-steps 50 --json out.json
    python -m benchmarks.incremental --smoke                # tiny: does it run and verify?

Roots live in a temporary directory under ``--dir`` (default: the system's temporary
directory), each removed when its scenario or measurement is done.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import trainsnap as ts
from benchmarks import compression
from benchmarks._framework import cli
from benchmarks._framework.adapters import SaveLog
from benchmarks._framework.method import median, timed
from benchmarks._framework.report import Check, Column, Target, emit, facts, records_table, verdicts
from benchmarks._framework.state import (
    MiB,
    Tensors,
    state_nbytes,
)
from benchmarks._framework.system import fresh_dir, load_average, machine_info, scratch_root
from benchmarks._framework.training import (
    BagClassifier,
    Stack,
    add_lora,
    param_bytes,
    regression_loss,
    stack_width,
    stepper,
)
from trainsnap import tunables

LORA_TARGET = Target("<=", 0.05)
"""Each LoRA snapshot after the first writes at most this fraction of the bytes it references."""
EMBED_DIM = 1024
WINDOW_FRACTION = 0.01
"""The vocabulary window of one interval between snapshots, as a fraction of the rows."""
SMOKE = {"mib": 2.0, "snapshots": 2, "steps_between": 1, "train_steps": 2}


# -- the scenarios: a generator of configurations --------------------------------------------------


@dataclass
class Setup:
    """A model and optimizer ready to train."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    train_step: Callable[[], float]
    """One optimizer step; returns the loss."""
    notes: str
    begin_interval: Callable[[int], dict[str, Any]] = lambda interval: {}
    """Called before the steps of interval ``k``; returns what to record about it."""


@dataclass(frozen=True)
class Scenario:
    name: str
    build: Callable[[Any], Setup]
    chunk_size: int | None = None
    target: Target | None = None
    rows_of: str | None = None
    """The key (in the saved tree) of an embedding whose changed rows are counted."""


def build_full(args: Any) -> Setup:
    layers = 8
    width = stack_width(args.mib, layers)
    torch.manual_seed(args.seed)
    model = Stack(width, layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    step = stepper(optimizer, regression_loss(model, width, 16, args.seed))
    notes = f"{layers} blocks of width {width}, {param_bytes(model) / MiB:.0f} MiB of fp32 "
    return Setup(model, optimizer, step, notes + "parameters, AdamW over all of them")


def build_lora(args: Any) -> Setup:
    layers = 8
    width = stack_width(args.mib, layers)
    rank = max(2, width // 256)
    torch.manual_seed(args.seed)
    model = Stack(width, layers)
    add_lora(model, rank)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3, weight_decay=0.01)
    step = stepper(optimizer, regression_loss(model, width, 16, args.seed))
    frozen, adapters = param_bytes(model, trainable=False), param_bytes(model, trainable=True)
    notes = (
        f"frozen base: {layers} blocks of width {width} ({frozen / MiB:.0f} MiB); adapters of "
        f"rank {rank} on fc1 and fc2 of every block ({adapters / MiB:.2f} MiB, {len(trainable)} "
        "tensors), AdamW over the adapters only"
    )
    return Setup(model, optimizer, step, notes)


def build_sparse(args: Any, optimizer_name: str) -> Setup:
    vocabulary = max(1024, int(args.mib * MiB) // (EMBED_DIM * 4))
    window = max(16, int(vocabulary * WINDOW_FRACTION))
    classes, batch, sequence = 16, 32, 16
    torch.manual_seed(args.seed)
    model = BagClassifier(vocabulary, EMBED_DIM, classes)
    if optimizer_name == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed + 1)
    where = {"low": 0}

    def begin(interval: int) -> dict[str, Any]:
        where["low"] = int(torch.randint(0, vocabulary - window + 1, (1,), generator=generator))
        return {"window": [where["low"], where["low"] + window]}

    def loss() -> torch.Tensor:
        shape = (batch, sequence)
        tokens = torch.randint(where["low"], where["low"] + window, shape, generator=generator)
        return F.cross_entropy(model(tokens), tokens[:, 0] % classes)

    plain = "SGD (no momentum, no weight decay)"
    what = plain if optimizer_name == "sgd" else "AdamW (no weight decay)"
    notes = (
        f"embedding {vocabulary} x {EMBED_DIM} fp32 ({vocabulary * EMBED_DIM * 4 / MiB:.0f} MiB)"
        f" + head {EMBED_DIM} x {classes}, {what}; each interval's tokens from a window of "
        f"{window} rows ({window * EMBED_DIM * 4 / MiB:.2f} MiB), {batch}x{sequence} tokens a step"
    )
    return Setup(model, optimizer, stepper(optimizer, loss), notes, begin)


def scenarios() -> Iterator[Scenario]:
    embed = "model.embed.weight"
    yield Scenario("full-ft", build_full)
    yield Scenario("lora", build_lora, target=LORA_TARGET)
    yield Scenario("sparse-sgd", lambda args: build_sparse(args, "sgd"), rows_of=embed)
    yield Scenario("sparse-sgd", lambda args: build_sparse(args, "sgd"), 1 * MiB, rows_of=embed)
    yield Scenario("sparse-adamw", lambda args: build_sparse(args, "adamw"), 1 * MiB, rows_of=embed)


# -- what changed ----------------------------------------------------------------------------------


def flat_tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted key, tensor) of every tensor in a tree of dicts and lists."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from flat_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, list | tuple):
        for index, value in enumerate(tree):
            yield from flat_tensors(value, f"{prefix}.{index}" if prefix else str(index))


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def changed_mask(current: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """Per element (flat), whether its bits changed (all, without a comparable previous)."""
    if previous is None or previous.shape != current.shape or previous.dtype != current.dtype:
        return torch.ones(current.numel(), dtype=torch.bool)
    integer = _INT_OF_SIZE[current.element_size()]
    return current.detach().reshape(-1).view(integer) != previous.reshape(-1).view(integer)


@dataclass
class Changes:
    elements_bytes: int = 0
    """Bytes of the elements whose bits changed."""
    chunk_bytes: int = 0
    """Bytes of the chunks (large tensors) and of the small tensors' packs that changed."""
    rows: int | None = None


def _changed_chunk_bytes(mask: torch.Tensor, element_size: int, nbytes: int, chunk: int) -> int:
    per_chunk = chunk // element_size
    chunks = torch.unique(mask.nonzero().view(-1) // per_chunk).tolist()
    return sum(min(chunk, nbytes - index * chunk) for index in chunks)


def changes(
    current: Tensors, previous: Tensors, chunk: int, threshold: int, rows_of: str | None
) -> Changes:
    out = Changes()
    small_total, small_changed = 0, False
    for key, tensor in current.items():
        mask = changed_mask(tensor, previous.get(key))
        changed = int(mask.sum())
        out.elements_bytes += changed * tensor.element_size()
        if key == rows_of and tensor.dim() == 2:
            out.rows = int(mask.view(tensor.shape).any(dim=1).sum())
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < threshold:
            small_total += nbytes
            small_changed |= changed > 0
        elif changed:
            out.chunk_bytes += _changed_chunk_bytes(mask, tensor.element_size(), nbytes, chunk)
    if small_changed:
        out.chunk_bytes += small_total
    return out


# -- part 1: measure() of a scenario ---------------------------------------------------------------


def _snapshot(manager: Any, state: ts.TrainState, step: int, log: SaveLog) -> dict[str, Any]:
    save_s, _ = timed(lambda: manager.save(step, state))
    assert manager.last_save_bytes is not None
    referenced, written = manager.last_save_bytes
    logged = log.saves[-1] if log.saves else None
    return {
        "step": step,
        "referenced": referenced,
        "written": written,
        "dedup": 1 - written / referenced,
        "save_s": save_s,
        "log_agrees": logged == (referenced, written),
    }


def _record_changes(record: dict[str, Any], found: Changes | None) -> None:
    record["changed_bytes"] = None if found is None else found.elements_bytes
    record["chunk_changed_bytes"] = None if found is None else found.chunk_bytes
    record["rows_changed"] = None if found is None else found.rows


def _snapshots(
    scenario: Scenario, setup: Setup, manager: Any, log: SaveLog, args: Any
) -> list[dict[str, Any]]:
    state = ts.TrainState(model=setup.model, optimizer=setup.optimizer)
    chunk = scenario.chunk_size or tunables.get().chunk_size
    threshold = min(tunables.get().pack_threshold, chunk)
    records: list[dict[str, Any]] = []
    previous: Tensors | None = None
    for interval in range(args.snapshots):
        record = setup.begin_interval(interval)
        train_s, losses = timed(lambda: [setup.train_step() for _ in range(args.steps_between)])
        record |= _snapshot(manager, state, (interval + 1) * args.steps_between, log)
        current = dict(flat_tensors(state.save_tree()))
        found = (
            None
            if previous is None
            else changes(current, previous, chunk, threshold, scenario.rows_of)
        )
        previous = {key: value.detach().clone() for key, value in current.items()}
        _record_changes(record, found)
        record |= {"snapshot": interval + 1, "state_bytes": state_nbytes(current)}
        record |= {"train_s": train_s, "loss": losses[-1]}
        records.append(record)
        print(
            f"  snapshot {interval + 1}/{args.snapshots} step {record['step']}: wrote "
            f"{record['written'] / MiB:.1f} of {record['referenced'] / MiB:.1f} MiB in "
            f"{record['save_s']:.2f}s (train {train_s:.2f}s, loss {losses[-1]:.4f})",
            flush=True,
        )
    return records


def measure_scenario(scenario: Scenario, base: Path, args: Any) -> dict[str, Any]:
    setup = scenario.build(args)
    chunk = scenario.chunk_size or tunables.get().chunk_size
    label = f"{scenario.name} chunk={chunk // MiB}MiB"
    print(f"\n[{label}] {setup.notes}", flush=True)
    options = ts.ManagerOptions(preemption_signals=())
    save_options = ts.SaveOptions(chunk_size=scenario.chunk_size)
    with (
        SaveLog() as log,
        fresh_dir(base, f"{scenario.name}-") as root,
        ts.CheckpointManager(
            root, async_save=False, save_options=save_options, options=options
        ) as manager,
    ):
        records = _snapshots(scenario, setup, manager, log, args)
    later = [record["written"] / record["referenced"] for record in records[1:]]
    return {
        "scenario": scenario.name,
        "label": label,
        "chunk_size": chunk,
        "notes": setup.notes,
        "snapshots": records,
        "median_written_fraction_after_first": median(later),
        "largest_written_fraction_after_first": max(later),
        "median_save_s_after_first": median([record["save_s"] for record in records[1:]]),
        "target": scenario.target,
        "log_agrees": all(record["log_agrees"] for record in records),
        "rows_of": scenario.rows_of,
    }


def scenario_check(result: dict[str, Any]) -> Check:
    """Every snapshot after the first within the target: the largest one is."""
    label = f"{result['label']}: largest written/referenced after the first"
    return Check(label, result["largest_written_fraction_after_first"], result["target"])


# -- part 1: the report ----------------------------------------------------------------------------


def _mib(nbytes: int | None) -> object:
    return "-" if nbytes is None else nbytes / MiB


def _window(record: dict[str, Any]) -> str:
    window = record.get("window")
    return f"{window[0]}-{window[1]}" if window else "-"


SPARSE_COLUMNS: list[Column] = [
    ("window", _window),
    ("rows changed", lambda r: r["rows_changed"] or "-"),
]
SNAPSHOT_COLUMNS: list[Column] = [
    ("snap", lambda r: r["snapshot"]),
    ("step", lambda r: r["step"]),
    ("state MiB", lambda r: r["state_bytes"] / MiB),
    ("referenced MiB", lambda r: r["referenced"] / MiB),
    ("written MiB", lambda r: r["written"] / MiB),
    ("written %", lambda r: 100 * r["written"] / r["referenced"]),
    ("dedup %", lambda r: 100 * r["dedup"]),
    ("changed MiB", lambda r: _mib(r["changed_bytes"])),
    ("chunks changed MiB", lambda r: _mib(r["chunk_changed_bytes"])),
    ("save s", lambda r: r["save_s"]),
]


def _scenario_notes(result: dict[str, Any]) -> list[str]:
    lines = []
    if not result["log_agrees"]:
        lines.append("  !! the trainsnap.save log line disagrees with mgr.last_save_bytes")
    records = result["snapshots"]
    over = [r["snapshot"] for r in records if r["written"] > r["referenced"]]
    if over:
        lines.append(
            f"  !! snapshot(s) {over} wrote more than they reference: chunks with identical "
            "bytes in one save (all-zero moments) are each written and counted"
        )
    shared = [r["snapshot"] for r in records if r["referenced"] < r["state_bytes"]]
    if shared:
        lines.append(
            f"  snapshot(s) {shared} reference less than the state's bytes: chunks with "
            "identical bytes (all-zero moments of never-touched rows) are one object"
        )
    return lines


def _scenario_table(result: dict[str, Any]) -> list[str]:
    columns = SNAPSHOT_COLUMNS
    if result["rows_of"] is not None:
        columns = [*columns[:2], *SPARSE_COLUMNS, *columns[2:]]
    table = records_table(result["snapshots"], columns, digits=2)
    return ["", f"{result['label']}: {result['notes']}", table]


def _later_rewritten(result: dict[str, Any]) -> float:
    """Median over the later snapshots of written bytes / bytes of the chunks that changed."""
    later = result["snapshots"][1:]
    return median(
        [r["written"] / r["chunk_changed_bytes"] for r in later if r["chunk_changed_bytes"]]
    )


def _target(result: dict[str, Any]) -> str:
    target = result["target"]
    return "-" if target is None else f"{target.relation} {100 * target.bound:g}%"


SUMMARY_COLUMNS: list[Column] = [
    ("scenario", lambda r: r["label"]),
    ("referenced MiB", lambda r: r["snapshots"][0]["referenced"] / MiB),
    ("1st written MiB", lambda r: r["snapshots"][0]["written"] / MiB),
    ("later written MiB", lambda r: median([s["written"] / MiB for s in r["snapshots"][1:]])),
    ("written/referenced %", lambda r: 100 * r["median_written_fraction_after_first"]),
    ("target", _target),
    ("result", lambda r: scenario_check(r).result),
    ("written/chunks changed", _later_rewritten),
    ("later save s", lambda r: r["median_save_s_after_first"]),
]


def report_incremental(results: list[dict[str, Any]]) -> list[str]:
    lines = ["", "== Part 1: incremental snapshots (synchronous saves, a fresh root each) =="]
    for result in results:
        lines += _scenario_table(result) + _scenario_notes(result)
    lines += [
        "",
        "changed MiB: bytes of the saved tensors' elements whose bits changed since the previous "
        "snapshot; chunks changed MiB: the chunks of the chunk size (and the pack of small "
        "tensors) holding any of them -- what a chunk-granular store must rewrite (written/chunks "
        "changed 1.00: it wrote exactly those).",
        "",
        "Summary (medians over the snapshots after the first):",
        records_table(results, SUMMARY_COLUMNS, digits=2),
    ]
    return lines


# -- the run ---------------------------------------------------------------------------------------


def warm_up(base: Path) -> float:
    """One small save and load of a TrainState through a manager, so that one-time costs (lazy
    imports, pools) fall on no measurement."""
    model = nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    state = ts.TrainState(model=model, optimizer=optimizer)
    start = time.perf_counter()
    options = ts.ManagerOptions(preemption_signals=())
    with fresh_dir(base, "warm-up-") as root:
        with ts.CheckpointManager(root, async_save=False, options=options) as manager:
            manager.save(1, state)
        ts.load(state, root)
    return time.perf_counter() - start


def run(args: Any) -> dict[str, Any]:
    machine = machine_info() | {"loadavg_start": load_average()}
    print(facts("machine", machine))
    names = ("mib", "snapshots", "steps_between", "train_steps", "seed")
    config = {name: getattr(args, name) for name in names}
    config["chunk_size_default"] = tunables.get().chunk_size
    config["pack_threshold"] = tunables.get().pack_threshold
    out: dict[str, Any] = {"machine": machine, "config": config}
    start = time.perf_counter()
    with scratch_root(
        args.dir, 3 * args.mib * MiB * args.snapshots * 1.2, "trainsnap-bench-"
    ) as base:
        if args.part in ("all", "incremental"):
            out["warm_up_s"] = warm_up(base)
            out["incremental"] = [measure_scenario(s, base, args) for s in scenarios()]
        if args.part in ("all", "compression"):
            out["compression"] = compression.run_compression(base, args)
    out["seconds"] = time.perf_counter() - start
    machine["loadavg_end"] = load_average()
    return out


def report(out: dict[str, Any]) -> tuple[str, list[Check]]:
    lines: list[str] = []
    checks: list[Check] = []
    if "incremental" in out:
        lines += report_incremental(out["incremental"])
        checks += [scenario_check(result) for result in out["incremental"]]
    if "compression" in out:
        compression_lines, compression_checks = compression.report_compression(out["compression"])
        lines += compression_lines
        checks += compression_checks
    lines += ["", "== targets", verdicts(checks, digits=3)]
    lines.append(
        f"\ntotal {out['seconds']:.0f}s; load average (1/5/15 min) at start "
        f"{out['machine']['loadavg_start']}, at end {out['machine']['loadavg_end']}"
    )
    return "\n".join(lines), checks


def _validate(args: Any) -> str | None:
    if args.snapshots < 2:
        return "--snapshots must be at least 2 (the first one writes everything)"
    if args.steps_between < 1 or args.train_steps < 1 or args.mib <= 0:
        return "--steps-between, --train-steps and --mib must be positive"
    return None


def main(argv: list[str] | None = None) -> int:
    arguments = cli.parser(__doc__)
    mib_help = "fp32 parameter MiB of the full / LoRA stack and of the embedding"
    compression.add_arguments(arguments, mib_help)
    arguments.add_argument(
        "--snapshots", type=int, default=5, help="snapshots per scenario (default 5)"
    )
    arguments.add_argument(
        "--steps-between",
        type=int,
        default=3,
        help="optimizer steps before each snapshot (default 3)",
    )
    arguments.add_argument("--part", choices=("all", "incremental", "compression"), default="all")
    args = cli.parse(arguments, argv, SMOKE, _validate)
    out = run(args)
    text, out["checks"] = report(out)
    emit(out, text, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
