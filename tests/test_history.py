"""The restart history: real training processes killed at known steps and restarted, then
`trainsnap history` must show each restart's lost work and restore time as they happened."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

import trainsnap as ts
from trainsnap.manager import lease, restarts
from trainsnap.tools import render

_TRAIN = textwrap.dedent(
    """
    import logging, os, signal, sys
    import torch, trainsnap as ts

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    root, kill_at, term_at, total = sys.argv[1], *map(int, sys.argv[2:5])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ts.TrainState(model=model, optimizer=opt)
    mgr = ts.CheckpointManager(
        root, interval=ts.Every(steps=4), async_save=False,
        options=ts.ManagerOptions(progress_seconds=0.0),
    )
    info = mgr.restore(state)
    for step in range(0 if info is None else info.step + 1, total):
        model(torch.ones(4)).sum().backward()
        opt.step()
        opt.zero_grad()
        mgr.step(step, state)
        if mgr.preempted:
            break
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == term_at:
            os.kill(os.getpid(), signal.SIGTERM)
    mgr.close()
    """
)


def _train(root: Path, *, kill_at: int = -1, term_at: int = -1, total: int = 24) -> str:
    """Run the loop in a real process; its log (stderr)."""
    args = [str(root), str(kill_at), str(term_at), str(total)]
    cmd = [sys.executable, "-c", _TRAIN, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    expected = -signal.SIGKILL if kill_at >= 0 else 0
    assert out.returncode == expected, out.stderr[-3000:]
    return out.stderr


def _history_json(root: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "trainsnap.tools.cli", "history", str(root), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _load_seconds(log: str) -> float:
    (found,) = re.findall(
        r"loaded snapshot \S+ step=\d+ level=\S+ bytes_read=\d+ seconds=([\d.]+)", log
    )
    return float(found)


def test_two_crashes_show_their_lost_work_and_restore_times(tmp_path: Path) -> None:
    _train(tmp_path, kill_at=10)
    second_log = _train(tmp_path, kill_at=17)
    third_log = _train(tmp_path)
    saved = [s.step for s in ts.list_snapshots(tmp_path)]
    job = _history_json(tmp_path)
    runs = job["runs"]
    assert [r["end"] for r in runs] == ["crash", "crash", "close"]
    assert [r["step_reached"] for r in runs] == [10, 17, 23]
    for run, killed_at in zip(runs[1:], (10, 17), strict=True):
        restored = max(s for s in saved if s <= killed_at)  # the newest save before the kill
        assert run["restored_step"] == restored
        assert run["lost_steps"] == killed_at - restored
        assert run["lost_seconds"] is not None and run["lost_seconds"] >= 0
        assert run["to_first_step_seconds"] is not None
    for run, log in zip(runs[1:], (second_log, third_log), strict=True):
        load = _load_seconds(log)  # the load's own log line, inside the restore
        assert load <= run["restore_seconds"] < load + 2.0, (load, run["restore_seconds"])
        assert f"lost {run['lost_steps']} step(s)" in log  # the restart's log line
    assert job["crashes"] == 2 and job["mtbf_seconds"] is not None
    assert 0 < job["goodput"] <= 1
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainsnap.tools.cli",
            "history",
            str(tmp_path),
            "--plot",
            str(tmp_path / "history.png"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "goodput" in out.stdout, out.stderr[-2000:]
    assert (tmp_path / "history.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_preemption_restart_loses_no_step(tmp_path: Path) -> None:
    _train(tmp_path, term_at=10)  # SIGTERM after step 10: the manager saves step 11 and stops
    _train(tmp_path)
    first, second = _history_json(tmp_path)["runs"]
    assert first["end"] == "preempt" and first["step_reached"] == 11
    assert second["restored_step"] == 11 and second["lost_steps"] == 0
    assert second["lost_seconds"] == 0.0


def test_a_root_without_a_restart_log_prints_what_it_can(tmp_path: Path) -> None:
    ts.save({"w": torch.ones(3)}, tmp_path, step=5)
    cmd = [sys.executable, "-m", "trainsnap.tools.cli", "history", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "no restart log" in out.stdout and "newest step 5" in out.stdout
    assert restarts.history(lease.events(ts.open_storage(tmp_path)), {}).runs == []


def test_lost_work_is_the_step_reached_less_the_step_restored() -> None:
    """The arithmetic alone, on a hand-made log."""
    events = [
        {"time": 0.0, "generation": 1, "kind": "start"},
        {"time": 5.0, "generation": 1, "kind": "save", "snapshot": "a", "step": 40, "pause": 0.5},
        {"time": 20.0, "generation": 2, "kind": "start"},
        {
            "time": 23.0,
            "generation": 2,
            "kind": "restore",
            "snapshot": "a",
            "step": 40,
            "seconds": 1.5,
            "since_start": 3.0,
        },
        {"time": 24.0, "generation": 2, "kind": "first_step", "step": 41, "seconds": 1.0},
        {"time": 60.0, "generation": 2, "kind": "close"},
    ]
    job = restarts.history(events, {1: {"step": 47, "time": 12.0}})
    first, second = job.runs
    assert (first.end, first.step_reached, first.time_reached) == ("crash", 47, 12.0)
    assert (second.lost_steps, second.lost_seconds) == (7, 7.0)  # steps 41..47, 5 s -> 12 s
    assert job.down_seconds == 24.0 - 12.0 and job.lost_seconds == 7.0
    assert job.goodput == (60.0 - 12.0 - 7.0) / 60.0


# -- what the history says, on hand-made logs ------------------------------------------------------


def _crash_then_restart(progress_seconds: float | None) -> list[dict[str, Any]]:
    start: dict[str, Any] = {"time": 0.0, "generation": 1, "kind": "start"}
    if progress_seconds is not None:
        start["progress_seconds"] = progress_seconds
    return [
        start,
        {"time": 5.0, "generation": 1, "kind": "save", "snapshot": "a", "step": 40, "pause": 0.01},
        {"time": 20.0, "generation": 2, "kind": "start", "progress_seconds": 30.0},
        {"time": 23.0, "generation": 2, "kind": "restore", "snapshot": "a", "step": 40},
        {"time": 60.0, "generation": 2, "kind": "close", "step": 40},
    ]


def test_lost_work_is_a_lower_bound_unless_every_step_was_recorded() -> None:
    """Why: a crash's lost work was reported as exact ("lost 0 step(s)") though the last progress
    record may be older than the steps really lost."""
    progress = {1: {"step": 47, "time": 12.0}}
    sparse = restarts.history(_crash_then_restart(30.0), progress).runs[1]
    assert (sparse.lost_steps, sparse.lost_is_lower_bound) == (7, True)
    unknown = restarts.history(_crash_then_restart(None), progress).runs[1]
    assert unknown.lost_is_lower_bound  # an older log: nothing says the record was current
    exact = restarts.history(_crash_then_restart(0.0), progress).runs[1]
    assert (exact.lost_steps, exact.lost_is_lower_bound) == (7, False)
    job = restarts.history(_crash_then_restart(30.0), progress)
    cells = _table_rows(job)[1]
    assert ">=7" in cells
    assert any("at least" in line for line in render.history_totals(job))


def _table_rows(job: restarts.History, width: int = 80) -> list[list[str]]:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(render.history_table(job.runs))
    text = console.export_text()
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines), text
    return [line.split() for line in lines[3:] if line.strip()]


def test_history_fits_80_columns_with_seconds_to_useful_precision() -> None:
    """Why: `history` printed a 137-column table (then 96 at 80 columns) and "Young 0 s, Daly
    0 s" (rounded away)."""
    events = _crash_then_restart(30.0)
    events[3].update(seconds=0.0123, since_start=2.5, level="training")
    events[1]["snapshot"] = events[3]["snapshot"] = "step-000000000040-0123abcd"
    events[1]["pause"] = 0.001  # a fast save: the implied interval is under a second
    events.append({"time": 24.0, "generation": 2, "kind": "first_step", "seconds": 0.25})
    job = restarts.history(events, {1: {"step": 47, "time": 12.0}})
    rows = _table_rows(job)
    assert len(rows) == 2  # one line per run: nothing wrapped at 80 columns
    assert rows[1][:7] == ["2", *rows[1][1:3], "close", "40", "40", "training"]
    assert rows[1][-2:] == [">=7", "7"]  # lost, lost s
    assert rows[0][4] == ">=47"  # the crashed run's reach: a lower bound
    console = Console(width=80, record=True, file=io.StringIO())
    table = render.restarts_table(job.runs)
    assert table is not None
    console.print(table)
    restart_rows = [line.split() for line in console.export_text().splitlines()[3:]]
    assert restart_rows[0][-4:] == [">=7", "0.0123", "0.25", "11"]  # RTO: 12 s -> 23 s
    totals = "\n".join(render.history_totals(job))
    assert job.young_seconds is not None and job.young_seconds < 1
    assert f"Young {job.young_seconds:.3g} s" in totals and "Young 0 s" not in totals
    notes = (*render.HISTORY_NOTES, *render.RESTART_NOTES, *totals.splitlines())
    assert all(len(line) <= 80 for line in notes)


def test_an_exit_without_close_counts_alike_in_table_and_totals() -> None:
    """Why: the newest run without close() was a crash in the table but not in the totals."""
    events = [
        {"time": 0.0, "generation": 1, "kind": "start"},
        {"time": 50.0, "generation": 1, "kind": "save", "snapshot": "a", "step": 5},
        {"time": 100.0, "generation": 2, "kind": "start"},
        {"time": 150.0, "generation": 2, "kind": "save", "snapshot": "b", "step": 9},
    ]
    job = restarts.history(events, {})
    assert [r.end for r in job.runs] == ["crash", "running"]
    assert job.crashes == sum(r.end == "crash" for r in job.runs) == 1
    assert job.mtbf_seconds == (50.0 + 50.0) / 1


def test_a_writer_alive_after_the_takeover_is_superseded_not_crashed() -> None:
    """Why: a second job on a live root recorded and showed the first as a crash."""
    events = [
        {"time": 0.0, "generation": 1, "kind": "start"},
        {"time": 100.0, "generation": 2, "kind": "start"},
        {"time": 130.0, "generation": 1, "kind": "save", "snapshot": "a", "step": 9},
        {"time": 200.0, "generation": 2, "kind": "close"},
    ]
    job = restarts.history(events, {})
    assert [r.end for r in job.runs] == ["superseded", "close"]
    assert job.crashes == 0 and job.mtbf_seconds is None
    taken = [events[0], {"time": 100.0, "generation": 2, "kind": "takeover",
                         "previous_generation": 1}]  # fmt: skip
    assert restarts.history(taken, {}).runs[0].end == "superseded"


def test_a_second_job_on_a_live_root_records_a_takeover_not_a_crash(tmp_path: Path) -> None:
    first = ts.CheckpointManager(tmp_path, interval=ts.Every(steps=1), async_save=False)
    first.step(0, {"w": torch.ones(2)})
    second = ts.CheckpointManager(tmp_path, interval=ts.Every(steps=1), async_save=False)
    second.close()
    kinds = [e["kind"] for e in lease.events(ts.open_storage(tmp_path))]
    assert "crash_detected" not in kinds and "takeover" in kinds
    assert restarts.history(lease.events(ts.open_storage(tmp_path)), {}).runs[0].end != "crash"
    with contextlib.suppress(ts.TrainsnapError):
        first.close()  # superseded: it may not commit any more


# -- which tier each restart restored from, and its RTO ------------------------------------------


def _restore_event(when: float, generation: int, **fields: Any) -> dict[str, Any]:
    return {"time": when, "generation": generation, "kind": "restore", "step": 40} | fields


def test_each_restart_says_where_it_restored_from_and_its_rto() -> None:
    """The restore event's tier and sources name one of the four places; the RTO runs from the
    previous run's last record to the restore's end."""
    events: list[dict[str, Any]] = [{"time": 0.0, "generation": 1, "kind": "start"}]
    restores = [
        {"tier": "memory", "sources": {"memory (this node)": 900, "memory (partner node)": 0}},
        {"tier": "memory", "sources": {"memory (this node)": 400, "memory (partner node)": 500}},
        {"tier": "local"},
        {"tier": "durable"},
        {},  # an older log: no tier recorded
    ]
    for i, fields in enumerate(restores):
        generation, when = i + 2, 100.0 * (i + 1)
        events.append({"time": when, "generation": generation, "kind": "start"})
        events.append(_restore_event(when + 3.0, generation, seconds=1.25, **fields))
    progress = {g: {"step": 41, "time": 100.0 * g - 10.0} for g in range(1, 6)}
    job = restarts.history(events, progress)
    restarted = job.runs[1:]
    assert [r.restored_from for r in restarted] == [*restarts.FROM, None]
    assert [r.partner_bytes for r in restarted] == [0, 500, None, None, None]
    for run in restarted:
        assert run.lost_steps == 1 and run.restore_seconds == 1.25
        assert run.rto_seconds == 10.0 + 3.0  # last progress 10 s before the start, restore 3 s
    console = Console(width=80, record=True, file=io.StringIO())
    table = render.restarts_table(job.runs)
    assert table is not None
    console.print(table)
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines()), text
    rows = [line.split() for line in text.splitlines()[3:] if line.strip()]
    assert rows[1][:6] == ["3", "40", "memory", "(partner", "node)", "500"]
    assert rows[1][-4:] == [">=1", "1.25", "-", "13"]  # lost (at least), restore, to step, RTO
    assert [row[2] for row in rows] == ["memory", "memory", "local", "durable", "-"]
    assert render.restarts_table(job.runs[:1]) is None  # no restart, no table
    assert job.as_dict()["runs"][2]["restored_from"] == "memory (partner node)"


def _memory_ranks(rank: int, world: int, root: str, memory: str, kill_at: int) -> int | None:
    """2 ranks as 2 nodes: a memory snapshot every 3 steps (each waited for), SIGKILLed after
    step ``kill_at``; returns the step restored."""
    import os

    tier = ts.MemoryTier(root=f"{memory}/node-{rank}", node=rank, interval=ts.Every(steps=3))
    mgr = ts.CheckpointManager(
        root,
        interval=ts.Every(steps=1000),
        memory=tier,
        options=ts.ManagerOptions(progress_seconds=0.0, timeout=60, preemption_signals=()),
    )
    w = torch.zeros(4, 8)
    state = {"w": ts.Sharded(w, global_shape=(8, 8), offsets=(4 * rank, 0))}
    info = mgr.restore(state)
    start = 1 if info is None else info.step + 1
    for step in range(start, kill_at + 1):
        w.fill_(float(step))
        mgr.step(step, state)
        mgr.wait()  # each memory snapshot committed before the next step
    os.kill(os.getpid(), signal.SIGKILL)
    return None


def test_history_says_which_memory_restarts_took_shards_from_a_partner(tmp_path: Path) -> None:
    """Real ranks: a crash restored from the nodes' own memory, then a node wiped and
    restored from its partner's memory; `history --json` says which, the lost steps and the
    RTO of each."""
    from trainsnap.testing import run_ranks

    root, memory = tmp_path / "durable", tmp_path / "memory"
    for kill_at, wipe in ((7, None), (11, None), (14, 1)):
        if wipe is not None:
            shutil.rmtree(memory / f"node-{wipe}")  # the node's memory is lost with the node
        results = run_ranks(_memory_ranks, 2, args=(str(root), str(memory), kill_at), timeout=120)
        assert all(r.killed and not r.timed_out for r in results), [r.describe() for r in results]
    runs = _history_json(root)["runs"]
    assert [r["restored_step"] for r in runs] == [None, 6, 9]
    assert [r["restored_from"] for r in runs[1:]] == ["memory (this node)", "memory (partner node)"]
    assert runs[1]["partner_bytes"] == 0 and runs[2]["partner_bytes"] == 4 * 8 * 4
    assert [r["lost_steps"] for r in runs[1:]] == [7 - 6, 11 - 9]
    for run in runs[1:]:
        assert run["rto_seconds"] >= run["restore_seconds"] > 0
    cmd = [sys.executable, "-m", "trainsnap.tools.cli", "history", str(root)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "restarts (one per restore)" in out.stdout, out.stderr
    assert "memory (partner node)" in out.stdout
