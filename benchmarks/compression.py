"""Compression of trained state: stored size, save and load speed of each codec.

A stack of pre-norm MLP blocks (``--mib``/8 MiB of fp32 parameters, at least 4) is trained for
``--train-steps`` AdamW steps on a synthetic regression task (a fixed random teacher), so
weights and moments are trained values, not random ones. For each kind -- fp32 weights, the
same weights cast to bf16, AdamW ``exp_avg``, ``exp_avg_sq`` -- a state holding only that kind
is saved with ``ts.save(..., options=ts.SaveOptions(compression=...))`` (None, "zstd",
"bytegroup+zstd") into a fresh root and loaded back with ``ts.load`` into zeroed tensors, 3
times: stored size / raw size, and raw bytes / median seconds of the save (compression,
hashing, writing) and of the load (reading from the page cache -- the file was just written --
verifying and decompressing). ``None`` is the reference without a codec. Every load is checked
bit for bit.

This is also part 2 of ``benchmarks.incremental``.

    python -m benchmarks.compression                  # a 32 MiB stack, 300 AdamW steps
    python -m benchmarks.compression --mib 64 --train-steps 50 --json out.json
    python -m benchmarks.compression --smoke          # tiny: does it run and verify?
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import trainsnap as ts
from benchmarks._framework import cli
from benchmarks._framework.adapters import SaveLog, Trainsnap
from benchmarks._framework.method import Measurements, Method, SaveLoadRound, timed
from benchmarks._framework.report import Check, Column, emit, facts, records_table, verdicts
from benchmarks._framework.state import (
    MiB,
    Tensors,
    check_bitwise_equal,
    clear_state,
    empty_like_state,
    state_nbytes,
)
from benchmarks._framework.system import fresh_dir, load_average, machine_info, scratch_root
from benchmarks._framework.training import Stack, param_bytes, regression_loss, stack_width, stepper

CODECS: tuple[str | None, ...] = (None, "zstd", "bytegroup+zstd")
COMPRESSION_REPS = 3
SMOKE = {"mib": 2.0, "train_steps": 2}


def train_for_compression(args: Any) -> tuple[Stack, torch.optim.AdamW, list[float]]:
    layers = 4
    width = stack_width(max(4.0, args.mib / 8), layers)
    torch.manual_seed(args.seed + 7)
    model = Stack(width, layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    step = stepper(optimizer, regression_loss(model, width, 64, args.seed + 7))
    losses = [step() for _ in range(args.train_steps)]
    return model, optimizer, losses


def kinds_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Tensors]:
    named = list(model.named_parameters())
    return {
        "fp32 weights": {n: p.detach().clone() for n, p in named},
        "bf16 weights": {n: p.detach().to(torch.bfloat16) for n, p in named},
        "adam exp_avg": {n: optimizer.state[p]["exp_avg"].clone() for n, p in named},
        "adam exp_avg_sq": {n: optimizer.state[p]["exp_avg_sq"].clone() for n, p in named},
    }


def measure_codec(state: Tensors, codec: str | None, base: Path) -> dict[str, Any]:
    """``COMPRESSION_REPS`` saves and loads (from the page cache) of ``state`` with ``codec``,
    each into a fresh root, each load checked."""
    method = Trainsnap(name=codec or "none", options=ts.SaveOptions(compression=codec))
    results, stored, logged = Measurements(), [], []
    for repetition in range(COMPRESSION_REPS):
        destination = empty_like_state(state)

        def verify(
            method: Method, destination: Tensors = destination, rep: int = repetition
        ) -> None:
            check_bitwise_equal(state, destination, f"{codec} load, repetition {rep + 1}")

        one = SaveLoadRound(
            state=state,
            destination=destination,
            clear=clear_state,
            before_load=_page_cache_kept,
            verify=verify,
        )
        with SaveLog() as log, fresh_dir(base, f"codec-{codec}-") as root:
            one.run([method], {method.name: root}, results)
            assert method.last_info is not None
            stored.append(method.last_info.nbytes)
            logged += log.saves
    raw = state_nbytes(state)
    return {
        "codec": method.name,
        "raw_bytes": raw,
        "stored_bytes": stored[-1],
        "ratio": stored[-1] / raw,
        "save_s": results.series(method.name, "save"),
        "load_s": results.series(method.name, "load"),
        "save_MBps": raw / results.median(method.name, "save") / 1e6,
        "load_MBps": raw / results.median(method.name, "load") / 1e6,
        "bitwise_equal": True,
        "logged_referenced_written": logged[-1] if logged else None,
    }


def _page_cache_kept(directory: Path) -> None:
    """Loads read what the save just wrote, from the page cache: no eviction."""


def warm_up(base: Path) -> float:
    """One small save and load with each codec, so that one-time costs (lazy imports, pools)
    fall on no measurement."""
    start = time.perf_counter()
    tensors = {"w": torch.randn(64, 64)}
    for codec in CODECS:
        with fresh_dir(base, "warm-up-") as root:
            ts.save(tensors, root, step=1, options=ts.SaveOptions(compression=codec))
            ts.load(empty_like_state(tensors), root)
    return time.perf_counter() - start


def run_compression(base: Path, args: Any) -> dict[str, Any]:
    """Train, then measure every kind with every codec (see the module's docstring)."""
    warm_up_s = warm_up(base)
    print(f"\ntraining for compression ({args.train_steps} AdamW steps) ...", flush=True)
    train_s, (model, optimizer, losses) = timed(lambda: train_for_compression(args))
    print(
        f"  {param_bytes(model) / MiB:.1f} MiB of fp32 parameters, loss {losses[0]:.4f} -> "
        f"{losses[-1]:.4f} in {train_s:.1f}s",
        flush=True,
    )
    results = []
    for kind, state in kinds_of(model, optimizer).items():
        for codec in CODECS:
            result = measure_codec(state, codec, base) | {"kind": kind}
            results.append(result)
            print(
                f"  {kind} {result['codec']}: {100 * result['ratio']:.1f}% of raw, save "
                f"{result['save_MBps']:.0f} MB/s, load {result['load_MBps']:.0f} MB/s (bitwise "
                "equal)",
                flush=True,
            )
    return {
        "train_steps": args.train_steps,
        "param_bytes": param_bytes(model),
        "loss_first": losses[0] if losses else math.nan,
        "loss_last": losses[-1] if losses else math.nan,
        "train_s": train_s,
        "warm_up_s": warm_up_s,
        "results": results,
    }


def _logged_written(result: dict[str, Any]) -> str:
    logged = result["logged_referenced_written"]
    return "-" if logged is None else f"{logged[1] / MiB:.2f}"


CODEC_COLUMNS: list[Column] = [
    ("kind", lambda r: r["kind"]),
    ("codec", lambda r: r["codec"]),
    ("raw MiB", lambda r: r["raw_bytes"] / MiB),
    ("stored MiB", lambda r: r["stored_bytes"] / MiB),
    ("stored/raw %", lambda r: 100 * r["ratio"]),
    ("save MB/s", lambda r: r["save_MBps"]),
    ("load MB/s", lambda r: r["load_MBps"]),
    ("logged written MiB", _logged_written),
    ("bitwise", lambda r: "yes" if r["bitwise_equal"] else "NO"),
]


def _written_more(results: list[dict[str, Any]]) -> bool:
    """Whether a save's logged written bytes exceed what it stores (decoded bytes counted)."""
    return any(
        r["logged_referenced_written"] and r["logged_referenced_written"][1] > r["stored_bytes"]
        for r in results
    )


def report_compression(out: dict[str, Any]) -> tuple[list[str], list[Check]]:
    """The codecs' table, and stored/raw of bytegroup+zstd per kind (reported, no target)."""
    lines = [
        "",
        "== Part 2: compression of trained state (ts.save + ts.load, medians of "
        f"{COMPRESSION_REPS}) ==",
        f"model: {out['param_bytes'] / MiB:.1f} MiB of fp32 parameters after "
        f"{out['train_steps']} AdamW steps (loss {out['loss_first']:.4f} -> "
        f"{out['loss_last']:.4f})",
        "",
        records_table(out["results"], CODEC_COLUMNS, digits=1),
    ]
    if _written_more(out["results"]):
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
    checks = [
        Check(f"{r['kind']} {r['codec']}: stored/raw", r["ratio"])
        for r in out["results"]
        if r["codec"] == "bytegroup+zstd"
    ]
    return lines, checks


def add_arguments(arguments: Any, mib_help: str = "fp32 parameter MiB / 8 of the model") -> None:
    """``--mib`` and ``--train-steps`` (shared with ``benchmarks.incremental``)."""
    arguments.add_argument("--mib", type=float, default=256, help=f"{mib_help} (default 256)")
    arguments.add_argument(
        "--train-steps",
        type=int,
        default=300,
        help="AdamW steps before measuring compression (default 300)",
    )


def main(argv: list[str] | None = None) -> int:
    arguments = cli.parser(__doc__)
    add_arguments(arguments)
    args = cli.parse(
        arguments,
        argv,
        SMOKE,
        lambda a: (
            "--train-steps and --mib must be positive" if a.train_steps < 1 or a.mib <= 0 else None
        ),
    )
    machine = machine_info() | {"loadavg_start": load_average()}
    print(facts("machine", machine))
    with scratch_root(args.dir, 8 * args.mib * MiB, "trainsnap-bench-") as base:
        out = run_compression(base, args)
    lines, checks = report_compression(out)
    lines += ["", "== targets", verdicts(checks, digits=3)]
    emit({"machine": machine, "compression": out, "checks": checks}, "\n".join(lines), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
