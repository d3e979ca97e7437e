"""Diffing two snapshots: the numbers match a direct torch computation, tensors sharing their
objects are decided without reading, and added, removed, retyped and reshaped keys are named."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import trainsnap as ts
from trainsnap import tunables
from trainsnap.tools.cli import app
from trainsnap.tools.diff import (
    ADDED,
    CHANGED,
    REMOVED,
    RESHAPED,
    RETYPED,
    UNCHANGED,
    diff_snapshots,
    summary,
)


def states() -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(3)
    moved = torch.randn(30, 20, generator=g)
    same = torch.randn(64, 16, generator=g)  # 4 KiB: objects of its own with small_blocks
    a = {
        "model": {
            "moved": moved,
            "same": same,
            "gone": torch.randn(5, generator=g),
            "cast": torch.randn(6, generator=g),
            "grown": torch.zeros(3, 2),
            "nan": torch.tensor([1.0, math.nan, 3.0]),
        }
    }
    delta = torch.randn(30, 20, generator=g) * 1e-3
    b = {
        "model": {
            "moved": moved + delta,
            "same": same.clone(),
            "new": torch.ones(4),
            "cast": a["model"]["cast"].to(torch.bfloat16),
            "grown": torch.zeros(4, 2),
            "nan": torch.tensor([1.0, math.nan, 3.0]),
        }
    }
    return a, b


@pytest.fixture
def root(tmp_path: Path, small_blocks: tunables.Tunables) -> tuple[Path, str, str, dict, dict]:
    a, b = states()
    ia = ts.save(a, tmp_path, step=1).id
    ib = ts.save(b, tmp_path, step=2).id
    return tmp_path, ia, ib, a, b


def direct(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = a.double() - b.double()
    return float(d.abs().max()), float(d.norm() / a.double().norm())


def test_numbers_match_torch_and_every_key_is_classified(root) -> None:
    path, ia, ib, a, b = root
    diffs = {d.key: d for d in diff_snapshots(path, ia, ib, piece_elements=64)}
    assert {k: d.status for k, d in diffs.items()} == {
        "model.moved": CHANGED,
        "model.same": UNCHANGED,
        "model.gone": REMOVED,
        "model.new": ADDED,
        "model.cast": RETYPED,
        "model.grown": RESHAPED,
        "model.nan": UNCHANGED,
    }
    moved = diffs["model.moved"]
    want_max, want_rel = direct(a["model"]["moved"], b["model"]["moved"])
    assert moved.max_abs == pytest.approx(want_max, rel=1e-12)
    assert moved.rel_norm == pytest.approx(want_rel, rel=1e-9)
    assert moved.read and moved.shape_a == moved.shape_b == (30, 20)

    cast = diffs["model.cast"]
    want_max, want_rel = direct(a["model"]["cast"], b["model"]["cast"])
    assert (cast.dtype_a, cast.dtype_b) == ("float32", "bfloat16")
    assert cast.max_abs == pytest.approx(want_max, rel=1e-12) and cast.max_abs > 0
    assert cast.rel_norm == pytest.approx(want_rel, rel=1e-9)

    same = diffs["model.same"]
    assert not same.read, "shared objects decide it without reading"
    assert (same.max_abs, same.rel_norm) == (0.0, 0.0)
    assert diffs["model.nan"].read and diffs["model.nan"].max_abs == 0.0  # NaN == NaN bitwise

    grown = diffs["model.grown"]
    assert (grown.shape_a, grown.shape_b, grown.max_abs) == ((3, 2), (4, 2), None)
    assert diffs["model.gone"].shape_a == (5,) and diffs["model.gone"].shape_b is None
    assert diffs["model.new"].dtype_b == "float32" and diffs["model.new"].dtype_a is None
    assert summary(list(diffs.values())) == {
        CHANGED: 1,
        UNCHANGED: 2,
        ADDED: 1,
        REMOVED: 1,
        RETYPED: 1,
        RESHAPED: 1,
    }


def test_a_changed_nan_and_a_zero_reference(tmp_path: Path) -> None:
    ia = ts.save({"z": torch.zeros(3), "n": torch.tensor([1.0, 2.0])}, tmp_path, step=1).id
    ib = ts.save({"z": torch.ones(3), "n": torch.tensor([1.0, math.nan])}, tmp_path, step=2).id
    diffs = {d.key: d for d in diff_snapshots(tmp_path, ia, ib)}
    assert diffs["z"].max_abs == 1.0 and diffs["z"].rel_norm == math.inf
    assert diffs["n"].status == CHANGED and math.isnan(diffs["n"].max_abs or 0.0)


def test_progress_counts_every_byte_read(root) -> None:
    path, ia, ib, _, _ = root
    seen: list[tuple[int, int]] = []
    diff_snapshots(path, ia, ib, piece_elements=100, progress=lambda n, t: seen.append((n, t)))
    total = seen[0][1]
    assert sum(n for n, _ in seen) == total
    # moved (2 x 2400 B), cast (24 + 12 B), nan (2 x 12 B); 'same' was not read
    assert total == 2 * 2400 + 36 + 24


def test_unknown_snapshot_is_named(root) -> None:
    path, ia, _, _, _ = root
    with pytest.raises(ts.NotFoundError, match="step-000000000009-beef"):
        diff_snapshots(path, ia, "step-000000000009-beef")


def test_cli_diff_table_and_summary(root) -> None:
    path, ia, ib, _, _ = root
    res = CliRunner().invoke(app, ["diff", str(path), ia, ib])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    rows = [line.split()[0] for line in lines if line.startswith("model.")]
    # Largest relative change first; the added, removed and reshaped after; unchanged hidden.
    rel = {d.key: d.rel_norm or 0.0 for d in diff_snapshots(path, ia, ib)}
    assert rows[:2] == sorted(["model.cast", "model.moved"], key=lambda k: -rel[k])
    assert rows[2:] == ["model.grown", "model.new", "model.gone"]
    assert "7 tensor(s): 1 changed, 2 unchanged, 1 added, 1 removed, 1 retyped, 1 reshaped" in (
        res.stdout
    )
    assert "float32 -> bfloat16" in res.stdout and "(3, 2) -> (4, 2)" in res.stdout
    res = CliRunner().invoke(app, ["diff", str(path), ia, ib, "--all"])
    assert "model.same" in res.stdout and "not listed" not in res.stdout
