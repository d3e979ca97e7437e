"""Tiers: a fast local tier in front of a durable root, promotion, restore across tiers, and a
local tier that survives losing one node (partner copies)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

import trainsnap as ts
from trainsnap.protocol import commit
from trainsnap.storage import open_storage
from trainsnap.testing import assert_all_ok, run_ranks


def _state(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(128, 512, generator=g), "step": step}


def _blank() -> dict[str, object]:
    return {"w": torch.zeros(128, 512), "step": None}


def _run_two_tiers(local: Path, remote: Path, steps: int) -> ts.CheckpointManager:
    mgr = ts.CheckpointManager(
        remote,
        interval=ts.Every(steps=5),
        async_save=False,
        local=ts.LocalTier(root=local, interval=ts.Every(steps=1), retention=ts.KeepLast(3)),
    )
    for s in range(1, steps + 1):
        mgr.step(s, _state(s))
    mgr.wait()  # promotion and retention run in the background, even for synchronous saves
    return mgr


def test_local_every_step_remote_every_five(tmp_path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    mgr = _run_two_tiers(local, remote, 12)
    assert mgr.durable_step == 10
    tiers = mgr.tiers()
    by_step = {s.step: s.id for s in ts.list_snapshots(local)}
    assert sorted(by_step) == [10, 11, 12]  # KeepLast(3) on the local tier
    assert [s.step for s in ts.list_snapshots(remote)] == [5, 10]
    assert tiers[by_step[10]] == ["local", "durable"] and tiers[by_step[12]] == ["local"]
    mgr.close()
    assert ts.verify(remote).ok and ts.verify(local).ok
    fresh = _blank()
    with ts.CheckpointManager(remote, local=ts.LocalTier(root=local)) as again:
        info = again.restore(fresh)
    assert info is not None and info.step == 12 and fresh["step"] == 12


def test_losing_the_local_tier_restores_the_newest_durable_snapshot(tmp_path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    _run_two_tiers(local, remote, 12).close()
    shutil.rmtree(local)  # the node is gone
    fresh = _blank()
    with ts.CheckpointManager(remote, local=ts.LocalTier(root=local)) as again:
        info = again.restore(fresh)
    assert info is not None and info.step == 10
    assert torch.equal(fresh["w"], _state(10)["w"])


def test_a_corrupt_newest_local_snapshot_falls_back_to_the_durable_tier(tmp_path, caplog):
    local, remote = tmp_path / "local", tmp_path / "remote"
    _run_two_tiers(local, remote, 10).close()  # step 10: on both tiers; 8, 9: local only
    storage = open_storage(local)
    for s in ts.list_snapshots(local):
        m = commit.open_snapshot(storage, s.id)
        for name in m.object_names:  # damage every local copy
            p = next(local.rglob(name))
            data = bytearray(p.read_bytes())
            data[0] ^= 1
            p.write_bytes(bytes(data))
    fresh = _blank()
    with ts.CheckpointManager(remote, local=ts.LocalTier(root=local)) as again:
        info = again.restore(fresh)
    assert info is not None and info.step == 10 and fresh["step"] == 10
    assert torch.equal(fresh["w"], _state(10)["w"])
    assert any("on the local tier cannot be restored" in r.getMessage() for r in caplog.records)


def _node_rank(rank: int, world: int, nodes: list[str], remote: str, steps: int) -> int:
    mgr = ts.CheckpointManager(
        remote,
        interval=ts.Every(steps=100),
        async_save=False,
        local=ts.LocalTier(root=nodes, node=rank, partner=True, interval=ts.Every(steps=1)),
        options=ts.ManagerOptions(timeout=60),
    )
    rows = 128 // world
    for s in range(1, steps + 1):
        full = _state(s)["w"]
        assert isinstance(full, torch.Tensor)
        local = full[rank * rows : (rank + 1) * rows].clone()
        shard = ts.Sharded(local, global_shape=(128, 512), offsets=(rank * rows, 0))
        state = {"w": shard, "step": s}
        mgr.step(s, state)
    mgr.close()
    return steps


def test_partner_copies_survive_the_loss_of_one_node(tmp_path):
    nodes = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    remote = str(tmp_path / "remote")
    assert_all_ok(run_ranks(_node_rank, 2, args=(nodes, remote, 3), timeout=120))
    assert ts.list_snapshots(remote) == []  # nothing durable yet: only the local tier
    shutil.rmtree(nodes[1])  # node 1 is lost
    survivor = ts.open_storage(ts.tiers.NodeTier([open_storage(n) for n in nodes], 0))
    fresh = _blank()
    info = ts.load(fresh, survivor)
    assert info.step == 3 and torch.equal(fresh["w"], _state(3)["w"])
    # Without partner copies the same loss leaves half the objects unreachable.
    shutil.rmtree(nodes[0])
    assert_all_ok(run_ranks(_no_partner, 2, args=(nodes, remote + "2"), timeout=120))
    shutil.rmtree(nodes[1])
    lonely = ts.open_storage(ts.tiers.NodeTier([open_storage(n) for n in nodes], 0))
    try:
        ts.load(_blank(), lonely)
        lost = False
    except ts.CorruptError:
        lost = True
    assert lost


def _no_partner(rank: int, world: int, nodes: list[str], remote: str) -> int:
    mgr = ts.CheckpointManager(
        remote,
        async_save=False,
        local=ts.LocalTier(root=nodes, node=rank, partner=False, interval=ts.Every(steps=1)),
        options=ts.ManagerOptions(timeout=60),
    )
    rows = 128 // world
    full = _state(1)["w"]
    assert isinstance(full, torch.Tensor)
    local = full[rank * rows : (rank + 1) * rows].clone()
    shard = ts.Sharded(local, global_shape=(128, 512), offsets=(rank * rows, 0))
    state = {"w": shard, "step": 1}
    mgr.step(1, state)
    mgr.close()
    return 1


def test_weights_only_saves_between_full_ones_say_their_level(tmp_path):
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.AdamW(model.parameters())
    st = ts.TrainState(model, opt, no_data_order=True)  # no data order: strict is reachable
    with ts.CheckpointManager(
        tmp_path,
        interval=ts.Every(steps=10),
        async_save=False,
        options=ts.ManagerOptions(weights_interval=ts.Every(steps=2)),
    ) as mgr:
        for s in range(1, 13):
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
            mgr.step(s, st)
    levels = {s.step: s.level for s in ts.list_snapshots(tmp_path)}
    assert levels == {
        2: "weights",
        4: "weights",
        6: "weights",
        8: "weights",
        10: "strict",
        12: "weights",
    }
    m2 = torch.nn.Linear(16, 8)
    o2 = torch.optim.AdamW(m2.parameters())
    with ts.CheckpointManager(tmp_path) as again:
        info = again.restore(
            ts.TrainState(m2, o2, no_data_order=True)
        )  # strict: the newest full save
        assert info is not None and info.step == 10 and info.level == "strict"
        latest = again.restore(ts.TrainState(m2, o2, no_data_order=True), level="weights")
        assert latest is not None and latest.step == 12
    assert torch.equal(m2.weight, model.weight)


def test_ls_says_which_tiers_hold_each_snapshot(tmp_path):
    from typer.testing import CliRunner

    from trainsnap.tools.cli import app

    local, remote = tmp_path / "local", tmp_path / "remote"
    _run_two_tiers(local, remote, 11).close()
    out = CliRunner().invoke(app, ["ls", str(remote), "--local", str(local)]).output
    rows = {
        line.split()[0]: line.split()[-1] for line in out.splitlines() if line[:5].strip().isdigit()
    }
    assert rows == {"5": "durable", "9": "local", "10": "local+durable", "11": "local"}


# -- memory, local and durable tiers composed --------------------------------------------------

COMPOSED_STEPS = range(12)
"""Steps 0-11: memory every step, local every 2nd (0, 2, ... 10), durable every 5th (0, 5, 10)."""


def _composed_state(rank: int, world: int, step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    rows = torch.randn(4, 64, generator=g)
    return {
        "shard": ts.Sharded(rows, global_shape=(4 * world, 64), offsets=(4 * rank, 0)),
        "bias": torch.full((8,), float(step)),
        "step": step,
    }


def _composed_manager(rank: int, world: int, roots: dict[str, str]) -> ts.CheckpointManager:
    nodes = [roots["local"] + "/node-0", roots["local"] + "/node-1"][: max(1, world // 2)]
    return ts.CheckpointManager(
        roots["durable"],
        interval=ts.Every(steps=5),
        local=ts.LocalTier(root=nodes if world > 1 else roots["local"], interval=ts.Every(steps=2)),
        memory=ts.MemoryTier(
            root=roots["memory"],
            interval=ts.Every(steps=1),
            wait_if_busy=True,
            allow_fewer_copies=world == 1,  # one process is one node: no partner to copy to
        ),
        options=ts.ManagerOptions(timeout=60, staging_budget=1 << 20),
    )


def _composed_train(rank: int, world: int, roots: dict[str, str]) -> int:
    """Steps 0-11 through one manager; the staging pool's peak bytes."""
    mgr = _composed_manager(rank, world, roots)
    for step in COMPOSED_STEPS:
        mgr.step(step, _composed_state(rank, world, step))
    mgr.wait()
    peak = mgr.saver.pool.peak
    mgr.close()
    return peak


def _composed_restore(rank: int, world: int, roots: dict[str, str]) -> tuple[int, bool]:
    """(step restored, whether every value is the one saved at that step)."""
    mgr = _composed_manager(rank, world, roots)
    blank = {
        "shard": ts.Sharded(
            torch.zeros(4, 64), global_shape=(4 * world, 64), offsets=(4 * rank, 0)
        ),
        "bias": torch.zeros(8),
        "step": None,
    }
    info = mgr.restore(blank)
    mgr.close()
    assert info is not None
    want = _composed_state(rank, world, info.step)
    exact = (
        torch.equal(blank["shard"].local, want["shard"].local)  # type: ignore[attr-defined]
        and torch.equal(blank["bias"], want["bias"])  # type: ignore[arg-type]
        and blank["step"] == info.step
    )
    return info.step, exact


def _restored_from(durable: str) -> str:
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "trainsnap.tools.cli", "history", durable, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return str(json.loads(out.stdout)["runs"][-1]["restored_from"])


def _node_steps(root: Path) -> list[int]:
    return [c.step for c in commit.list_committed(open_storage(root))] if root.exists() else []


def _composed(tmp_path: Path, world: int) -> None:
    roots = {k: str(tmp_path / k) for k in ("durable", "local", "memory")}
    env = {r: {"GROUP_RANK": str(r // 2), "LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": "2"}
           for r in range(world)} if world > 1 else {0: {}}  # fmt: skip
    run = lambda fn: assert_all_ok(  # noqa: E731
        run_ranks(fn, world, args=(roots,), timeout=240, rank_env=env)
    )
    peaks = run(_composed_train)
    assert all(0 < p <= 1 << 20 for p in peaks), peaks  # one staging budget for every tier
    (job,) = list(Path(roots["memory"]).iterdir())
    memory_dirs = sorted(job.iterdir())
    assert len(memory_dirs) == max(1, world // 2)
    assert all(_node_steps(d) == [10, 11] for d in memory_dirs)  # MemoryTier(keep=2)
    local_roots = sorted(Path(roots["local"]).glob("node-*")) or [Path(roots["local"])]
    assert all(_node_steps(d) == [8, 10] for d in local_roots)  # LocalTier's KeepLast(2)
    assert _node_steps(Path(roots["durable"])) == [0, 5, 10]  # durable: no retention
    assert ts.verify(roots["durable"]).ok
    for removed, step, named in (
        (None, 11, "memory (this node)"),
        ("memory", 10, "local disk"),
        ("local", 10, "durable"),
    ):
        if removed is not None:
            shutil.rmtree(roots[removed])
        said = run(_composed_restore)
        assert said == [(step, True)] * world, (removed, said)
        assert _restored_from(roots["durable"]) == named


def test_memory_local_and_durable_tiers_compose_in_one_process(tmp_path):
    _composed(tmp_path, 1)


def test_memory_local_and_durable_tiers_compose_on_two_nodes_of_two(tmp_path):
    _composed(tmp_path, 4)


def test_memory_local_and_durable_saves_share_one_staging_budget(tmp_path):
    """Every tier's saves stage into the manager's one pool: its peak stays within
    ``staging_budget`` with memory snapshots every step, promoted to the local and durable
    tiers, and two saves allowed in flight."""
    state = {"w": torch.zeros(256, 256)}  # 256 KiB
    budget = 320 << 10
    mgr = ts.CheckpointManager(
        tmp_path / "durable",
        interval=ts.Every(steps=2),
        local=ts.LocalTier(root=tmp_path / "local", interval=ts.Every(steps=1)),
        memory=ts.MemoryTier(
            root=str(tmp_path / "memory"), wait_if_busy=True, allow_fewer_copies=True
        ),
        options=ts.ManagerOptions(staging_budget=budget, max_in_flight=2),
    )
    for step in range(6):
        state["w"].add_(1.0)
        assert mgr.step(step, state)
    mgr.wait()
    peak = mgr.saver.pool.peak
    mgr.close()
    assert 256 << 10 <= peak <= budget, peak  # staged (not written synchronously), once
    assert [s.step for s in ts.list_snapshots(tmp_path / "durable")] == [0, 2, 4]
    assert [s.step for s in ts.list_snapshots(tmp_path / "local")] == [4, 5]
