"""The ``trainsnap`` command on real snapshots: listing, inspection, verification, errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner, Result

import trainsnap
from trainsnap.api.verification import verify_root
from trainsnap.format.manifest import object_key
from trainsnap.format.regions import Box, Flat
from trainsnap.protocol import commit
from trainsnap.storage import open_storage
from trainsnap.tools.cli import app
from trainsnap.tools.render import geometry_text, human_size

STEPS = (10, 1, 5)
"""Saved out of order, so that listing order is the command's doing."""


def run(*args: str) -> Result:
    return CliRunner().invoke(app, list(args))


def state(step: int) -> dict[str, object]:
    """Small, and different at each step so that no two snapshots share an object."""
    return {
        "model": {
            "w": torch.arange(12, dtype=torch.float32).reshape(3, 4) + step,
            "b": torch.full((3,), step, dtype=torch.float16),
        },
        "epoch": step,
    }


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for step in STEPS:
        trainsnap.save(
            state(step),
            str(tmp_path),
            step=step,
            options=trainsnap.SaveOptions(tokens_seen=step * 100),
        )
    return tmp_path


def ids_by_step(root: Path) -> dict[int, str]:
    return {s.step: s.id for s in trainsnap.list_snapshots(str(root))}


def flip_byte(root: Path, snapshot_id: str) -> str:
    """Damage the first object of a snapshot; its name."""
    m = commit.open_snapshot(open_storage(str(root)), snapshot_id)
    name = m.object_names[0]
    path = root / object_key(name)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return name


# -- ls -------------------------------------------------------------------------------------------


def test_ls_lists_steps_in_order(root: Path) -> None:
    res = run("ls", str(root))
    assert res.exit_code == 0, res.output
    ids = ids_by_step(root)
    positions = [res.stdout.index(ids[step]) for step in sorted(STEPS)]
    assert positions == sorted(positions)
    assert "3 committed snapshot(s)" in res.stdout
    assert "uncommitted" not in res.stdout


def test_ls_hides_uncommitted_snapshot(root: Path) -> None:
    hidden = ids_by_step(root)[5]
    (root / "snapshots" / hidden / "COMMITTED").unlink()
    res = run("ls", str(root))
    assert res.exit_code == 0, res.output
    assert hidden not in res.stdout
    assert "2 committed snapshot(s)" in res.stdout
    assert "1 uncommitted snapshot(s) not listed" in res.stdout


@pytest.mark.parametrize("command", [["ls"], ["gc", "--dry-run"], ["history"], ["show"]])
def test_a_root_that_is_missing_a_file_or_a_snapshot_is_an_error(
    root: Path, command: list[str]
) -> None:
    """Why: `ls`, `gc --dry-run` and `history` on these printed "no committed snapshots", exit 0."""
    missing = root / "nothing-here"
    res = run(*command, str(missing))
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith(f"error: root {missing} does not exist")
    afile = root / "a-file"
    afile.write_text("not a root")
    res = run(*command, str(afile))
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith(f"error: root {afile} is a file")
    sid = ids_by_step(root)[5]
    res = run(*command, str(root / "snapshots" / sid))
    assert res.exit_code == 2, res.output
    assert f"is the snapshot directory of snapshot {sid}" in res.stderr
    assert f"its root is {root}" in res.stderr
    res = run(*command, str(root / "objects"))
    assert res.exit_code == 2 and f"the objects/ folder of the root {root}" in res.stderr


def test_ls_of_an_empty_directory_says_it_holds_nothing(tmp_path: Path) -> None:
    res = run("ls", str(tmp_path))
    assert res.exit_code == 0, res.output
    assert f"no committed snapshots in {tmp_path}" in res.stdout


def test_a_file_as_root_is_a_trainsnap_error_naming_it(tmp_path: Path) -> None:
    """Why: a file as root gave a raw NotADirectoryError from deep in a save."""
    afile = tmp_path / "weights.pt"
    afile.write_bytes(b"x")
    with pytest.raises(trainsnap.InvalidArgumentError, match="is a file") as e:
        trainsnap.save({"w": torch.ones(2)}, afile, step=1)
    assert e.value.path == str(afile)
    with pytest.raises(trainsnap.InvalidArgumentError, match="is a file"):
        trainsnap.list_snapshots(afile)


def test_ls_verify_marks_corrupt_snapshot_and_exits_1(root: Path) -> None:
    """Why: `ls --verify` marked a snapshot CORRUPT and exited 0."""
    ids = ids_by_step(root)
    flip_byte(root, ids[1])
    res = run("ls", str(root), "--verify")
    assert res.exit_code == 1, res.output
    rows = {
        line.split()[1]: line.split()[-1] for line in res.stdout.splitlines() if "step-" in line
    }
    assert rows == {ids[1]: "CORRUPT", ids[5]: "ok", ids[10]: "ok"}
    assert "damage in 1 snapshot(s)" in res.stderr
    assert run("ls", str(root)).exit_code == 0  # listing alone does not judge


# -- show -----------------------------------------------------------------------------------------


def test_show_prints_keys_shapes_dtypes(root: Path) -> None:
    sid = ids_by_step(root)[5]
    res = run("show", str(root), sid)
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert sid in out
    for expected in ("model.w", "(3, 4)", "float32", "model.b", "(3,)", "float16", "epoch"):
        assert expected in out
    assert "tokens seen   500" in out
    assert f"format        version {trainsnap.format.manifest.FORMAT_VERSION}" in out


def test_show_json_latest(root: Path) -> None:
    res = run("show", str(root), "latest", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["id"] == ids_by_step(root)[10]
    assert doc["step"] == 10 and doc["format_version"] == trainsnap.format.manifest.FORMAT_VERSION
    tensors = {t["key"]: t for t in doc["tensors"]}
    assert tensors["model.w"]["shape"] == [3, 4]
    assert tensors["model.w"]["dtype"] == "float32"
    assert tensors["model.w"]["nbytes"] == 48
    assert tensors["model.b"]["shards"] == [
        {"kind": "box", "offsets": [0], "sizes": [3], "nbytes": 6}
    ]
    assert [v["key"] for v in doc["values"]] == ["epoch"]
    assert doc["objects"]["nbytes"] == doc["nbytes"] > 0


@pytest.mark.parametrize("name", ["5", "step-5", "step-000000000005"])
def test_a_snapshot_is_named_by_its_step(root: Path, name: str) -> None:
    """Why: there was no way to name a snapshot by its step (`show ROOT 55`)."""
    sid = ids_by_step(root)[5]
    res = run("show", str(root), name, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["id"] == sid
    assert run("verify", str(root), name).stdout.startswith(f"{sid}: ok")


def test_a_step_not_saved_names_the_nearest_saved_steps(root: Path) -> None:
    res = run("show", str(root), "6")
    assert res.exit_code == 2
    assert "no committed snapshot of step 6" in res.stderr
    assert "nearest saved step(s): 1, 5, 10" in res.stderr


def test_a_mistyped_id_gets_did_you_mean(root: Path) -> None:
    """Why: a typo in an id got no suggestion."""
    sid = ids_by_step(root)[10]
    typo = sid[:-1] + ("0" if sid[-1] != "0" else "1")
    res = run("show", str(root), typo)
    assert res.exit_code == 2
    assert f"did you mean {sid}" in res.stderr


def test_interval_errors_name_the_options_as_typed() -> None:
    """Why: `interval --cost 0s` answered with the internal parameter name `cost_s`."""
    res = run("interval", "--cost", "0s", "--mtbf", "4h")
    assert res.exit_code == 2
    assert res.stderr.startswith("error: --cost '0s' is not a positive duration")
    assert "cost_s" not in res.output
    res = run("interval", "--cost", "30s", "--mtbf", "4x")
    assert res.exit_code == 2 and res.stderr.startswith("error: --mtbf: cannot read '4x'")
    res = run("gc", "/nonexistent-root", "--grace", "soon")
    assert res.exit_code == 2 and res.stderr.startswith("error: --grace:")


def test_show_unknown_id_is_an_error(root: Path) -> None:
    res = run("show", str(root), "step-000000000099-deadbeef")
    assert res.exit_code == 2
    assert res.stderr.startswith("error: snapshot step-000000000099-deadbeef does not exist")


# -- verify ---------------------------------------------------------------------------------------


def test_verify_clean_root(root: Path) -> None:
    res = run("verify", str(root))
    assert res.exit_code == 0, res.output
    for sid in ids_by_step(root).values():
        assert f"{sid}: ok" in res.stdout
    assert "verified 3 snapshot(s)" in res.stdout
    assert "all ok" in res.stdout


def test_verify_finds_flipped_byte(root: Path) -> None:
    ids = ids_by_step(root)
    name = flip_byte(root, ids[5])
    res = run("verify", str(root))
    assert res.exit_code == 1, res.output
    bad = [line for line in res.stdout.splitlines() if line.startswith("  - ")]
    assert bad, res.stdout
    assert all(ids[5] in line and name in line for line in bad)
    assert f"{ids[1]}: ok" in res.stdout
    assert f"{ids[10]}: ok" in res.stdout
    # the other snapshots, one at a time, are still fine
    assert run("verify", str(root), ids[10]).exit_code == 0


@pytest.mark.parametrize("sid", ["step-000000000099-deadbeef", "not-an-id"])
def test_verify_unknown_id_is_an_error(root: Path, sid: str) -> None:
    res = run("verify", str(root), sid)
    assert res.exit_code == 2
    assert res.stderr.startswith("error: ")
    assert sid in res.stderr
    assert res.stdout == ""


@pytest.mark.slow
def test_demo_crashes_resumes_on_another_topology_and_passes(tmp_path: Path) -> None:
    """Run as from a fresh clone, without --root: it works in a temporary directory, names it,
    and leaves nothing behind, neither where it ran nor in the temporary directory."""
    cwd, tmp, png = tmp_path / "clone", tmp_path / "tmp", tmp_path / "loss.png"
    cwd.mkdir()
    tmp.mkdir()
    cmd = [sys.executable, "-m", "trainsnap.tools.cli", "demo", "--steps", "24", "--plot", str(png)]
    env = dict(os.environ, TMPDIR=str(tmp))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "PASS: the run continued the same trajectory" in out.stdout
    lost = re.search(r"restart: lost (\d+) step\(s\).*RTO ([\d.]+) s", out.stdout, re.S)
    assert lost and int(lost.group(1)) > 0 and float(lost.group(2)) > 0, out.stdout[-3000:]
    assert "SIGKILLed while writing the save of step 16" in out.stdout
    assert "at level 'strict'" in out.stdout and "all blocks ok" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(cwd.iterdir()) == []
    (scratch,) = re.findall(r"^temporary directory: (\S+) \(snapshots and", out.stdout, re.M)
    assert Path(scratch).parent == tmp and Path(scratch).name.startswith("trainsnap-demo-")
    assert f"removed {scratch}" in out.stdout
    assert not Path(scratch).exists()


def test_demo_keeps_the_reference_root_beside_a_given_root() -> None:
    from trainsnap.tools.demo import _reference_root

    assert _reference_root("/data/run") == "/data/run-reference"
    assert _reference_root("s3://bucket/demo/") == "s3://bucket/demo-reference"
    assert _reference_root("file:///data/run") == "file:///data/run-reference"
    with pytest.raises(SystemExit, match="names a whole bucket"):
        _reference_root("s3://bucket")


@pytest.mark.parametrize(
    ("ok", "keep", "kept"), [(True, False, False), (True, True, True), (False, False, True)]
)
def test_demo_removes_its_temporary_directory_unless_kept_or_failed(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    ok: bool,
    keep: bool,
    kept: bool,
) -> None:
    from trainsnap.tools import demo

    monkeypatch.setattr(demo.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(demo, "_demo", lambda *args: ok)  # the three runs are the slow test's
    assert demo.run_demo(None, 24, None, keep=keep) == (0 if ok else 1)
    left, out = list(tmp_path.iterdir()), capsys.readouterr().out
    if not kept:
        assert left == [] and "removed " in out
        return
    (scratch,) = left
    assert (scratch / "run" / demo.MARKER).exists() and (scratch / "run-reference").exists()
    assert ("kept " if ok else "the demo failed; kept for inspection: ") + str(scratch) in out


def test_demo_judge_fails_a_run_that_did_not_continue() -> None:
    from trainsnap.tools.demo import Phase, _judge

    def rows(losses: dict[int, float], ids: dict[int, list[int]]) -> list[dict]:
        return [{"event": "step", "step": s, "loss": v, "ids": ids[s]} for s, v in losses.items()]

    ref = Phase("reference", 2, 2, "r")
    ref.rows = rows({s: 5.0 - s / 10 for s in range(8)}, {s: [s] for s in range(8)})
    crash = Phase("crashed", 2, 2, "c", crash_at=6)
    crash.rows = rows({s: 5.0 - s / 10 for s in range(6)}, {s: [s] for s in range(6)})
    good = Phase("resumed", 2, 1, "c")
    good.rows = [
        {"event": "restore", "step": 3, "level": "strict"},
        *rows({s: 5.0 - s / 10 for s in range(4, 8)}, {s: [s] for s in range(4, 8)}),
    ]
    assert _judge(ref, crash, good).ok
    skipped = Phase("resumed", 2, 1, "c")
    skipped.rows = [
        good.rows[0],
        *rows({s: 5.0 - s / 10 for s in range(4, 8)}, {s: [s + 1] for s in range(4, 8)}),
    ]
    assert not _judge(ref, crash, skipped).ok
    drifted = Phase("resumed", 2, 1, "c")
    drifted.rows = [
        good.rows[0],
        *rows({s: 5.1 - s / 10 for s in range(4, 8)}, {s: [s] for s in range(4, 8)}),
    ]
    verdict = _judge(ref, crash, drifted)
    assert not verdict.ok and verdict.max_rel > 1e-3


def test_module_entry_point_reports_errors_without_traceback(root: Path) -> None:
    sid = "step-000000000099-deadbeef"
    cmd = [sys.executable, "-m", "trainsnap.tools.cli", "verify", str(root), sid]
    bad = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert bad.returncode == 2
    assert bad.stderr.startswith(f"error: snapshot {sid} does not exist")
    assert "Traceback" not in bad.stderr


# -- helpers --------------------------------------------------------------------------------------


def test_verify_progress_counts_each_shared_object_once(tmp_path: Path) -> None:
    """Progress reports every object's size once, across snapshots that share objects."""
    state = {"w": torch.randn(256, 256), "b": torch.randn(8)}
    trainsnap.save(state, tmp_path, step=1)
    state["b"] += 1  # the second snapshot shares the weight object
    trainsnap.save(state, tmp_path, step=2)
    calls: list[int] = []
    report = verify_root(tmp_path, None, calls.append)
    objects = [p for p in (tmp_path / "objects").rglob("*") if p.is_file()]
    assert sorted(calls) == sorted(p.stat().st_size for p in objects)
    assert report.bytes_verified == sum(calls)


def test_geometry_and_units() -> None:
    assert geometry_text(Flat(10, 5)) == "flat start 10 len 5"
    assert geometry_text(Box((0, 2), (3, 4))) == "box at (0, 2) size (3, 4)"
    assert [human_size(n) for n in (0, 1023, 1536, 5 << 30)] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "5.0 GiB",
    ]
