"""What frameworks need from the public API: ts.delete, restore(step=), no_dist, and done
callbacks on asynchronous saves."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import trainsnap as ts
from trainsnap import faults
from trainsnap.testing import assert_all_ok, run_ranks


def _state(value: float) -> dict:
    return {"w": torch.full((64,), value), "frozen": torch.arange(1000.0)}


def test_delete_removes_one_snapshot_and_never_breaks_another(tmp_path: Path) -> None:
    first = ts.save(_state(1.0), tmp_path, step=1).id
    second = ts.save(_state(2.0), tmp_path, step=2).id  # shares the "frozen" object
    ts.delete(tmp_path, first)
    assert [s.id for s in ts.list_snapshots(tmp_path)] == [second]
    out = {"w": torch.zeros(64), "frozen": torch.zeros(1000)}
    ts.load(out, tmp_path)
    assert torch.equal(out["w"], torch.full((64,), 2.0))
    assert torch.equal(out["frozen"], torch.arange(1000.0))
    assert ts.verify(tmp_path).ok
    with pytest.raises(ts.NotFoundError, match=first):
        ts.delete(tmp_path, first)


def test_delete_removes_the_marker_first(tmp_path: Path) -> None:
    sid = ts.save(_state(1.0), tmp_path, step=1).id
    faults.install("delete_uncommitted=raise")  # right after the marker is gone
    try:
        with pytest.raises(faults.InjectedFault):
            ts.delete(tmp_path, sid)
    finally:
        faults.clear()
    assert ts.list_snapshots(tmp_path) == []  # interrupted, it is already uncommitted
    assert (tmp_path / "snapshots" / sid).exists()


def test_restore_a_given_step(tmp_path: Path) -> None:
    options = ts.ManagerOptions(preemption_signals=())
    with ts.CheckpointManager(tmp_path, async_save=False, options=options) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, _state(float(step)))
    with ts.CheckpointManager(tmp_path, options=options) as mgr:
        out = {"w": torch.zeros(64), "frozen": torch.zeros(1000)}
        info = mgr.restore(out, step=20)
        assert info is not None and info.step == 20
        assert torch.equal(out["w"], torch.full((64,), 20.0))
        with pytest.raises(ts.NotFoundError, match=r"step 25.*\[10, 20, 30\]"):
            mgr.restore(out, step=25)


def _rank_zero_saves_alone(rank: int, world_size: int, root: str) -> list[int]:
    if rank == 0:  # the other rank never calls save: with no_dist nothing waits for it
        ts.save({"w": torch.arange(5.0)}, root, step=3, no_dist=True)
        ts.async_save({"w": torch.arange(6.0)}, root, step=4, no_dist=True).wait()
    torch.distributed.barrier()
    return [s.step for s in ts.list_snapshots(root)]


def test_no_dist_saves_one_process_alone_inside_a_process_group(tmp_path: Path) -> None:
    steps = assert_all_ok(run_ranks(_rank_zero_saves_alone, world_size=2, args=(str(tmp_path),)))
    assert steps == [[3, 4], [3, 4]]
    out = {"w": torch.zeros(6)}
    ts.load(out, tmp_path)
    assert torch.equal(out["w"], torch.arange(6.0))


def test_done_callbacks_run_once_the_save_is_committed(tmp_path: Path) -> None:
    faults.install("after_write=delay:0.3")
    seen: list[tuple[str, bool]] = []
    called = threading.Event()

    def note(handle: ts.SaveHandle) -> None:
        seen.append((handle.wait().id, handle.done()))
        called.set()

    def broken(handle: ts.SaveHandle) -> None:
        raise RuntimeError("a callback's own bug")

    try:
        handle = ts.async_save(_state(1.0), tmp_path, step=1, saver=ts.AsyncSaver())
        handle.add_done_callback(broken)  # logged; changes nothing
        handle.add_done_callback(note)
        assert not seen  # still writing
        info = handle.wait()
    finally:
        faults.clear()
    assert called.wait(10) and seen == [(info.id, True)]
    late: list[str] = []
    handle.add_done_callback(lambda h: late.append(h.snapshot_id))  # already done: runs now
    assert late == [info.id]
