"""``trainsnap demo``: train, crash in the middle of a save, resume on another topology, and
prove the run continued the same trajectory.

1. A reference run: 4 gloo processes, (data, tensor) parallel = (2, 2), uninterrupted.
2. The same run, saving asynchronously through the CheckpointManager; during one save, rank 1 is
   SIGKILLed in the middle of writing an object. The job dies; the save in flight never commits.
3. A restart on 2 processes, (2, 1): the manager restores the newest committed snapshot --
   resharding the tensor-parallel weights and optimizer state -- at level ``strict``, and
   training continues.
4. The report: snapshots with sizes and pauses, verification, the level reached, and the loss
   curve of the interrupted run over the uninterrupted one. The demo fails (exit status 1) if the
   resumed run does not see the same global samples in the same order or its losses leave the
   reference's by more than floating-point noise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from trainsnap.api.snapshots import list_snapshots
from trainsnap.api.verification import verify_root
from trainsnap.manager import lease, restarts
from trainsnap.protocol import commit
from trainsnap.storage import Storage, open_storage
from trainsnap.tools.plot import Mark, png_chart, text_chart

TOLERANCE = 1e-3
"""Largest relative loss difference accepted after the resume. Changing the number of ranks
changes the order in which floating-point sums are taken (the batch mean, the gradient
all-reduce, the row-parallel reductions): ~1e-6 relative per step, compounding slowly."""

MARKER = ".trainsnap-demo"


@dataclass(slots=True)
class Phase:
    name: str
    dp: int
    tp: int
    root: str
    crash_at: int = -1
    log: Path = field(default_factory=Path)
    rows: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    killed: list[int] = field(default_factory=list)


def _reference_root(root: str) -> str:
    """The uninterrupted run's root: beside the demo's own (``DIR-reference``, or a sibling
    prefix ``s3://bucket/prefix-reference`` on an object store)."""
    base = root.rstrip("/")
    scheme, _, rest = base.partition("://")
    if rest and "/" not in rest and scheme != "file":
        raise SystemExit(
            f"--root {root} names a whole bucket; give it a prefix ({base}/demo): the "
            "reference run is kept beside it, under the prefix with -reference appended"
        )
    return base + "-reference"


def _local_path(root: str) -> Path | None:
    if root.startswith("file://"):
        return Path(urlparse(root).path)
    return None if "://" in root else Path(root)


def _prepare_local_roots(*roots: str) -> None:
    """A demo directory is ours to wipe; anything else that is not empty is refused."""
    for root in roots:
        d = _local_path(root)
        if d is None:
            continue
        if d.exists() and any(d.iterdir()) and not (d / MARKER).exists():
            raise SystemExit(f"{d} exists and is not a trainsnap demo directory; choose --root")
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        (d / MARKER).write_text("made by trainsnap demo\n")


def _launch(phase: Phase, steps: int, save_every: int, work: Path) -> list[subprocess.Popen[bytes]]:
    world = phase.dp * phase.tp
    rendezvous = (work / f"rdzv-{phase.name}").as_uri()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            TRAINSNAP_RANK=str(rank),
            TRAINSNAP_HEARTBEAT_SECONDS="10",
            OMP_NUM_THREADS="1",
        )
        cmd = [
            sys.executable,
            "-m",
            "trainsnap.tools.demo_worker",
            "--root",
            phase.root,
            "--steps",
            str(steps),
            "--dp",
            str(phase.dp),
            "--tp",
            str(phase.tp),
            "--save-every",
            str(save_every),
            "--crash-at",
            str(phase.crash_at),
            "--log",
            str(phase.log),
            "--rendezvous",
            rendezvous,
        ]
        out = (work / f"{phase.name}-rank{rank}.out").open("wb")
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
    return procs


def _read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a crash
    return rows


def _run(phase: Phase, steps: int, save_every: int, work: Path, progress: Progress) -> None:
    phase.log = work / f"{phase.name}.jsonl"
    label = f"{phase.name:<9} dp={phase.dp} tp={phase.tp}"
    task = progress.add_task(label, total=steps)
    t0 = time.monotonic()
    procs = _launch(phase, steps, save_every, work)
    first_death: float | None = None
    died_first: list[int] = []
    while any(p.poll() is None for p in procs):
        time.sleep(0.2)
        rows = [r for r in _read_log(phase.log) if r.get("event") == "step"]
        progress.update(task, completed=(rows[-1]["step"] + 1) if rows else 0)
        if first_death is None and any(p.poll() == -signal.SIGKILL for p in procs):
            first_death = time.monotonic()
            died_first = [r for r, p in enumerate(procs) if p.poll() == -signal.SIGKILL]
        if first_death is not None and time.monotonic() - first_death > 5:
            for p in procs:  # the job is dead: the scheduler would kill what is left
                if p.poll() is None:
                    p.kill()
    for p in procs:
        p.wait()
    phase.killed = died_first
    phase.rows = _read_log(phase.log)
    phase.seconds = time.monotonic() - t0
    failed = [r for r, p in enumerate(procs) if p.returncode not in (0, -signal.SIGKILL)]
    if phase.crash_at >= 0 and not phase.killed:
        raise SystemExit(
            f"the {phase.name} run was meant to crash at step {phase.crash_at} but did not"
        )
    if phase.crash_at < 0 and (failed or phase.killed):
        out = (work / f"{phase.name}-rank{(failed or phase.killed)[0]}.out").read_text()[-3000:]
        raise SystemExit(f"the {phase.name} run failed:\n{out}")
    progress.update(task, completed=steps if phase.crash_at < 0 else progress.tasks[task].completed)


def _steps(phase: Phase) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in phase.rows if r.get("event") == "step"}


@dataclass(slots=True)
class Verdict:
    restored_step: int
    level: str
    ids_equal: bool
    before_equal: bool
    max_rel: float
    ok: bool


def _judge(ref: Phase, crash: Phase, resume: Phase) -> Verdict:
    want, before, after = _steps(ref), _steps(crash), _steps(resume)
    restore = next((r for r in resume.rows if r.get("event") == "restore"), None)
    if restore is None:
        return Verdict(-1, "none", False, False, float("inf"), False)
    restored = int(restore["step"])
    before_equal = all(before[s]["loss"] == want[s]["loss"] for s in before if s <= restored)
    ids_equal = all(after[s]["ids"] == want[s]["ids"] for s in after)
    rel = max(
        (abs(after[s]["loss"] - want[s]["loss"]) / abs(want[s]["loss"]) for s in after),
        default=float("inf"),
    )
    ok = ids_equal and before_equal and rel <= TOLERANCE and bool(after)
    return Verdict(restored, str(restore["level"]), ids_equal, before_equal, rel, ok)


def _restart_line(storage: Storage) -> str:
    """What the restart cost, from the root's restart log (as `trainsnap history` shows it)."""
    runs = restarts.history(lease.events(storage), lease.progress(storage)).runs
    run = runs[-1] if runs else None
    if run is None or run.lost_steps is None:
        return "restart: the restart log has no restore of the resumed run"
    return (
        f"restart: lost {run.lost_steps} step(s) ({run.lost_seconds or 0.0:.1f} s of training); "
        f"RTO {run.since_start_seconds or 0.0:.1f} s from process start to restored (restore "
        f"itself {run.restore_seconds or 0.0:.2f} s), first step "
        f"{run.to_first_step_seconds or 0.0:.1f} s later (`trainsnap history` shows it all)"
    )


def _report(
    console: Console, ref: Phase, crash: Phase, resume: Phase, verdict: Verdict, plot: str | None
) -> None:
    storage = open_storage(resume.root)
    pauses = {
        r["step"]: r["pause"]
        for p in (crash, resume)
        for r in p.rows
        if r.get("event") == "step" and r.get("saved")
    }
    table = Table(title="snapshots (KeepLast(3))", title_justify="left")
    for col in ("step", "id", "size", "pause (ms)", "level"):
        table.add_column(col, justify="right" if col != "id" else "left")
    for s in list_snapshots(storage):
        pause = pauses.get(s.step)
        table.add_row(
            str(s.step),
            s.id,
            f"{s.nbytes / 2**20:.2f} MiB",
            "-" if pause is None else f"{pause * 1000:.1f}",
            s.level,
        )
    console.print(table)
    report = verify_root(storage)
    uncommitted = len(commit.snapshot_ids(storage)) - len(report.snapshots)
    console.print(
        f"verify: {len(report.snapshots)} snapshot(s), "
        + ("all blocks ok" if report.ok else f"{len(report.problems)} PROBLEM(S)")
        + f"; {uncommitted} uncommitted leftover(s) of the crashed save (never listed)"
    )
    crashed_at = max(_steps(crash), default=-1)
    garbage = len({k.rsplit("/", 1)[-1] for k in storage.list("objects/")} - _referenced(storage))
    console.print(
        f"crash: rank {', '.join(map(str, crash.killed))} SIGKILLed while writing the save of step "
        f"{crash.crash_at} (the job had reached step {crashed_at}; the others were killed 5 s "
        f"later); that save never committed ({garbage} unreferenced object(s) left for the "
        f"collector). Resumed from step {verdict.restored_step} on dp=2, tp=1 at level "
        f"{verdict.level!r}."
    )
    console.print(_restart_line(storage), soft_wrap=True)
    console.print(
        f"wall time: reference {ref.seconds:.0f} s, crashed {crash.seconds:.0f} s, "
        f"resumed {resume.seconds:.0f} s"
    )
    _charts(console, ref, crash, resume, verdict.restored_step, plot)
    console.print(
        f"trajectory: samples after the resume {'identical' if verdict.ids_equal else 'DIFFER'}; "
        f"losses before the crash {'bitwise equal' if verdict.before_equal else 'DIFFER'}; "
        f"largest relative loss difference after the resume {verdict.max_rel:.2e} "
        f"(tolerance {TOLERANCE:g})"
    )
    console.print(
        ("[green]PASS[/green]" if verdict.ok else "[red]FAIL[/red]")
        + ": "
        + (
            "the run continued the same trajectory"
            if verdict.ok
            else "the run did NOT continue the same trajectory"
        )
    )


def _charts(
    console: Console, ref: Phase, crash: Phase, resume: Phase, resumed_from: int, plot: str | None
) -> None:
    """The loss curves in the terminal, and in the PNG file ``plot`` if given."""
    ref_pts = [(s, r["loss"]) for s, r in sorted(_steps(ref).items())]
    run_pts = [(s, r["loss"]) for s, r in sorted({**_steps(crash), **_steps(resume)}.items())]
    series = [("uninterrupted (2x2)", ref_pts, "."), ("crashed + resumed", run_pts, "*")]
    console.print(text_chart(series, marks=(crash.crash_at, resumed_from)))
    if not plot:
        return
    png = png_chart(
        [
            (f"uninterrupted reference run (dp={ref.dp} tp={ref.tp})", ref_pts, "blue"),
            ("crashed + resumed run", run_pts, "orange"),
        ],
        plot,
        title="trainsnap demo: loss per step, crashed + resumed vs. uninterrupted",
        x_label="step",
        y_label="loss",
        marks=[
            Mark(crash.crash_at, f"crash at step {crash.crash_at}", "red"),
            Mark(
                resumed_from,
                f"resume from step {resumed_from} on dp={resume.dp} tp={resume.tp}",
                "green",
            ),
        ],
    )
    console.print(f"plot: {png}")


def _referenced(storage: Any) -> set[str]:
    out: set[str] = set()
    for c in commit.list_committed(storage):
        out.update(commit.open_snapshot(storage, c.snapshot_id).object_names)
    return out


def _schedule(steps: int) -> tuple[int, int]:
    """How often the demo saves, and the step whose save it crashes in."""
    save_every = max(2, steps // 6)
    crash_at = save_every * max(2, (steps // save_every) * 2 // 3)
    if crash_at >= steps:
        raise SystemExit(f"--steps {steps} is too short for a crash and a resume; use >= 12")
    return save_every, crash_at


def run_demo(root: str | None, steps: int, plot: str | None, *, keep: bool = False) -> int:
    """The whole demo; returns the exit status.

    Its worker logs -- and its snapshots too, unless ``root`` is given -- go to a fresh
    temporary directory, removed at the end unless ``keep`` or the demo failed (then it is
    kept, and named, for inspection).
    """
    console = Console()
    _schedule(steps)  # refuse bad arguments before making anything
    if root is not None:
        _prepare_local_roots(root, _reference_root(root))
    scratch = Path(tempfile.mkdtemp(prefix="trainsnap-demo-"))
    run_root = root or str(scratch / "run")
    if root is None:
        _prepare_local_roots(run_root, _reference_root(run_root))
    console.print(
        f"temporary directory: {scratch} ("
        + ("snapshots and " if root is None else "")
        + "worker logs; removed at the end unless --keep or the demo fails)",
        soft_wrap=True,
    )
    ok = False
    try:
        ok = _demo(console, run_root, steps, plot, scratch / "logs")
    finally:
        if ok and not keep:
            shutil.rmtree(scratch, ignore_errors=True)
            console.print(f"removed {scratch}", soft_wrap=True)
        else:
            why = "kept" if ok else "the demo failed; kept for inspection:"
            console.print(f"{why} {scratch} (worker logs in {scratch / 'logs'})", soft_wrap=True)
    return 0 if ok else 1


def _demo(console: Console, root: str, steps: int, plot: str | None, work: Path) -> bool:
    """Run the three phases and report; whether the run continued the same trajectory."""
    save_every, crash_at = _schedule(steps)
    work.mkdir()
    ref = Phase("reference", 2, 2, _reference_root(root))
    crash = Phase("crashed", 2, 2, root, crash_at=crash_at)
    resume = Phase("resumed", 2, 1, root)
    console.print(
        f"trainsnap demo: {steps} steps of a small transformer, saves every {save_every} steps "
        f"to {root}; rank 1 will be SIGKILLed during the save of step {crash_at}."
    )
    t0 = time.monotonic()
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        for phase in (ref, crash, resume):
            _run(phase, steps, save_every, work, progress)
    verdict = _judge(ref, crash, resume)
    _report(console, ref, crash, resume, verdict, plot)
    console.print(f"demo took {time.monotonic() - t0:.0f} s")
    return verdict.ok
