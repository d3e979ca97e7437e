"""The manager's after-commit path: retention reclaims disk at once while the manager is the
root's only writer, the work runs off the training path (a handle is done at its commit, errors
come back at the next call), steps that cannot save make no control-plane operation, and a
step predicate saves at exactly the steps it names on several processes. Also the save log
line's phases and the order of a handle's callbacks and its wait()."""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import trainsnap as ts
from trainsnap import faults
from trainsnap.manager import collection
from trainsnap.manager.housekeeping import SaveGate
from trainsnap.protocol import commit
from trainsnap.storage import open_storage
from trainsnap.testing import assert_all_ok, run_ranks


def _objects_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "objects").rglob("*") if p.is_file())


def _garbage(root: Path, n: int) -> None:
    """``n`` committed-then-deleted snapshots: unreferenced objects, young."""
    for i in range(n):
        info = ts.save({"junk": torch.randn(64, 64)}, root, step=1000 + i)
        ts.delete(root, info.id)


# -- A: retention reclaims disk at once ---------------------------------------------------------


def test_keep_last_3_holds_at_most_4_snapshots_of_bytes_after_each_save(tmp_path):
    state = {"w": torch.randn(512, 512)}  # 1 MiB, all of it new at each save
    nbytes = []
    with ts.CheckpointManager(
        tmp_path, interval=ts.Every(steps=1), retention=ts.KeepLast(3), async_save=True
    ) as mgr:
        for step in range(10):
            state["w"] = torch.randn(512, 512)
            assert mgr.step(step, state)
            mgr.wait()  # the commit and its after-commit work
            nbytes.append(_objects_bytes(tmp_path))
    one = ts.list_snapshots(tmp_path)[-1].nbytes
    assert max(nbytes) <= 4 * one * 1.01, [round(n / one, 2) for n in nbytes]
    assert nbytes[-1] <= 3 * one * 1.01  # settled: exactly the 3 kept
    assert [s.step for s in ts.list_snapshots(tmp_path)] == [7, 8, 9]
    assert ts.verify(tmp_path).ok


def test_collection_stops_while_a_save_is_in_flight(tmp_path):
    _garbage(tmp_path, 2)
    storage = open_storage(tmp_path)
    gate = SaveGate()
    token = gate.begin()
    held = collection.collect(storage, grace=None, gate=gate)
    assert held.interrupted and not held.objects_deleted
    gate.end(token)

    class BeginsASave:
        """Deleting the first object lets a save begin: nothing more may go."""

        def __init__(self, inner: Any) -> None:
            self.inner, self.deleted = inner, 0

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def delete(self, key: str) -> None:
            self.inner.delete(key)
            self.deleted += key.startswith("objects/")

        def stat(self, key: str) -> int:
            if self.deleted == 1 and gate.begun == 1:
                gate.begin()  # between the first deletion and the next one
            return int(self.inner.stat(key))

    wrapped = BeginsASave(storage)
    report = collection.collect(wrapped, grace=None, gate=gate)  # type: ignore[arg-type]
    assert report.interrupted and wrapped.deleted == 1 == len(report.objects_deleted)
    assert len(list(storage.list("objects/"))) >= 1


# -- D: off the training path -------------------------------------------------------------------


def test_a_handle_is_done_at_its_commit_before_promotion(tmp_path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    faults.install("promote_manifest=delay:2.0")
    try:
        with ts.CheckpointManager(remote, local=ts.LocalTier(root=local), async_save=True) as mgr:
            handle = mgr.save(1, {"w": torch.randn(64, 64)})
            assert isinstance(handle, ts.SaveHandle)
            info = handle.wait()
            assert mgr.durable_step is None  # promotion still running in the background
            assert [s.id for s in ts.list_snapshots(local)] == [info.id]
            mgr.wait()
            assert mgr.durable_step == 1
    finally:
        faults.clear()


def test_an_after_commit_error_is_raised_by_the_next_step(tmp_path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    faults.install("promote_marker=raise")
    mgr = ts.CheckpointManager(
        remote, interval=ts.Every(steps=1), local=ts.LocalTier(root=local), async_save=False
    )
    try:
        assert mgr.step(1, {"w": torch.zeros(8)})  # committed locally; promotion fails later
        with pytest.raises(ts.TrainsnapError, match="after-commit work of snapshot"):
            for step in range(2, 50):
                mgr.step(step, {"w": torch.zeros(8)})
                time.sleep(0.05)
    finally:
        faults.clear()
        mgr.close()


def _ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    """Two managers on 2 processes: a predicate interval, and one whose training-thread
    control-plane operations are counted step by step."""
    import torch.distributed as dist

    from trainsnap.manager import checkpoint_manager
    from trainsnap.protocol.control_plane import StoreComm
    from trainsnap.testing.counting_store import CountingStore, StoreCounts

    out: dict[str, Any] = {}
    state = {"w": torch.full((16,), float(rank))}
    with ts.CheckpointManager(
        f"{root}/predicate", interval=lambda info: info.step in (3, 7), async_save=True
    ) as mgr:
        out["predicate"] = [s for s in range(10) if mgr.step(s, state)]

    class TrainingThread(StoreCounts):
        def __init__(self) -> None:
            super().__init__()
            self.training = 0

        def record(self, method: str, sent: int, received: int, key: str = "") -> None:
            super().record(method, sent, received, key)
            if threading.current_thread() is threading.main_thread():
                self.training += 1

    counts = TrainingThread()
    store = CountingStore(dist.distributed_c10d._get_default_store(), counts)

    def counted(coordinator: int, timeout: float | None) -> StoreComm:
        return StoreComm(store, rank, world, coordinator=coordinator)

    checkpoint_manager.comm_for = counted  # type: ignore[assignment]
    mgr = ts.CheckpointManager(
        f"{root}/remote",
        interval=ts.Every(steps=10),
        retention=ts.KeepLast(2),
        local=ts.LocalTier(root=f"{root}/local", interval=ts.Every(steps=4)),
        async_save=True,
        options=ts.ManagerOptions(decision_seconds=60.0),
    )
    rows = []
    for step in range(1, 31):
        time.sleep(0.01)
        state["w"].add_(1)
        before = counts.training
        saved = mgr.step(step, state)
        rows.append((step, saved, counts.training - before))
        dist.barrier()  # the training's own collective
    mgr.close()
    out["rows"] = rows
    out["decision_calls"] = list(mgr._decisions.decision_steps)
    return out


def test_predicates_save_on_time_and_idle_steps_cost_no_store_operation(tmp_path):
    results = assert_all_ok(run_ranks(_ranks, 2, args=(str(tmp_path),), timeout=180))
    for r in results:
        assert r["predicate"] == [3, 7]  # was [4, 8]: a predicate is not a shared decision
        saved = [step for step, s, _ in r["rows"] if s]
        assert saved == [4, 8, 10, 12, 16, 20, 24, 28, 30]
        assert r["decision_calls"] == [0, 1]  # then 60 s of steps ahead
        decision_steps = {r["rows"][c][0] for c in r["decision_calls"]}
        idle = [
            (step, ops)
            for step, s, ops in r["rows"]
            if not s and step not in decision_steps and ops
        ]
        assert idle == []  # was 4 store checks a step (8 on the coordinator)
    assert [s.step for s in ts.list_snapshots(tmp_path / "predicate")] == [3, 7]
    assert [s.step for s in ts.list_snapshots(tmp_path / "remote")] == [20, 30]


# -- B: honest log lines, callbacks before wait() -----------------------------------------------

_LINE = re.compile(r"wait=([-\d.]+) pause=([-\d.]+) drain=([-\d.]+) seconds=([-\d.]+)")


def test_save_log_phases_are_non_negative_and_add_up(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trainsnap.protocol.save_protocol")
    saver = ts.AsyncSaver(max_in_flight=1)
    faults.install("after_write=delay:0.4#1")  # the first save drains slowly
    try:
        first = ts.async_save({"w": torch.randn(256, 256)}, tmp_path, step=1, saver=saver)
        second = ts.async_save({"w": torch.randn(8)}, tmp_path, step=2, saver=saver)
        first.wait()
        second.wait()
    finally:
        faults.clear()
        saver.close()
    lines = [r.getMessage() for r in caplog.records if "saved snapshot" in r.getMessage()]
    assert len(lines) == 2
    phases = []
    for line in lines:
        match = _LINE.search(line)
        assert match, line
        wait, pause, drain, seconds = map(float, match.groups())
        assert min(wait, pause, drain, seconds) >= 0, line
        assert abs(wait + pause + drain - seconds) <= 0.0021, line
        phases.append(wait)
    assert phases[1] >= 0.3  # the second save waited for the first, and says so


def test_wait_returns_only_after_the_done_callbacks_ran(tmp_path):
    ran: list[str] = []

    def slow(handle: ts.SaveHandle) -> None:
        time.sleep(0.5)
        ran.append(handle.wait().id)  # waiting inside a callback returns at once

    saver = ts.AsyncSaver()
    faults.install("after_write=delay:0.3")  # registered while the save is in flight
    try:
        handle = ts.async_save({"w": torch.randn(64)}, tmp_path, step=1, saver=saver)
        handle.add_done_callback(slow)
        assert not handle.done()
        info = handle.wait()
    finally:
        faults.clear()
    assert ran == [info.id] and handle.done()
    saver.close()
    storage = open_storage(tmp_path)
    assert [c.snapshot_id for c in commit.list_committed(storage)] == [info.id]
