"""CheckpointManager: the loop API, retention and collection, preemption, fallback on damage,
fencing of zombie writers, the restart log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import trainsnap as ts
from trainsnap import faults
from trainsnap.manager import collection, lease
from trainsnap.protocol import commit
from trainsnap.storage import open_storage
from trainsnap.testing import run_ranks
from trainsnap.tools.cli import app


def _objects(root: Path) -> set[str]:
    return {
        p.name for p in (root / "objects").rglob("*") if p.is_file() and not p.name.startswith(".")
    }


def _referenced(root: Path) -> set[str]:
    storage = open_storage(root)
    out: set[str] = set()
    for c in commit.list_committed(storage):
        out |= set(commit.open_snapshot(storage, c.snapshot_id).object_names)
    return out


def _train(state: dict, step: int) -> None:
    state["w"].add_(1.0)
    state["step"] = step


def test_loop_saves_on_schedule_keeps_what_retention_says_and_collects(tmp_path):
    state = {"w": torch.zeros(256, 256), "step": 0}
    with ts.CheckpointManager(
        tmp_path,
        interval=ts.Every(steps=5),
        retention=ts.KeepLast(2),
        options=ts.ManagerOptions(gc_grace=0.0),
    ) as mgr:
        assert mgr.restore(state) is None
        saved = [s for s in range(23) if (_train(state, s), mgr.step(s, state))[1]]
    assert saved == [0, 5, 10, 15, 20]
    assert [s.step for s in ts.list_snapshots(tmp_path)] == [15, 20]
    assert _objects(tmp_path) == _referenced(tmp_path)  # collected after each commit
    assert ts.verify(tmp_path).ok
    fresh = {"w": torch.zeros(256, 256), "step": None}
    with ts.CheckpointManager(tmp_path) as mgr2:
        info = mgr2.restore(fresh)
    assert info is not None and info.step == 20 and fresh["step"] == 20
    assert torch.equal(fresh["w"], torch.full((256, 256), 21.0))


def test_gc_command_leaves_only_kept_objects_and_every_kept_snapshot_verifies(tmp_path):
    state = {"w": torch.zeros(64, 64), "b": torch.zeros(8), "step": 0}
    retention = [ts.KeepLast(2), ts.KeepEvery(10), ts.KeepBest("loss", "min", 1)]
    with ts.CheckpointManager(tmp_path, interval=ts.Every(steps=1), retention=retention) as mgr:
        for s in range(25):
            _train(state, s)
            mgr.step(s, state, metrics={"loss": 100.0 - s if s != 7 else -1.0})
    kept = [s.step for s in ts.list_snapshots(tmp_path)]
    assert kept == [0, 7, 10, 20, 23, 24]
    assert _objects(tmp_path) == _referenced(tmp_path)  # the only writer collected at once
    # Garbage no manager collected: a snapshot deleted by hand.
    extra = ts.save({"junk": torch.randn(32, 32)}, tmp_path, step=99)
    ts.delete(tmp_path, extra.id)
    assert _objects(tmp_path) > _referenced(tmp_path)
    result = CliRunner().invoke(app, ["gc", str(tmp_path), "--dry-run"])
    assert result.exit_code == 0 and "would free" in result.output
    result = CliRunner().invoke(app, ["gc", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "freed" in result.output and "no active writer" in result.output
    assert _objects(tmp_path) == _referenced(tmp_path)
    report = ts.verify(tmp_path)
    assert report.ok and [s.step for s in report.snapshots] == kept


def test_collection_during_an_async_save_never_deletes_what_it_needs(tmp_path):
    """Force the interleaving: the save has written its objects (one of them reused from a
    deleted snapshot, so old) and waits before its manifest while a collection runs."""
    storage = open_storage(tmp_path)
    shared = torch.randn(512, 1024)  # 2 MiB: an object of its own, reused by the second save
    first = ts.save({"w": shared, "v": torch.zeros(10)}, storage, step=1)
    reused = set(commit.open_snapshot(storage, first.id).object_names)
    # Make every object look old, then uncommit the snapshot: its objects are garbage now.
    for p in (tmp_path / "objects").rglob("*"):
        os.utime(p, (time.time() - 7200, time.time() - 7200))
    commit.delete_snapshot(storage, first.id)
    faults.install("before_manifest=delay:1.5")
    saver = ts.AsyncSaver()
    handle = ts.async_save({"w": shared, "v": torch.ones(10)}, storage, step=2, saver=saver)
    time.sleep(0.5)  # the save is past its writes, before its manifest
    report = collection.collect(storage, grace=600.0)
    info = handle.wait()
    saver.close()
    needed = set(commit.open_snapshot(storage, info.id).object_names)
    assert not set(report.objects_deleted) & needed
    assert len(needed & reused) == 1  # the object of w: old, reused, refreshed, kept
    assert report.objects_deleted  # the old pack holding v was garbage: collected
    assert ts.verify(storage).ok
    dst = {"w": torch.zeros(512, 1024), "v": torch.zeros(10)}
    ts.load(dst, storage, snapshot=info.id)
    assert torch.equal(dst["w"], shared)


def test_newest_snapshot_corrupted_restore_falls_back_and_says_why(tmp_path, caplog):
    state = {"w": torch.zeros(128, 128), "step": 0}
    with ts.CheckpointManager(tmp_path, interval=ts.Every(steps=1), async_save=False) as mgr:
        for s in range(2):
            _train(state, s)
            mgr.step(s, state)
    newest = ts.list_snapshots(tmp_path)[-1]
    m = commit.open_snapshot(open_storage(tmp_path), newest.id)
    victim = next(p for p in (tmp_path / "objects").rglob(m.object_names[0]))
    data = bytearray(victim.read_bytes())
    data[5] ^= 0x40
    victim.write_bytes(bytes(data))
    fresh = {"w": torch.zeros(128, 128), "step": None}
    with ts.CheckpointManager(tmp_path) as mgr2:
        info = mgr2.restore(fresh)
    assert info is not None and info.step == 0 and fresh["step"] == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(newest.id in w and "trying the next" in w and "checksum" in w for w in warnings)


def test_a_state_that_does_not_fit_is_not_hidden_by_fallback(tmp_path):
    with ts.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"w": torch.zeros(4)})
        mgr.save(2, {"w": torch.zeros(4)})
    with ts.CheckpointManager(tmp_path) as mgr2, pytest.raises(ts.IncompatibleError):
        mgr2.restore({"w": torch.zeros(5)})


# -- preemption ---------------------------------------------------------------------------------

_PREEMPT = textwrap.dedent(
    """
    import signal, sys, time, torch, trainsnap as ts
    chained = []
    signal.signal(signal.SIGTERM, lambda s, f: chained.append(s))
    state = {"w": torch.zeros(64, 64), "step": -1}
    mgr = ts.CheckpointManager(sys.argv[1], interval=ts.Every(steps=1000))
    for step in range(1, 10_000):
        state["w"].add_(1)
        state["step"] = step
        saved = mgr.step(step, state)
        print(f"step {step} saved={saved}", flush=True)
        if mgr.preempted:
            print(f"preempted at {step} chained={chained}", flush=True)
            break
        time.sleep(0.02)
    mgr.close()
    """
)


def test_sigterm_saves_at_the_next_step_and_exits_cleanly(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", _PREEMPT, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if line.startswith("step 20 "):
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=120)
    lines += rest.splitlines()
    assert proc.returncode == 0
    final = [x for x in lines if x.startswith("preempted at")]
    assert len(final) == 1 and "chained=[15]" in final[0]
    step = int(final[0].split()[2])
    assert step >= 20
    assert [s.step for s in ts.list_snapshots(tmp_path)] == [step]
    dst = {"w": torch.zeros(64, 64), "step": None}
    ts.load(dst, tmp_path)
    assert dst["step"] == step and dst["w"][0, 0].item() == step
    kinds = [e["kind"] for e in lease.events(open_storage(tmp_path))]
    assert kinds[-3:] == ["save", "preempt", "close"]


# -- fencing ------------------------------------------------------------------------------------


def _zombie_writer(rank: int, world: int, root: str, gate: str) -> str:
    state = {"w": torch.zeros(32, 32), "step": 1}
    mgr = ts.CheckpointManager(root, async_save=False)
    mgr.save(1, state)
    Path(gate + ".saved").write_text("1")
    # The second save pauses before its manifest (as if the process stopped) until the gate.
    faults.install("before_manifest=delay:0.1")
    while not Path(gate + ".go").exists():
        time.sleep(0.05)
    state["w"].add_(1)
    try:
        mgr.save(2, state)
    except ts.CommitFailedError as e:
        return f"refused: {e}"
    return "committed"


def _new_writer(rank: int, world: int, root: str, gate: str) -> float:
    while not Path(gate + ".saved").exists():
        time.sleep(0.05)
    t0 = time.monotonic()
    mgr = ts.CheckpointManager(root, async_save=False)
    took = time.monotonic() - t0
    mgr.save(10, {"w": torch.ones(32, 32), "step": 10})
    Path(gate + ".go").write_text("1")
    mgr.close()
    return took


def test_a_paused_writer_cannot_commit_after_a_newer_one_took_over(tmp_path):
    root, gate = str(tmp_path / "root"), str(tmp_path / "gate")
    results = {}

    def run(name, fn):
        results[name] = run_ranks(fn, 1, args=(root, gate), init_pg=False, timeout=120)[0]

    threads = [
        threading.Thread(target=run, args=(n, f))
        for n, f in [("zombie", _zombie_writer), ("new", _new_writer)]
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    zombie, new = results["zombie"], results["new"]
    assert new.error is None and new.value < 5.0
    assert zombie.error is None and zombie.value.startswith("refused"), zombie
    assert "superseded by generation 2" in zombie.value
    assert [s.step for s in ts.list_snapshots(root)] == [1, 10]


def _killed_writer(rank: int, world: int, root: str) -> None:
    mgr = ts.CheckpointManager(root, async_save=False)
    mgr.save(1, {"w": torch.zeros(4)})
    os.kill(os.getpid(), signal.SIGKILL)


def _restarted_writer(rank: int, world: int, root: str) -> tuple[float, int | None, list[str]]:
    t0 = time.monotonic()
    mgr = ts.CheckpointManager(root, async_save=False)
    took = time.monotonic() - t0
    info = mgr.restore({"w": torch.zeros(4)})
    mgr.save(2, {"w": torch.zeros(4)})
    mgr.close()
    kinds = [e["kind"] for e in lease.events(open_storage(root))]
    return took, None if info is None else info.step, kinds


def test_a_job_restarted_after_sigkill_takes_over_at_once(tmp_path):
    root = str(tmp_path)
    assert run_ranks(_killed_writer, 1, args=(root,), init_pg=False, timeout=60)[0].killed
    res = run_ranks(_restarted_writer, 1, args=(root,), init_pg=False, timeout=60)[0]
    assert res.error is None, res.error
    took, restored, kinds = res.value
    assert took < 2.0 and restored == 1
    assert kinds == ["start", "save", "crash_detected", "start", "restore", "save", "close"]
    assert lease.current_generation(open_storage(root)) == 2
    assert lease.active_writer(open_storage(root)) is None  # closed: released


def test_observed_mtbf_from_the_restart_log():
    evs = [
        {"generation": 1, "kind": "start", "time": 0.0},
        {"generation": 1, "kind": "save", "time": 100.0},  # crashed
        {"generation": 2, "kind": "start", "time": 110.0},
        {"generation": 2, "kind": "save", "time": 410.0},  # crashed
        {"generation": 3, "kind": "start", "time": 420.0},  # running now
    ]
    mtbf, crashes = lease.observed_mtbf(evs)
    assert crashes == 2 and mtbf == pytest.approx(200.0)
