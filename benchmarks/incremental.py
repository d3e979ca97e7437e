"""Incremental snapshots under three kinds of training, and compression of trained state.

One process, CPU. Two parts:

1. **Incremental snapshots.** For each scenario a model and its optimizer are trained for a few
   real optimizer steps (``--steps-between``) before each of ``--snapshots`` synchronous saves
   (``ts.CheckpointManager(root, async_save=False, chunk_size=...)``, ``mgr.save``) of a
   ``ts.TrainState`` into a fresh root. Per snapshot: the bytes it references (its stored size,
   ``mgr.last_save_bytes[0]``), the bytes it wrote (``[1]``; both cross-checked against the
   ``saved snapshot ...`` line of the ``trainsnap.save`` logger), the dedup ratio and the save's
   wall time. Beside them, from a copy of the saved tensors kept from the previous snapshot: the
   bytes of the elements that changed, and the bytes a chunk-granular store must rewrite (each
   tensor of at least the pack threshold cut at multiples of the chunk size, a chunk counted
   whole when any of its bytes changed; the small tensors, packed together, counted whole when
   any changed). Scenarios:

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
     chunks (``chunk_size=`` of the manager). With AdamW (no weight decay) a row touched once
     keeps moving at every later step (its first moment decays but stays non-zero), and its two
     moment rows with it.

2. **Compression of trained state.** A smaller stack (``--mib``/8) is trained for
   ``--train-steps`` AdamW steps on a synthetic regression task (a fixed random teacher), so
   weights and moments are trained values, not random ones. For each kind -- fp32 weights, the
   same weights cast to bf16, AdamW ``exp_avg``, ``exp_avg_sq`` -- a state holding only that
   kind is saved with ``ts.save(..., options=ts.SaveOptions(compression=...))`` (None,
   "zstd", "bytegroup+zstd") into a fresh
   root and loaded back with ``ts.load`` into zeroed tensors, 3 times: stored size / raw size,
   and raw bytes / median seconds of the save (compression, hashing, writing) and of the load
   (reading from the page cache -- the file was just written -- verifying and decompressing).
   ``None`` is the reference without a codec. Every load is checked bit for bit.

    python benchmarks/incremental.py                        # 256 MiB, 5 snapshots
    python benchmarks/incremental.py --mib 32 --snapshots 3 --train-steps 50 --json out.json

Roots live in a temporary directory under ``--dir`` (default: the system's temporary
directory), each removed when its scenario or measurement is done.
"""

from __future__ import annotations

import argparse
import logging
import math
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F
from torch import nn

import trainsnap as ts
from common import (
    GiB,
    MiB,
    check_bitwise_equal,
    emit,
    empty_like_state,
    format_table,
    fresh_dir,
    kv,
    machine_info,
    median,
    scratch_root,
    state_nbytes,
    timed,
)
from trainsnap import tunables

State = dict[str, torch.Tensor]

LORA_TARGET = 0.05
"""Each LoRA snapshot after the first writes at most this fraction of the bytes it references."""
CODECS: tuple[str | None, ...] = (None, "zstd", "bytegroup+zstd")
COMPRESSION_REPS = 3
EMBED_DIM = 1024
WINDOW_FRACTION = 0.01
"""The vocabulary window of one interval between snapshots, as a fraction of the rows."""

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


# -- models ----------------------------------------------------------------------------------------


class Block(nn.Module):
    """A pre-norm MLP block: x + fc2(gelu(fc1(norm(x))))."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1: nn.Module = nn.Linear(d, 4 * d)
        self.fc2: nn.Module = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, d: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


def stack_width(mib: float, layers: int) -> int:
    """The width (a multiple of 64) at which ``layers`` blocks hold about ``mib`` MiB of fp32
    parameters (8 d^2 each)."""
    d = math.sqrt(mib * MiB / 4 / (8 * layers))
    return max(64, round(d / 64) * 64)


class LoRALinear(nn.Module):
    """A frozen linear plus a trainable low-rank update ``b @ a`` (``b`` starts at zero)."""

    def __init__(self, base: nn.Linear, rank: int) -> None:
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
        self.b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


class BagClassifier(nn.Module):
    """Mean of token embeddings, then a linear head."""

    def __init__(self, vocab: int, dim: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(1))


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# -- scenarios -------------------------------------------------------------------------------------


@dataclass
class Setup:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    begin_interval: Callable[[int], dict[str, Any]]
    """Called before the steps of interval ``k``; returns what to record about it."""
    train_step: Callable[[], float]
    """One optimizer step; returns the loss."""
    notes: str


@dataclass(frozen=True)
class Scenario:
    name: str
    build: Callable[[argparse.Namespace], Setup]
    chunk_size: int | None = None
    target: float | None = None
    rows_of: str | None = None
    """The key (in the saved tree) of an embedding whose changed rows are counted."""


def _regression(model: nn.Module, d: int, batch: int, seed: int) -> Callable[[], float]:
    """Steps of a regression towards a fixed random linear teacher on Gaussian inputs."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(d, d, generator=gen) / math.sqrt(d)
    return lambda: _mse(model, torch.randn(batch, d, generator=gen), teacher)


def _mse(model: nn.Module, x: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), torch.tanh(x @ teacher))


def _stepper(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[[], Any]):
    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def build_full(args: argparse.Namespace) -> Setup:
    layers = 8
    d = stack_width(args.mib, layers)
    torch.manual_seed(args.seed)
    model = Stack(d, layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    step = _stepper(model, opt, _regression(model, d, 16, args.seed))
    return Setup(
        model,
        opt,
        lambda k: {},
        step,
        f"{layers} blocks of width {d}, {param_bytes(model) / MiB:.0f} MiB of fp32 parameters, "
        "AdamW over all of them",
    )


def build_lora(args: argparse.Namespace) -> Setup:
    layers = 8
    d = stack_width(args.mib, layers)
    rank = max(2, d // 256)
    torch.manual_seed(args.seed)
    model = Stack(d, layers)
    model.requires_grad_(False)
    for b in model.blocks:
        assert isinstance(b, Block)
        b.fc1 = LoRALinear(b.fc1, rank)  # type: ignore[arg-type]
        b.fc2 = LoRALinear(b.fc2, rank)  # type: ignore[arg-type]
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3, weight_decay=0.01)
    step = _stepper(model, opt, _regression(model, d, 16, args.seed))
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    adapters = sum(p.numel() * p.element_size() for p in trainable)
    return Setup(
        model,
        opt,
        lambda k: {},
        step,
        f"frozen base: {layers} blocks of width {d} ({frozen / MiB:.0f} MiB); adapters of rank "
        f"{rank} on fc1 and fc2 of every block ({adapters / MiB:.2f} MiB, {len(trainable)} "
        "tensors), AdamW over the adapters only",
    )


def _build_sparse(args: argparse.Namespace, optimizer: str) -> Setup:
    vocab = max(1024, int(args.mib * MiB) // (EMBED_DIM * 4))
    window = max(16, int(vocab * WINDOW_FRACTION))
    classes, batch, seq = 16, 32, 16
    torch.manual_seed(args.seed)
    model = BagClassifier(vocab, EMBED_DIM, classes)
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed + 1)
    where = {"lo": 0}

    def begin(k: int) -> dict[str, Any]:
        lo = int(torch.randint(0, vocab - window + 1, (1,), generator=gen))
        where["lo"] = lo
        return {"window": [lo, lo + window]}

    def loss() -> torch.Tensor:
        tokens = torch.randint(where["lo"], where["lo"] + window, (batch, seq), generator=gen)
        return F.cross_entropy(model(tokens), tokens[:, 0] % classes)

    what = "SGD (no momentum, no weight decay)" if optimizer == "sgd" else "AdamW (no weight decay)"
    return Setup(
        model,
        opt,
        begin,
        _stepper(model, opt, loss),
        f"embedding {vocab} x {EMBED_DIM} fp32 ({vocab * EMBED_DIM * 4 / MiB:.0f} MiB) + head "
        f"{EMBED_DIM} x {classes}, {what}; each interval's tokens from a window of {window} "
        f"rows ({window * EMBED_DIM * 4 / MiB:.2f} MiB), {batch}x{seq} tokens a step",
    )


def scenarios() -> list[Scenario]:
    embed = "model.embed.weight"
    return [
        Scenario("full-ft", build_full),
        Scenario("lora", build_lora, target=LORA_TARGET),
        Scenario("sparse-sgd", lambda a: _build_sparse(a, "sgd"), rows_of=embed),
        Scenario("sparse-sgd", lambda a: _build_sparse(a, "sgd"), 1 * MiB, rows_of=embed),
        Scenario("sparse-adamw", lambda a: _build_sparse(a, "adamw"), 1 * MiB, rows_of=embed),
    ]


# -- what changed ----------------------------------------------------------------------------------


def flat_tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted key, tensor) of every tensor in a tree of dicts and lists."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from flat_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from flat_tensors(v, f"{prefix}.{i}" if prefix else str(i))


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def changed_mask(cur: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """Per element (flat), whether its bits changed."""
    n = cur.element_size()
    a = cur.detach().reshape(-1).view(_INT_OF_SIZE[n])
    b = prev.reshape(-1).view(_INT_OF_SIZE[n])
    return a != b


@dataclass
class Changes:
    elements_bytes: int = 0
    """Bytes of the elements whose bits changed."""
    chunk_bytes: int = 0
    """Bytes of the chunks (large tensors) and of the small tensors' packs that changed."""
    rows: int | None = None


def compare(cur: State, prev: State, chunk: int, threshold: int, rows_of: str | None) -> Changes:
    out = Changes()
    small_total, small_changed = 0, False
    for k, t in cur.items():
        p = prev.get(k)
        nbytes = t.numel() * t.element_size()
        if p is None or p.shape != t.shape or p.dtype != t.dtype:
            mask = torch.ones(t.numel(), dtype=torch.bool)
        else:
            mask = changed_mask(t, p)
        n_changed = int(mask.sum())
        out.elements_bytes += n_changed * t.element_size()
        if k == rows_of and t.dim() == 2:
            out.rows = int(mask.view(t.shape).any(dim=1).sum())
        if nbytes < threshold:
            small_total += nbytes
            small_changed |= n_changed > 0
            continue
        if n_changed == 0:
            continue
        per_chunk = chunk // t.element_size()
        ids = torch.unique(mask.nonzero().view(-1) // per_chunk)
        for c in ids.tolist():
            out.chunk_bytes += min(chunk, nbytes - c * chunk)
    if small_changed:
        out.chunk_bytes += small_total
    return out


# -- the save log ----------------------------------------------------------------------------------


class SaveLog(logging.Handler):
    """(referenced, written) of each ``saved snapshot ...`` line of ``trainsnap.save``."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.saves: list[tuple[int, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("saved snapshot") and isinstance(record.args, tuple):
            self.saves.append((int(record.args[2]), int(record.args[3])))  # bytes=, written=

    def __enter__(self) -> SaveLog:
        lg = logging.getLogger("trainsnap.save")
        self._level = lg.level
        lg.setLevel(logging.INFO)
        lg.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        lg = logging.getLogger("trainsnap.save")
        lg.removeHandler(self)
        lg.setLevel(self._level)


# -- part 1: incremental snapshots -----------------------------------------------------------------


def run_scenario(sc: Scenario, base: Path, args: argparse.Namespace) -> dict[str, Any]:
    setup = sc.build(args)
    state = ts.TrainState(model=setup.model, optimizer=setup.optimizer)
    t = tunables.get()
    chunk = sc.chunk_size or t.chunk_size
    threshold = min(t.pack_threshold, chunk)
    label = f"{sc.name} chunk={chunk // MiB}MiB"
    print(f"\n[{label}] {setup.notes}", flush=True)
    snaps: list[dict[str, Any]] = []
    prev: State | None = None
    step = 0
    with (
        SaveLog() as log,
        fresh_dir(base, f"{sc.name}-") as root,
        ts.CheckpointManager(
            root,
            async_save=False,
            save_options=ts.SaveOptions(chunk_size=sc.chunk_size),
            options=ts.ManagerOptions(preemption_signals=()),
        ) as mgr,
    ):
        for k in range(args.snapshots):
            rec = setup.begin_interval(k)
            t0 = time.perf_counter()
            losses = [setup.train_step() for _ in range(args.steps_between)]
            train_s = time.perf_counter() - t0
            step += args.steps_between
            save_s, _ = timed(lambda step=step: mgr.save(step, state))
            assert mgr.last_save_bytes is not None
            referenced, written = mgr.last_save_bytes
            logged = log.saves[-1] if log.saves else None
            cur = dict(flat_tensors(state.save_tree()))
            ch = compare(cur, prev, chunk, threshold, sc.rows_of) if prev is not None else None
            prev = {key: v.detach().clone() for key, v in cur.items()}
            rec.update(
                snapshot=k + 1,
                step=step,
                state_bytes=state_nbytes(cur),
                referenced=referenced,
                written=written,
                dedup=1 - written / referenced,
                save_s=save_s,
                train_s=train_s,
                loss=losses[-1],
                log_agrees=logged == (referenced, written),
                changed_bytes=None if ch is None else ch.elements_bytes,
                chunk_changed_bytes=None if ch is None else ch.chunk_bytes,
                rows_changed=None if ch is None else ch.rows,
            )
            snaps.append(rec)
            print(
                f"  snapshot {k + 1}/{args.snapshots} step {step}: wrote {written / MiB:.1f} of "
                f"{referenced / MiB:.1f} MiB in {save_s:.2f}s (train {train_s:.2f}s, loss "
                f"{losses[-1]:.4f})",
                flush=True,
            )
    later = [s["written"] / s["referenced"] for s in snaps[1:]]
    ratio = median(later)
    out: dict[str, Any] = {
        "scenario": sc.name,
        "label": label,
        "chunk_size": chunk,
        "notes": setup.notes,
        "snapshots": snaps,
        "median_written_fraction_after_first": ratio,
        "median_save_s_after_first": median([s["save_s"] for s in snaps[1:]]),
        "target": sc.target,
        "target_met": None if sc.target is None or not later else ratio <= sc.target,
        "every_later_snapshot_within_target": (
            None if sc.target is None else all(x <= sc.target for x in later)
        ),
        "log_agrees": all(s["log_agrees"] for s in snaps),
        "rows_of": sc.rows_of,
    }
    return out


def _mib(n: int | None) -> object:
    return "-" if n is None else n / MiB


def report_incremental(results: list[dict[str, Any]]) -> str:
    lines = ["", "== Part 1: incremental snapshots (synchronous saves, a fresh root each) =="]
    for r in results:
        lines += ["", f"{r['label']}: {r['notes']}"]
        sparse = r["rows_of"] is not None
        headers = [
            "snap",
            "step",
            "state MiB",
            "referenced MiB",
            "written MiB",
            "written %",
            "dedup %",
            "changed MiB",
            "chunks changed MiB",
            "save s",
        ]
        if sparse:
            headers[2:2] = ["window", "rows changed"]
        rows = []
        for s in r["snapshots"]:
            row: list[object] = [
                s["snapshot"],
                s["step"],
                s["state_bytes"] / MiB,
                s["referenced"] / MiB,
                s["written"] / MiB,
                100 * s["written"] / s["referenced"],
                100 * s["dedup"],
                _mib(s["changed_bytes"]),
                _mib(s["chunk_changed_bytes"]),
                s["save_s"],
            ]
            if sparse:
                w = s.get("window")
                row[2:2] = [f"{w[0]}-{w[1]}" if w else "-", s["rows_changed"] or "-"]
            rows.append(row)
        lines.append(format_table(headers, rows, digits=2))
        if not r["log_agrees"]:
            lines.append("  !! the trainsnap.save log line disagrees with mgr.last_save_bytes")
        over = [s["snapshot"] for s in r["snapshots"] if s["written"] > s["referenced"]]
        if over:
            lines.append(
                f"  !! snapshot(s) {over} wrote more than they reference: chunks with identical "
                "bytes in one save (all-zero moments) are each written and counted"
            )
        shared = [s["snapshot"] for s in r["snapshots"] if s["referenced"] < s["state_bytes"]]
        if shared:
            lines.append(
                f"  snapshot(s) {shared} reference less than the state's bytes: chunks with "
                "identical bytes (all-zero moments of never-touched rows) are one object"
            )
    lines += [
        "",
        "changed MiB: bytes of the saved tensors' elements whose bits changed since the previous "
        "snapshot; chunks changed MiB: the chunks of the chunk size (and the pack of small "
        "tensors) holding any of them -- what a chunk-granular store must rewrite (written/chunks "
        "changed 1.00: it wrote exactly those).",
        "",
        "Summary (medians over the snapshots after the first):",
    ]
    rows = []
    for r in results:
        first = r["snapshots"][0]
        target = "-" if r["target"] is None else f"<= {100 * r['target']:g}%"
        verdict = "-"
        if r["target"] is not None:
            verdict = "met" if r["every_later_snapshot_within_target"] else "MISSED"
        rows.append(
            [
                r["label"],
                first["referenced"] / MiB,
                first["written"] / MiB,
                median([s["written"] / MiB for s in r["snapshots"][1:]]),
                100 * r["median_written_fraction_after_first"],
                target,
                verdict,
                median(
                    [
                        s["written"] / s["chunk_changed_bytes"]
                        for s in r["snapshots"][1:]
                        if s["chunk_changed_bytes"]
                    ]
                ),
                r["median_save_s_after_first"],
            ]
        )
    headers = [
        "scenario",
        "referenced MiB",
        "1st written MiB",
        "later written MiB",
        "written/referenced %",
        "target",
        "result",
        "written/chunks changed",
        "later save s",
    ]
    lines.append(format_table(headers, rows, digits=2))
    return "\n".join(lines)


# -- part 2: compression on trained state ----------------------------------------------------------


def train_for_compression(args: argparse.Namespace) -> tuple[Stack, torch.optim.AdamW, list[float]]:
    layers = 4
    d = stack_width(max(4.0, args.mib / 8), layers)
    torch.manual_seed(args.seed + 7)
    model = Stack(d, layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    step = _stepper(model, opt, _regression(model, d, 64, args.seed + 7))
    losses = [step() for _ in range(args.train_steps)]
    return model, opt, losses


def kinds_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, State]:
    named = list(model.named_parameters())
    return {
        "fp32 weights": {n: p.detach().clone() for n, p in named},
        "bf16 weights": {n: p.detach().to(torch.bfloat16) for n, p in named},
        "adam exp_avg": {n: opt.state[p]["exp_avg"].clone() for n, p in named},
        "adam exp_avg_sq": {n: opt.state[p]["exp_avg_sq"].clone() for n, p in named},
    }


def measure_codec(state: State, codec: str | None, base: Path) -> dict[str, Any]:
    raw = state_nbytes(state)
    save_s: list[float] = []
    load_s: list[float] = []
    stored: list[int] = []
    logged: list[tuple[int, int]] = []
    for rep in range(COMPRESSION_REPS):
        dst = empty_like_state(state)
        with SaveLog() as log, fresh_dir(base, f"codec-{codec}-") as root:
            s, info = timed(
                lambda root=root, rep=rep: ts.save(
                    state, root, step=rep, options=ts.SaveOptions(compression=codec)
                )
            )
            ls, _ = timed(lambda root=root, dst=dst: ts.load(dst, root))
            check_bitwise_equal(state, dst, f"{codec} load, repetition {rep + 1}")
            save_s.append(s)
            load_s.append(ls)
            stored.append(info.nbytes)
            logged += log.saves
    sm, lm = median(save_s), median(load_s)
    return {
        "codec": codec or "none",
        "raw_bytes": raw,
        "stored_bytes": stored[-1],
        "ratio": stored[-1] / raw,
        "save_s": save_s,
        "load_s": load_s,
        "save_MBps": raw / sm / 1e6,
        "load_MBps": raw / lm / 1e6,
        "bitwise_equal": True,
        "logged_referenced_written": logged[-1] if logged else None,
    }


def run_compression(base: Path, args: argparse.Namespace) -> dict[str, Any]:
    print(f"\ntraining for compression ({args.train_steps} AdamW steps) ...", flush=True)
    train_s, (model, opt, losses) = timed(lambda: train_for_compression(args))
    print(
        f"  {param_bytes(model) / MiB:.1f} MiB of fp32 parameters, loss {losses[0]:.4f} -> "
        f"{losses[-1]:.4f} in {train_s:.1f}s",
        flush=True,
    )
    results = []
    for kind, state in kinds_of(model, opt).items():
        for codec in CODECS:
            r = measure_codec(state, codec, base)
            r["kind"] = kind
            results.append(r)
            print(
                f"  {kind} {r['codec']}: {100 * r['ratio']:.1f}% of raw, save "
                f"{r['save_MBps']:.0f} MB/s, load {r['load_MBps']:.0f} MB/s (bitwise equal)",
                flush=True,
            )
    return {
        "train_steps": args.train_steps,
        "param_bytes": param_bytes(model),
        "loss_first": losses[0] if losses else math.nan,
        "loss_last": losses[-1] if losses else math.nan,
        "train_s": train_s,
        "results": results,
    }


def report_compression(out: dict[str, Any]) -> str:
    lines = [
        "",
        "== Part 2: compression of trained state (ts.save + ts.load, medians of "
        f"{COMPRESSION_REPS}) ==",
        f"model: {out['param_bytes'] / MiB:.1f} MiB of fp32 parameters after "
        f"{out['train_steps']} AdamW steps (loss {out['loss_first']:.4f} -> "
        f"{out['loss_last']:.4f})",
        "",
    ]
    rows = []
    for r in out["results"]:
        lw = r["logged_referenced_written"]
        rows.append(
            [
                r["kind"],
                r["codec"],
                r["raw_bytes"] / MiB,
                r["stored_bytes"] / MiB,
                100 * r["ratio"],
                r["save_MBps"],
                r["load_MBps"],
                "-" if lw is None else f"{lw[1] / MiB:.2f}",
                "yes" if r["bitwise_equal"] else "NO",
            ]
        )
    headers = [
        "kind",
        "codec",
        "raw MiB",
        "stored MiB",
        "stored/raw %",
        "save MB/s",
        "load MB/s",
        "logged written MiB",
        "bitwise",
    ]
    lines.append(format_table(headers, rows, digits=1))
    if any(
        r["logged_referenced_written"] and r["logged_referenced_written"][1] > r["stored_bytes"]
        for r in out["results"]
    ):
        lines += [
            "",
            "!! logged written MiB (the written= of the trainsnap.save log line and the second "
            "item of CheckpointManager.last_save_bytes) counts the decoded bytes of compressed "
            "objects while bytes= (referenced) counts their stored bytes: a compressed save "
            "reports writing more than it references.",
        ]
    lines += [
        "",
        "save MB/s: raw bytes / median seconds of ts.save (compress, hash, write, fsync); load "
        "MB/s: raw bytes / median seconds of ts.load from the page cache (read, verify, "
        "decompress). codec none is the reference without compression.",
    ]
    return "\n".join(lines)


# -- the run ---------------------------------------------------------------------------------------


def warm_up(base: Path) -> float:
    """One small save and load of each kind measured (a TrainState through a manager, and
    compressed), so that one-time costs (lazy imports, pools) fall on no measurement."""
    model = nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    state = ts.TrainState(model=model, optimizer=opt)
    t0 = time.perf_counter()
    with fresh_dir(base, "warm-up-") as root:
        with ts.CheckpointManager(
            root, async_save=False, options=ts.ManagerOptions(preemption_signals=())
        ) as mgr:
            mgr.save(1, state)
        ts.load(state, root)
    tensors = {"w": model.weight.detach().clone()}
    for codec in CODECS:
        with fresh_dir(base, "warm-up-") as root:
            ts.save(tensors, root, step=1, options=ts.SaveOptions(compression=codec))
            ts.load(empty_like_state(tensors), root)
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict[str, Any]:
    threads = tunables.get().io_threads
    machine = machine_info()
    machine["trainsnap"] = ts.__version__
    machine["io_threads"] = threads
    print(f"machine: {kv(machine)}")
    need = 3 * args.mib * MiB * args.snapshots * 1.2
    base, free = scratch_root(args.dir, need, "trainsnap-bench-")
    print(f"directory: {base} ({free / GiB:.0f} GiB free)")
    out: dict[str, Any] = {
        "machine": machine,
        "config": {
            "mib": args.mib,
            "snapshots": args.snapshots,
            "steps_between": args.steps_between,
            "train_steps": args.train_steps,
            "seed": args.seed,
            "chunk_size_default": tunables.get().chunk_size,
            "pack_threshold": tunables.get().pack_threshold,
        },
    }
    t0 = time.perf_counter()
    try:
        out["warm_up_s"] = warm_up(base)
        if args.part in ("all", "incremental"):
            out["incremental"] = [run_scenario(sc, base, args) for sc in scenarios()]
        if args.part in ("all", "compression"):
            out["compression"] = run_compression(base, args)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out["seconds"] = time.perf_counter() - t0
    return out


def report(out: dict[str, Any]) -> str:
    parts = []
    if "incremental" in out:
        parts.append(report_incremental(out["incremental"]))
    if "compression" in out:
        parts.append(report_compression(out["compression"]))
    parts.append(f"\ntotal {out['seconds']:.0f}s")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--mib",
        type=float,
        default=256,
        help="fp32 parameter MiB of the full / LoRA stack and of the embedding (default 256)",
    )
    p.add_argument("--snapshots", type=int, default=5, help="snapshots per scenario (default 5)")
    p.add_argument(
        "--steps-between",
        type=int,
        default=3,
        help="optimizer steps before each snapshot (default 3)",
    )
    p.add_argument(
        "--train-steps",
        type=int,
        default=300,
        help="AdamW steps before measuring compression (default 300)",
    )
    p.add_argument("--part", choices=("all", "incremental", "compression"), default="all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dir", default=None, help="where to write (default: the system's temporary directory)"
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.snapshots < 2:
        p.error("--snapshots must be at least 2 (the first one writes everything)")
    if args.steps_between < 1 or args.train_steps < 1 or args.mib <= 0:
        p.error("--steps-between, --train-steps and --mib must be positive")

    out = run(args)
    emit(out, report(out), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
