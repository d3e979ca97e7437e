"""The files around the snapshots -- the restart log, progress records, lease entries -- are
advisory: a malformed, huge or odd one is skipped with a warning naming it, never read whole,
and never stops a CheckpointManager from starting or `trainsnap history` from answering."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import trainsnap as ts
from trainsnap.manager import lease, restarts
from trainsnap.storage.posix import PosixStorage

MALFORMED_EVENTS = {
    "00000000000000000001-000000000001-text.json": b"not json",
    "00000000000000000002-000000000001-list.json": b"[1, 2]",
    "00000000000000000003-000000000001-nan.json": b'{"time": NaN, "generation": 1, "kind": "x"}',
    "00000000000000000004-000000000001-gen.json": b'{"time": 1, "generation": "abc", "kind": "x"}',
    "00000000000000000005-000000000001-huge.json": json.dumps(
        {"time": 1.0, "generation": 10**400, "kind": "start"}
    ).encode(),
    "00000000000000000006-000000000001-far.json": b'{"time": 1e300, "generation": 1, "kind": "x"}',
    "00000000000000000007-000000000001-deep.json": b"[" * 30_000 + b"]" * 30_000,
}
ODD_EVENTS = [  # well formed, odd values: history must print them, not break on them
    {"time": 10.0, "generation": 1, "kind": "start", "progress_seconds": 1e400},
    {"time": 11.0, "generation": 1, "kind": "save", "snapshot": "[bold red]x[/]", "step": 2**70},
    {"time": 12.0, "generation": 1, "kind": "restore", "snapshot": "[/]", "level": {"a": 1},
     "step": 3, "seconds": 10**400},
]  # fmt: skip


def _hostile_root(root: Path) -> None:
    events = root / "events"
    events.mkdir(parents=True)
    for name, body in MALFORMED_EVENTS.items():
        (events / name).write_bytes(body)
    with open(events / "00000000000000000008-000000000001-sparse.json", "wb") as f:
        f.truncate(5 << 30)  # 5 GiB of nothing: a reader must not read it whole
    os.mkfifo(events / "00000000000000000009-000000000001-fifo.json")
    for i, event in enumerate(ODD_EVENTS):
        text = json.dumps(event).replace("Infinity", "1e400")
        (events / f"0000000000000000001{i}-000000000001-odd.json").write_text(text)
    progress = root / "progress"
    progress.mkdir()
    (progress / "gen-000000000007.json").write_bytes(b'{"step": "x", "time": 1}')
    (progress / "gen-abc.json").write_bytes(b'{"step": 1, "time": 1}')
    with open(progress / "gen-000000000002.json", "wb") as f:
        f.truncate(5 << 30)
    (root / "lease").mkdir()
    (root / "lease" / "gen-abc").write_bytes(b"{}")
    (root / "lease" / "gen--5").write_bytes(b"{}")


def test_malformed_advisory_files_are_skipped_with_a_warning_naming_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why: a malformed restart-log event made CheckpointManager refuse to start, and a sparse
    5 GiB events or progress file was read whole."""
    _hostile_root(tmp_path)
    asked: list[tuple[str, int, int | None]] = []
    real_get = PosixStorage.get

    def recording_get(self: PosixStorage, key: str, start: int = 0, end: int | None = None):
        asked.append((key, start, end))
        return real_get(self, key, start, end)

    monkeypatch.setattr(PosixStorage, "get", recording_get)
    lease._warned.clear()
    caplog.set_level(logging.WARNING, logger="trainsnap.manager.lease")
    started = time.monotonic()
    mgr = ts.CheckpointManager(tmp_path, interval=ts.Every(steps=1), async_save=False)
    assert mgr.step(0, {"w": torch.ones(2)})
    mgr.close()
    assert time.monotonic() - started < 60
    lease.progress(ts.open_storage(tmp_path))
    advisory = [
        (start, end)
        for key, start, end in asked
        # The fencing probe reads back the scratch key it has just created itself.
        if key.startswith(("events/", "lease/")) and not key.startswith("lease/probe-")
    ]
    assert advisory and all(end is not None and end - start <= 64 << 10 for start, end in advisory)
    warned = caplog.text
    sparse, fifo = (
        "00000000000000000008-000000000001-sparse.json",
        "00000000000000000009-000000000001-fifo.json",
    )
    for name in [*MALFORMED_EVENTS, sparse, fifo]:
        assert f"events/{name}" in warned, name
    for key in ("progress/gen-abc.json", "progress/gen-000000000007.json", "lease/gen-abc"):
        assert key in warned, key
    assert "progress/gen-000000000002.json" in warned and "5368709120 bytes" in warned
    evs = lease.events(ts.open_storage(tmp_path))
    assert {e["kind"] for e in evs} >= {"start", "save", "close"}
    assert all(isinstance(e["generation"], int) for e in evs)


def test_history_prints_what_it_can_and_its_json_is_strict(tmp_path: Path) -> None:
    """Why: `history` broke on odd records (markup in a snapshot name) and `--json` printed NaN."""
    _hostile_root(tmp_path)
    ts.save({"w": torch.ones(2)}, tmp_path, step=1)
    cli = [sys.executable, "-m", "trainsnap.tools.cli", "history", str(tmp_path)]
    table = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr[-2000:]
    assert "Traceback" not in table.stderr and "running" in table.stdout
    out = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]

    def no_constant(name: str) -> None:
        raise AssertionError(f"{name} in history --json")

    doc = json.loads(out.stdout, parse_constant=no_constant)
    (run,) = doc["runs"]
    assert run["restored_snapshot"] == "[/]" and run["level"] is None
    assert run["restore_seconds"] is None and run["progress_seconds"] is None


def test_restarts_ignore_values_out_of_range() -> None:
    job = restarts.history(ODD_EVENTS, {1: {"step": 5, "time": float("nan")}})
    assert job.runs[0].step_reached == 3 and job.runs[0].saves == []
    json.dumps(job.as_dict(), allow_nan=False)  # raises on a NaN or an infinity
