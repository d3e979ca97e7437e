"""Crash consistency through power cuts (:mod:`trainsnap.testing.powercut`).

Each write path runs once on the power-cut file system; then, at every cut point of its trace,
what the cut leaves must hold: every listed snapshot loads with the values saved at its step and
verifies (``ts.verify`` and ``trainsnap verify``), every save that had returned before the cut
is listed, and a manager starts on the root and restores the newest. Without a torn cut the
durable state changes only at an fsync, so the default form takes the last point before each
fsync (every distinct durable state, with the most saves returned) plus torn cuts at a sample
of points; ``TRAINSNAP_POWERCUT_FULL=1`` takes every event, torn at each of them too.
"""

from __future__ import annotations

import errno
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import trainsnap as ts
from trainsnap import tunables
from trainsnap.errors import TrainsnapError
from trainsnap.manager import lease, restarts
from trainsnap.manager.promotion import promote
from trainsnap.storage.posix import PosixStorage
from trainsnap.testing.powercut import PowerCutFS, cut_states, unavailable
from trainsnap.testing.powercut_fs import Event, Model
from trainsnap.tools.cli import app

pytestmark = [
    pytest.mark.powercut,
    pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
]
FULL = os.environ.get("TRAINSNAP_POWERCUT_FULL", "") not in ("", "0")
TORN_SAMPLE = 8
"""Torn cuts per path in the default form (at points drawn from its trace)."""


MANY = 0
"""Further small tensors in each state (the violation test sets it: one object each)."""


def values(step: int) -> dict[str, torch.Tensor]:
    """The state saved at ``step``: distinct bytes each step, so each save writes new objects
    and retention leaves the old ones for collection."""
    g = torch.Generator().manual_seed(step)
    out = {"w": torch.randn(64, 16, generator=g), "b": torch.full((16,), float(step))}
    out.update({f"t{i}": torch.randn(8, generator=g) for i in range(MANY)})
    return out


def template() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in values(0).items()}


@dataclass
class Run:
    """One recorded run: the trace and, for each save that returned, (events by then, id)."""

    initial: Model
    events: list[Event]
    returned: list[tuple[int, str]] = field(default_factory=list)
    roots: tuple[str, ...] = ("root",)
    """Roots (relative to the mount) that hold snapshots to check."""
    extra: Callable[[Path, int], None] | None = None
    """A further check of the state a cut leaves (given it and the cut point)."""


@dataclass
class Tally:
    cuts: int = 0
    seconds: float = 0.0
    paths: list[str] = field(default_factory=list)


TALLY = Tally()


def check_root(root: Path, returned: list[str], n: int, path: str) -> None:
    where = f"{path}: after a cut at event {n}"
    listed = {s.id: s for s in ts.list_snapshots(root)} if root.is_dir() else {}
    missing = [sid for sid in returned if sid not in listed]
    assert not missing, f"{where}, the save(s) {missing} had returned but are gone"
    for sid, info in listed.items():
        state = template()
        ts.load(state, root, snapshot=sid, level="weights")
        want = values(info.step)
        for k in want:
            assert torch.equal(state[k], want[k]), f"{where}, {sid} loads {k} wrong"
    storage = PosixStorage(root)
    # the restart log and the progress records read back (a cut may keep any prefix of them)
    restarts.history(lease.events(storage), lease.progress(storage))
    if not listed:
        return
    ts.verify(root)
    result = CliRunner().invoke(app, ["verify", str(root)])
    assert result.exit_code == 0, f"{where}, `trainsnap verify` says {result.output}"
    state = template()
    with ts.CheckpointManager(root, async_save=False) as mgr:
        restored = mgr.restore(state, level="weights")
    newest = max(listed.values(), key=lambda s: s.step)
    assert restored is not None and restored.step == newest.step, f"{where}: restored {restored}"


def points(events: list[Event]) -> list[int]:
    """Every event (long form); else the last point before each fsync and the end."""
    if FULL:
        return list(range(len(events) + 1))
    return [n for n in range(len(events)) if events[n][0] == "fsync"] + [len(events)]


def sweep(run: Run, where: Path, path: str) -> int:
    """Check every cut point of ``run``; the number checked."""
    start, checked = time.perf_counter(), 0
    cuts = points(run.events)
    rng = random.Random(path)
    torn_at = cuts if FULL else sorted(rng.sample(range(len(run.events) + 1), TORN_SAMPLE))
    passes: list[tuple[int | None, list[int]]] = [(None, cuts)]
    passes += [(seed, [n]) for seed, n in enumerate(torn_at)]
    for torn, at in passes:
        for n, state in cut_states(run.initial, run.events, where, at, torn=torn):
            ids = [sid for count, sid in run.returned if count <= n]
            for root in run.roots:
                check_root(state / root, ids if root == run.roots[0] else [], n, path)
            if run.extra is not None:
                run.extra(state, n)
            checked += 1
    TALLY.cuts += checked
    TALLY.seconds += time.perf_counter() - start
    TALLY.paths.append(path)
    return checked


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[PowerCutFS]:
    with PowerCutFS(tmp_path / "fs") as mounted:
        yield mounted


def recorded(fs: PowerCutFS, returned: list[tuple[int, str]], **kw: object) -> Run:
    initial, events = fs.trace()
    return Run(initial, events, returned, **kw)  # type: ignore[arg-type]


# -- the write paths ------------------------------------------------------------------------


def test_save(fs: PowerCutFS, tmp_path: Path) -> None:
    root, returned = fs.mount / "root", []
    for step in (1, 2, 3):
        info = ts.save(values(step), root, step=step, no_dist=True)
        returned.append((fs.ops(), info.id))
    assert sweep(recorded(fs, returned), tmp_path / "cut", "ts.save") > 10


def test_async_save(fs: PowerCutFS, tmp_path: Path) -> None:
    root, returned = fs.mount / "root", []
    for step in (1, 2):
        handle = ts.async_save(values(step), root, step=step, no_dist=True)
        info = handle.wait()
        returned.append((fs.ops(), info.id))
    assert sweep(recorded(fs, returned), tmp_path / "cut", "ts.async_save") > 5


def _manager_run(fs: PowerCutFS, **kw: object) -> list[tuple[int, str]]:
    returned = []
    with ts.CheckpointManager(
        fs.mount / "root",
        interval=ts.Every(steps=1),
        retention=ts.KeepLast(1),
        async_save=False,
        **kw,  # type: ignore[arg-type]
    ) as mgr:
        for step in (1, 2, 3):
            mgr.step(step, values(step))
            mgr.wait()  # committed, retention applied and the root collected
            newest = ts.list_snapshots(fs.mount / "root")[-1]
            returned.append((fs.ops(), newest.id))
    return returned


def test_manager_with_retention_and_collection(fs: PowerCutFS, tmp_path: Path) -> None:
    """Also the lease and the restart log: the manager writes both, and each cut's manager
    must start on what is left of them."""
    returned = _manager_run(fs)
    assert sweep(recorded(fs, returned[-1:]), tmp_path / "cut", "manager") > 10


def test_local_tier_and_promotion_by_the_manager(fs: PowerCutFS, tmp_path: Path) -> None:
    local = ts.LocalTier(root=str(fs.mount / "local"), retention=ts.KeepLast(1))
    returned = _manager_run(fs, local=local)
    run = recorded(fs, returned[-1:], roots=("root", "local"))
    assert sweep(run, tmp_path / "cut", "local tier + promotion") > 10


def test_promote(fs: PowerCutFS, tmp_path: Path) -> None:
    src, dst = fs.mount / "fast", fs.mount / "root"
    returned = []
    for step in (1, 2):
        info = ts.save(values(step), src, step=step, no_dist=True)
        promote(PosixStorage(src), PosixStorage(dst), info.id, writer={"promoted_from": "fast"})
        returned.append((fs.ops(), info.id))
    run = recorded(fs, returned, roots=("root", "fast"))
    assert sweep(run, tmp_path / "cut", "promotion.promote") > 5


def test_export(fs: PowerCutFS, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from trainsnap.tools.export import export_safetensors

    root = tmp_path / "outside"
    info = ts.save({"model": values(1)}, root, step=1, no_dist=True)
    out = fs.mount / "export"
    export_safetensors(root, info.id, out)
    done = fs.ops()

    def exported(state: Path, n: int) -> None:
        files = sorted((state / "export").glob("*.safetensors")) if n >= done else []
        if n < done:
            return  # an export cut short leaves what it leaves; only a returned one must hold
        assert files, f"export: after a cut at event {n}, the returned export is gone"
        got: dict[str, torch.Tensor] = {}
        for f in files:
            got.update(load_file(f))
        want = values(1)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)

    run = recorded(fs, [], roots=(), extra=exported)
    assert sweep(run, tmp_path / "cut", "export") > 2


def test_import_dcp(fs: PowerCutFS, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from trainsnap.tools.import_dcp import import_dcp

    dcp_dir = tmp_path / "dcp"
    dcp.save(values(4), checkpoint_id=str(dcp_dir))
    info = import_dcp(dcp_dir, fs.mount / "root", step=4)
    run = recorded(fs, [(fs.ops(), info.id)])
    assert sweep(run, tmp_path / "cut", "import-dcp") > 3


def test_memory_tier_node_directories(fs: PowerCutFS, tmp_path: Path) -> None:
    """A memory tier whose node directory is on the power-cut file system: a cut may keep any
    prefix of its writes; the durable root's saves must survive, and a manager with the same
    tier must start and restore, from memory or the root, values saved at the step it says."""

    def tier(base: Path) -> ts.MemoryTier:
        return ts.MemoryTier(root=str(base / "shm"), node=0, replicas=0)

    returned = _manager_run(fs, memory=tier(fs.mount))
    assert any(ev[0] == "new" for ev in fs.trace()[1]), "the memory tier wrote nothing"

    def restarts(state: Path, n: int) -> None:
        restored = template()
        with ts.CheckpointManager(state / "root", async_save=False, memory=tier(state)) as mgr:
            info = mgr.restore(restored, level="weights")
        if info is not None:
            want = values(info.step)
            assert all(torch.equal(restored[k], want[k]) for k in want), f"cut {n}: {info}"

    run = recorded(fs, returned[-1:], extra=restarts)
    assert sweep(run, tmp_path / "cut", "memory tier") > 5


# -- the two violations found, each a regression test ---------------------------------------


def test_a_deleted_snapshot_never_comes_back_without_its_objects(
    fs: PowerCutFS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention deletes snapshot 1 (its marker) and collection sweeps its objects; the next
    save syncs the object directories it writes into. A cut after that sync must not list
    snapshot 1 again with its objects gone: the marker's removal is durable before any object
    is swept. Each of 8 more tensors is its own object, so that the third save writes into two
    directories swept objects of the first were in (names are hashes: the directories are
    fixed). The cuts checked are those from the second save's return on."""
    monkeypatch.setattr(sys.modules[__name__], "MANY", 8)
    tunables.set_for_testing(tunables.Tunables(pack_threshold=16))
    returned = _manager_run(fs)
    run = recorded(fs, returned[-1:])
    at = [n for n in points(run.events) if n >= returned[1][0]]
    for n, state in cut_states(run.initial, run.events, tmp_path / "cut", at):
        for info in ts.list_snapshots(state / "root"):
            try:
                ts.verify(state / "root", info.id)
            except TrainsnapError as e:
                raise AssertionError(f"a cut at event {n} lists {info.id}, broken: {e}") from e


def test_a_directory_fsync_error_is_raised_not_swallowed(fs: PowerCutFS) -> None:
    """Every directory fsync fails with EIO: no save may return as if it were durable."""
    root = fs.mount / "root"
    fs.fail("fsyncdir", "/root")
    returned = []
    for step in (1, 2):
        try:
            returned.append(ts.save(values(step), root, step=step, no_dist=True).id)
        except TrainsnapError as e:
            assert "durable" in str(e) and str(root) in str(e), str(e)
    assert sum(fs.hits()) > 0
    fs.power_cycle()
    listed = {s.id for s in ts.list_snapshots(root)} if root.is_dir() else set()
    lost = [sid for sid in returned if sid not in listed]
    assert not lost, f"ts.save returned {lost}, and a power cut lost them"
    assert not returned, "a save whose directory fsync failed returned"


def test_a_directory_fsync_that_is_not_supported_is_not_an_error(tmp_path: Path) -> None:
    """EINVAL from fsync of a directory (a file system that cannot) is accepted."""
    from unittest import mock

    from trainsnap.storage import posix

    real = os.fsync

    def refuse_dirs(fd: int) -> None:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EINVAL, "not supported")
        real(fd)

    with mock.patch.object(posix.os, "fsync", refuse_dirs):
        info = ts.save(values(1), tmp_path / "root", step=1, no_dist=True)
    assert [s.id for s in ts.list_snapshots(tmp_path / "root")] == [info.id]


def test_report() -> None:
    """The sweep's size and time (run last in this module; `-s` shows it)."""
    print(f"\npowercut: {TALLY.cuts} cut points, {TALLY.seconds:.1f} s, paths: {TALLY.paths}")
