"""The lost work a restart reports, against what real processes did: the step a run reached is
the last step whose ``mgr.step`` returned, the restored step is never after it, and the lost
steps are exact where the log knows them (``close()``, a preemption, every step recorded) and a
lower bound that holds otherwise (default progress records)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import trainsnap as ts

_TRAIN = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch, trainsnap as ts

    root, every, stop_at, how = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ts.TrainState(model=model, optimizer=opt)
    mgr = ts.CheckpointManager(root, interval=ts.Every(steps=every))  # default progress
    info = mgr.restore(state)
    for step in range(0 if info is None else info.step + 1, 1000):
        model(torch.ones(4)).sum().backward()
        opt.step()
        opt.zero_grad()
        mgr.step(step, state)
        time.sleep(0.02)
        if step == stop_at:
            break
    if how == "close":
        mgr.close()
    else:
        mgr.wait()
        time.sleep(0.5)  # alive a moment after its last step, as a hung job would be
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


def _train(root: Path, *, every: int, stop_at: int, how: str) -> None:
    cmd = [sys.executable, "-c", _TRAIN, str(root), str(every), str(stop_at), how]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == (-signal.SIGKILL if how == "kill" else 0), out.stderr[-3000:]


def _runs(root: Path) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "trainsnap.tools.cli", "history", str(root), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    runs: list[dict[str, Any]] = json.loads(out.stdout)["runs"]
    return runs


def test_a_sigkill_with_default_progress_reports_the_steps_really_lost(tmp_path: Path) -> None:
    """Why: after SIGKILLs that lost 2 steps, the restart said "lost at least 0 step(s)" and
    `history` showed `>=0`: with the default progress the crashed run's reach was its newest
    save. The run here reached step 14 (its last returned ``mgr.step``), saved step 12."""
    _train(tmp_path, every=4, stop_at=14, how="kill")
    _train(tmp_path, every=4, stop_at=16, how="close")
    crashed, restarted = _runs(tmp_path)
    assert (crashed["end"], crashed["step_reached"]) == ("crash", 14)
    assert crashed["reach_is_lower_bound"]  # a background record: a kill may overtake one
    assert restarted["restored_step"] == 12 and restarted["restored_step"] <= 14
    assert (restarted["lost_steps"], restarted["lost_is_lower_bound"]) == (2, True)


def test_a_clean_close_reports_the_step_reached_exactly(tmp_path: Path) -> None:
    """Why: after a clean ``close()`` at step 12, the restart said "the previous run reached step
    10 and ended with close" (its newest save)."""
    _train(tmp_path, every=5, stop_at=12, how="close")
    _train(tmp_path, every=5, stop_at=14, how="close")
    first, second = _runs(tmp_path)
    assert (first["end"], first["step_reached"], first["reach_is_lower_bound"]) == (
        "close",
        12,
        False,
    )
    assert second["restored_step"] == 10
    assert (second["lost_steps"], second["lost_is_lower_bound"]) == (2, False)
    assert (second["step_reached"], second["reach_is_lower_bound"]) == (14, False)


def _memory_ranks(rank: int, world: int, root: str, memory: str, kill_at: int) -> None:
    """2 ranks as 2 nodes, default progress: a memory snapshot every 3 steps, SIGKILLed a moment
    after step ``kill_at`` returned."""
    import os

    tier = ts.MemoryTier(root=f"{memory}/node-{rank}", node=rank, interval=ts.Every(steps=3))
    mgr = ts.CheckpointManager(
        root,
        interval=ts.Every(steps=1000),
        memory=tier,
        options=ts.ManagerOptions(timeout=60, preemption_signals=()),
    )
    w = torch.zeros(4, 8)
    state = {"w": ts.Sharded(w, global_shape=(8, 8), offsets=(4 * rank, 0))}
    info = mgr.restore(state)
    for step in range(1 if info is None else info.step + 1, kill_at + 1):
        w.fill_(float(step))
        mgr.step(step, state)
        mgr.wait()  # each memory snapshot committed before the next step
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_memory_tier_crash_reports_a_reach_never_before_the_restored_step(
    tmp_path: Path,
) -> None:
    """Why: a memory-tier restart said "the previous run reached step 40" when its restored
    snapshot was 42 and it reached 43 (memory saves are not in the restart log)."""
    from trainsnap.testing import run_ranks

    root, memory = tmp_path / "durable", tmp_path / "memory"
    for kill_at in (8, 13):
        results = run_ranks(_memory_ranks, 2, args=(str(root), str(memory), kill_at), timeout=120)
        assert all(r.killed and not r.timed_out for r in results), [r.describe() for r in results]
    first, second = _runs(root)
    assert [first["step_reached"], second["step_reached"]] == [8, 13]
    assert second["restored_step"] == 6 <= first["step_reached"]
    assert (second["lost_steps"], second["lost_is_lower_bound"]) == (8 - 6, True)


def test_a_step_whose_call_did_not_return_is_not_reached(tmp_path: Path) -> None:
    """Why: the step whose ``mgr.step`` blocked (or failed) was counted as reached: the progress
    record was written when the call began."""
    from trainsnap.manager import lease

    mgr = ts.CheckpointManager(
        tmp_path,
        interval=ts.Every(steps=2),
        async_save=False,
        options=ts.ManagerOptions(progress_seconds=0.0, preemption_signals=()),
    )
    mgr.step(1, {"w": torch.ones(2)})
    with pytest.raises(ts.TrainsnapError):
        mgr.step(2, {"w": object()})  # its save fails: step() never returns
    (record,) = lease.progress(ts.open_storage(tmp_path)).values()
    assert record["step"] == 1
    mgr.close()
