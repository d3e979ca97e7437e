"""One rule for a damaged "latest": ``ts.load`` and ``mgr.restore`` fall back to the previous
snapshot for every kind of damage a verify finds, saying which snapshot and what damage, and
the state ends exactly as the older snapshot has it (nothing of the damaged one remains)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import trainsnap as ts
from trainsnap.protocol import commit
from trainsnap.storage import open_storage


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(512, 1024, generator=g),  # 2 MiB each: objects of their own
        "b": torch.randn(512, 1024, generator=g),
        "cfg": {"seed": seed},
    }


def _blank() -> dict:
    return {"a": torch.zeros(512, 1024), "b": torch.zeros(512, 1024), "cfg": {"seed": None}}


def _two(root: Path) -> tuple[str, str]:
    old = ts.save(_state(1), root, step=1).id
    new = ts.save(_state(2), root, step=2).id
    return old, new


def _largest_object(root: Path, sid: str) -> Path:
    names = commit.open_snapshot(open_storage(root), sid).object_names
    paths = [next(root.rglob(name)) for name in names]
    return max(paths, key=lambda p: p.stat().st_size)


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


def _break_marker(root: Path, sid: str) -> None:
    marker = next(p for p in (root / "snapshots" / sid).iterdir() if "COMMITTED" in p.name)
    marker.write_bytes(b"{not json")


def _equal(state: dict, seed: int) -> bool:
    want = _state(seed)
    return (
        torch.equal(state["a"], want["a"])
        and torch.equal(state["b"], want["b"])
        and state["cfg"] == want["cfg"]
    )


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_latest_with_a_damaged_object_loads_the_previous_one_and_says_so(tmp_path, caplog, damage):
    old, new = _two(tmp_path)
    (_truncate if damage == "truncated" else _flip)(_largest_object(tmp_path, new))
    caplog.set_level(logging.WARNING, logger="trainsnap")
    state = _blank()
    info = ts.load(state, tmp_path)
    assert info.id == old and _equal(state, 1)  # every key re-filled from the older one
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned and new in warned[0] and "damaged" in warned[0] and old in warned[0]
    with pytest.raises((ts.CorruptError, ts.IncompleteError)):
        ts.load(_blank(), tmp_path, snapshot=new)  # a named snapshot never falls back


def test_latest_with_a_broken_marker_loads_the_previous_one(tmp_path):
    old, new = _two(tmp_path)
    _break_marker(tmp_path, new)
    state = _blank()
    assert ts.load(state, tmp_path).id == old and _equal(state, 1)


def test_when_no_snapshot_loads_the_newest_ones_damage_is_raised(tmp_path):
    old, new = _two(tmp_path)
    _truncate(_largest_object(tmp_path, new))
    _flip(_largest_object(tmp_path, old))
    with pytest.raises((ts.CorruptError, ts.IncompleteError)) as raised:
        ts.load(_blank(), tmp_path)
    assert new in str(raised.value) or raised.value.snapshot_id == new


def test_a_state_that_does_not_fit_is_not_a_fallback(tmp_path):
    _two(tmp_path)
    with pytest.raises(ts.TrainsnapError) as raised:
        ts.load({"a": torch.zeros(3), "b": torch.zeros(512, 1024)}, tmp_path)
    assert not isinstance(raised.value, ts.CorruptError | ts.IncompleteError)


def test_the_manager_applies_the_same_rule_to_a_truncated_object(tmp_path, caplog):
    old, new = _two(tmp_path)
    _truncate(_largest_object(tmp_path, new))
    caplog.set_level(logging.WARNING, logger="trainsnap")
    state = _blank()
    with ts.CheckpointManager(tmp_path) as mgr:
        info = mgr.restore(state, level="weights")
    assert info is not None and info.id == old and _equal(state, 1)
    assert any(new in r.getMessage() for r in caplog.records)
