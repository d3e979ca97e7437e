"""A process SIGKILLed at each fault point of the save path leaves nothing listed from that
save, the previous snapshot loadable, and a clean verification."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import trainsnap as ts

SAVE_POINTS = ["before_write", "mid_write", "after_write", "before_manifest", "before_marker"]

_CHILD = textwrap.dedent(
    """
    import sys, torch, trainsnap as ts
    root, step = sys.argv[1], int(sys.argv[2])
    g = torch.Generator().manual_seed(step)
    state = {"w": torch.randn(256, 1024, generator=g), "b": torch.randn(64, generator=g),
             "step": step}
    ts.save(state, root, step=step)
    print("committed", flush=True)
    """
)


def _save_in_child(root: str, step: int, faults: str | None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("TRAINSNAP_FAULTS", None)
    if faults:
        env["TRAINSNAP_FAULTS"] = faults
    # Small chunks: the 1 MiB tensor becomes several objects, so a crash can fall between them.
    env["TRAINSNAP_CHUNK_SIZE"] = str(256 << 10)
    env["TRAINSNAP_BLOCK_SIZE"] = str(64 << 10)
    return subprocess.run(
        [sys.executable, "-c", _CHILD, root, str(step)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _expected(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 1024, generator=g), "b": torch.randn(64, generator=g)}


# Object-level points are also hit on a later object (#3); the commit points happen once a save.
CASES = [(p, 1) for p in SAVE_POINTS] + [
    (p, 3) for p in ("before_write", "mid_write", "after_write")
]


@pytest.mark.parametrize(("point", "hit"), CASES)
def test_sigkill_at_each_save_fault_point(tmp_path, point, hit):
    root = str(tmp_path)
    first = _save_in_child(root, 10, None)
    assert first.returncode == 0, first.stderr
    crashed = _save_in_child(root, 20, f"{point}=crash#{hit}")
    assert crashed.returncode == -signal.SIGKILL, (crashed.returncode, crashed.stderr)
    assert "committed" not in crashed.stdout

    listed = ts.list_snapshots(root)
    assert [s.step for s in listed] == [10]
    dst = {"w": torch.zeros(256, 1024), "b": torch.zeros(64), "step": None}
    info = ts.load(dst, root)
    assert info.step == 10 and dst["step"] == 10
    want = _expected(10)
    assert torch.equal(dst["w"], want["w"]) and torch.equal(dst["b"], want["b"])
    report = ts.verify(root)
    assert report.ok and [s.step for s in report.snapshots] == [10]
    # The interrupted save left an uncommitted snapshot only if it got as far as its manifest.
    assert len(report.uncommitted) == (1 if point == "before_marker" else 0)
    # No temporary file is ever visible under an object's name.
    for p in (tmp_path / "objects").rglob("*"):
        if p.is_file() and not p.name.startswith("."):
            assert len(p.name) == 32


def test_a_save_after_a_crash_commits_and_reuses_what_survived(tmp_path):
    root = str(tmp_path)
    assert _save_in_child(root, 10, None).returncode == 0
    assert _save_in_child(root, 20, "before_marker=crash").returncode == -signal.SIGKILL
    again = _save_in_child(root, 20, None)
    assert again.returncode == 0, again.stderr
    listed = ts.list_snapshots(root)
    assert [s.step for s in listed] == [10, 20]
    dst = {"w": torch.zeros(256, 1024), "b": torch.zeros(64)}
    ts.load(dst, root)
    assert torch.equal(dst["w"], _expected(20)["w"])
    assert ts.verify(root).ok


_COLLECT = textwrap.dedent(
    """
    import sys, trainsnap as ts
    from trainsnap.manager import collection
    from trainsnap.protocol import commit
    storage = ts.open_storage(sys.argv[1])
    old = ts.list_snapshots(storage)[0]
    commit.delete_snapshot(storage, old.id)
    collection.collect(storage, grace=None)
    """
)


@pytest.mark.parametrize("point", ["delete_uncommitted", "gc_delete"])
def test_sigkill_during_deletion_and_collection_breaks_nothing(tmp_path, point):
    root = str(tmp_path)
    for step in (10, 20):
        assert _save_in_child(root, step, None).returncode == 0
    env = dict(os.environ, TRAINSNAP_FAULTS=f"{point}=crash")
    out = subprocess.run([sys.executable, "-c", _COLLECT, root], env=env, timeout=120)
    assert out.returncode == -signal.SIGKILL
    # The half-deleted snapshot is simply uncommitted; the other one is intact.
    assert [s.step for s in ts.list_snapshots(root)] == [20]
    dst = {"w": torch.zeros(256, 1024), "b": torch.zeros(64)}
    ts.load(dst, root)
    assert torch.equal(dst["w"], _expected(20)["w"])
    # Collecting again finishes the job.
    from trainsnap.manager import collection

    collection.collect(ts.open_storage(root), grace=None)
    report = ts.verify(root)
    assert report.ok and report.uncommitted == []
