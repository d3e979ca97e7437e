"""The memory tier: snapshots in the nodes' own memory, replicated to partner nodes.

Four ranks run as two nodes of two (``GROUP_RANK``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` set per
process, one directory per node under the test's temporary directory), training a small
data-parallel model with a tensor sharded across the ranks. One chain of real processes:

* the reference: steps 1-20 uninterrupted, skipping memory steps while a save is in flight;
* run A: steps 1-11 (a memory snapshot every step, a durable one every 10), then every trainer
  SIGKILLs itself;
* run B: restores step 11 from the nodes' own memory (no byte of an object read from the durable
  root, which holds step 10), trains 12-14 (bitwise the reference), every trainer killed again;
* node 1 is lost (its directory wiped);
* run C: restores step 14 from node 0's memory into a fresh node 1 (bitwise), trains 15-18;
  rank 2 is killed while replicating step 18's snapshot: step 18 is committed on no node;
* node 0's copies of step 17 are damaged;
* run D, on 2 ranks (another topology): restores step 17 (not 18, not 16), node 0's rank fetching
  good copies from node 1, and trains 18-20 within floating-point noise of the reference.

Every rank of every run records the paths it touches under the memory root (an audit hook) and
the test fails if one lies in another node's directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import trainsnap as ts
from trainsnap.manager.memory_nodes import job_of, refusal, take_over
from trainsnap.protocol import commit
from trainsnap.storage import open_storage
from trainsnap.testing import run_ranks

MICRO = 4
"""Micro-batches per step: one per rank on 4 ranks, two per rank on 2."""
ROWS = 8


class _ObjectReads:
    """The durable root, counting the bytes of objects read from it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.url = inner.url
        self.readinto_is_zero_copy = inner.readinto_is_zero_copy
        self.object_bytes = 0

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        data: bytes = self.inner.get(key, start, end)
        if key.startswith("objects/"):
            self.object_bytes += len(data)
        return data

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        self.inner.read_into(key, start, out)
        if key.startswith("objects/"):
            self.object_bytes += out.nbytes

    def read_steps(self, key: str, start: int, steps: Any, done: Any) -> None:
        from trainsnap.storage.base import read_steps

        read_steps(self.inner, key, start, steps, done)
        if key.startswith("objects/"):
            self.object_bytes += sum(b.nbytes for step in steps for b in step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _paths(record: list[str]) -> Any:
    watched = {"open", "os.rename", "os.remove", "os.listdir", "os.mkdir", "os.scandir", "os.rmdir"}

    def hook(event: str, args: Any) -> None:
        if event in watched:
            for arg in args[:2]:
                if isinstance(arg, str | bytes):
                    record.append(os.fsdecode(arg))

    return hook


def _classify(touched: list[str], memory_root: str, node_dir: str) -> tuple[int, list[str]]:
    """(paths touched in this node's directory, paths touched in another node's)."""
    root = os.path.realpath(memory_root)
    mine = os.path.realpath(node_dir) + os.sep
    inside = [os.path.realpath(p) for p in touched]
    inside = [p for p in inside if p.startswith(root + os.sep)]
    own = [p for p in inside if (p + os.sep).startswith(mine)]
    foreign = [p for p in inside if "/node-" in p[len(root) :] and p not in own]
    return len(own), foreign


def test_the_audit_of_paths_sees_another_nodes_directory(tmp_path):
    touched: list[str] = []
    hook = _paths(touched)
    for node in (0, 1):
        (tmp_path / "job" / f"node-{node}").mkdir(parents=True)
    hook("os.listdir", (str(tmp_path / "job" / "node-0"),))
    hook("open", (str(tmp_path / "job" / "node-0" / "x"), "r", 0))
    hook("os.mkdir", (str(tmp_path / "job"), 0o777, None))
    assert _classify(touched, str(tmp_path), str(tmp_path / "job" / "node-0")) == (2, [])
    hook("os.scandir", (str(tmp_path / "job" / "node-1"),))
    own, foreign = _classify(touched, str(tmp_path), str(tmp_path / "job" / "node-0"))
    assert own == 2 and foreign == [os.path.realpath(tmp_path / "job" / "node-1")]


def _trainer(
    rank: int, world: int, out: str, tag: str, roots: dict[str, str], steps: tuple[int, int]
) -> None:
    import torch.distributed as dist

    touched: list[str] = []
    sys.addaudithook(_paths(touched))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows = ROWS // world
    table = (
        torch.arange(ROWS * 32, dtype=torch.float32)
        .reshape(ROWS, 32)[rank * rows : (rank + 1) * rows]
        .clone()
    )
    state = {
        "model": model,
        "optim": opt,
        "table": ts.Sharded(table, global_shape=(ROWS, 32), offsets=(rank * rows, 0)),
    }
    durable: Any = _ObjectReads(open_storage(roots["durable"]))
    mgr = ts.CheckpointManager(
        durable,
        interval=ts.Every(steps=10),
        memory=ts.MemoryTier(root=roots["memory"], wait_if_busy="skip" not in roots),
        options=ts.ManagerOptions(timeout=60),
    )
    result: dict[str, Any] = {"losses": {}, "rank": rank}
    first, last = steps
    if first > 1:
        info = mgr.restore(state, level="strict" if world == 4 else "training")
        assert info is not None
        result.update(restored=info.step, sources=dict(info.sources))
        first = info.step + 1
    result["durable_object_bytes"] = durable.object_bytes
    assert mgr.memory is not None
    node_dir = str(mgr.memory.directory)

    def dump() -> None:
        result["touched"], result["foreign"] = _classify(touched, roots["memory"], node_dir)
        with open(os.path.join(out, f"{tag}-{rank}.json"), "w") as f:
            json.dump(result, f)

    def finish(kill: bool) -> None:
        dump()
        if kill:
            os.kill(os.getpid(), signal.SIGKILL)

    dump()  # a rank killed later still says what it restored
    try:
        for step in range(first, last + 1):
            loss = _train_step(model, opt, table, step, rank, world)
            result["losses"][step] = loss
            mgr.step(step, state)
            result["table_sum"] = float(table.sum())
            result["skipped"] = mgr.memory.skipped
        mgr.wait()
        dist.barrier()
    except Exception as e:  # a killed partner: the job is over, as under torchrun
        result["error"] = repr(e)[:300]
        finish(kill=True)
    finish(kill=tag in ("A", "B"))
    mgr.close()


def _train_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    table: torch.Tensor,
    step: int,
    rank: int,
    world: int,
) -> float:
    """One data-parallel step over the same 4 micro-batches whatever the world size."""
    import torch.distributed as dist

    opt.zero_grad()
    per = MICRO // world
    total = torch.zeros(1)
    for micro in range(rank * per, (rank + 1) * per):
        g = torch.Generator().manual_seed(step * 100 + micro)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        total += loss.detach()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    dist.all_reduce(grads)
    dist.all_reduce(total)
    offset = 0
    for p in model.parameters():
        assert p.grad is not None
        p.grad.copy_(grads[offset : offset + p.numel()].reshape(p.shape) / MICRO)
        offset += p.numel()
    opt.step()
    table.mul_(0.5).add_(float(step))
    return float(total.item() / MICRO)


def _env(world: int) -> dict[int, dict[str, str]]:
    per_node = 2 if world == 4 else 1
    return {
        r: {
            "GROUP_RANK": str(r // per_node),
            "LOCAL_RANK": str(r % per_node),
            "LOCAL_WORLD_SIZE": str(per_node),
        }
        for r in range(world)
    }


def _results(out: Path, tag: str, world: int) -> list[dict[str, Any]]:
    found = []
    for r in range(world):
        path = out / f"{tag}-{r}.json"
        found.append(json.loads(path.read_text()) if path.exists() else {})
    return found


def _committed_steps(node: Path) -> list[int]:
    return [c.step for c in commit.list_committed(open_storage(node))] if node.exists() else []


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("memory-tier")
    out = tmp / "out"
    out.mkdir()
    # The reference skips memory steps while a save is in flight (the default): every rank must
    # skip the same ones, or the next save would never gather all ranks.
    ref = {"durable": str(tmp / "ref-durable"), "memory": str(tmp / "ref-shm"), "skip": "1"}
    roots = {"durable": str(tmp / "durable"), "memory": str(tmp / "shm")}
    # A rank silent this long is dead (run C waits this long for the killed one); also the
    # checkpoint-data group's timeout, so it leaves room for a loaded machine.
    env = {"TRAINSNAP_HEARTBEAT_SECONDS": "20"}
    runs: dict[str, Any] = {}

    def run(
        tag: str, world: int, where: dict[str, str], steps: tuple[int, int], **extra: Any
    ) -> None:
        rank_env = _env(world)
        for r, e in extra.get("faults", {}).items():
            rank_env[r]["TRAINSNAP_FAULTS"] = e
        started = time.perf_counter()
        runs[tag + "-procs"] = run_ranks(
            _trainer,
            world,
            args=(str(out), tag, where, steps),
            timeout=120,
            env=env,
            rank_env=rank_env,
        )
        runs[tag] = _results(out, tag, world)
        runs[tag + "-seconds"] = time.perf_counter() - started

    run("ref", 4, ref, (1, 20))
    run("A", 4, roots, (1, 11))
    run("B", 4, roots, (12, 14))
    nodes = Path(roots["memory"]) / job_of(str(open_storage(roots["durable"]).url))
    runs["nodes"] = nodes
    shutil.rmtree(nodes / "node-1")  # node 1 is lost, replaced by a fresh machine
    run("C", 4, roots, (15, 18), faults={2: "replicate_objects=crash#4"})
    runs["after C"] = {n: _committed_steps(nodes / f"node-{n}") for n in (0, 1)}
    storage = open_storage(nodes / "node-0")
    step17 = next(c for c in commit.list_committed(storage) if c.step == 17)
    damaged = 0
    for name in commit.open_snapshot(storage, step17.snapshot_id).object_names:
        path = nodes / "node-0" / "objects" / name[:2] / name
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        damaged += 1
    runs["damaged"] = damaged
    run("D", 2, roots, (18, 20))
    return runs


def _losses(result: dict[str, Any]) -> dict[int, float]:
    return {int(k): v for k, v in result.get("losses", {}).items()}


def test_a_crash_of_every_trainer_restores_the_last_step_from_the_nodes_own_memory(chain):
    assert all(r.ok for r in chain["ref-procs"]), chain["ref-procs"]
    assert len({r["skipped"] for r in chain["ref"]}) == 1  # the same steps skipped everywhere
    assert all(r.get("rank") is not None for r in chain["A"]), chain["A-procs"]
    b = chain["B"]
    assert [r.get("restored") for r in b] == [11] * 4, chain["B-procs"]
    assert [r["durable_object_bytes"] for r in b] == [0] * 4
    assert all(r["sources"]["memory (partner node)"] == 0 for r in b)
    assert all(r["sources"]["memory (this node)"] > 0 for r in b)
    reference = _losses(chain["ref"][0])
    assert _losses(b[0]) == {s: reference[s] for s in range(12, 15)}  # bitwise
    durable = chain["nodes"].parent.parent / "durable"
    # Step 10 promoted by run A, step 20 by run D (the end of the chain), never a second capture.
    assert [s.step for s in ts.list_snapshots(durable)] == [10, 20]


def test_a_lost_node_is_repopulated_from_its_partners_memory(chain):
    c = chain["C"]
    assert [r.get("restored") for r in c] == [14] * 4, chain["C-procs"]
    partner = [r["sources"]["memory (partner node)"] for r in c]
    # Node 1's ranks need the same replicated objects: one of them fetches each, once.
    assert partner[0] == partner[1] == 0 and partner[2] + partner[3] > 0
    reference = _losses(chain["ref"][0])
    assert {s: v for s, v in _losses(c[0]).items() if s < 18} == {
        s: reference[s] for s in range(15, 18)
    }


def test_a_partner_killed_during_replication_commits_nothing(chain):
    assert chain["C-procs"][2].killed
    after = chain["after C"]
    assert 18 not in after[0] and 18 not in after[1]
    assert after[0][-1] == after[1][-1] == 17


def test_a_damaged_copy_is_skipped_and_another_topology_resumes_within_noise(chain):
    d = chain["D"]
    assert chain["damaged"] > 0
    assert [r.get("restored") for r in d] == [17, 17], chain["D-procs"]
    assert d[0]["sources"]["memory (partner node)"] > 0  # node 0's good copies came from node 1
    reference = _losses(chain["ref"][0])
    # Two ranks sum the same 4 micro-batches' gradients in another order (two local sums, then
    # a 2-rank all-reduce, instead of a 4-rank one): float32 rounding (eps 1.2e-7) differs by a few
    # ulps per element and step, and Adam's normalisation carries it into the weights; over 3
    # steps that stays far below 1e-5 of a loss of order 1, while a wrong restore (another step,
    # a missing shard) changes the losses by more than 1e-2.
    for step, loss in _losses(d[0]).items():
        assert loss == pytest.approx(reference[step], rel=1e-5, abs=1e-6), step


def test_no_rank_touched_another_nodes_directory(chain):
    for tag in ("A", "B", "C", "D"):
        for r in chain[tag]:
            if r:
                assert r["touched"] > 0 and r["foreign"] == [], (tag, r["rank"], r["foreign"][:3])


# -- one process -----------------------------------------------------------------------------------


def _small(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(32, 32, generator=g), "step": step}


def test_a_tmpfs_too_small_is_refused_with_the_numbers(tmp_path, monkeypatch):
    import shutil as sh

    real = sh.disk_usage
    monkeypatch.setattr(
        sh,
        "disk_usage",
        lambda p: real(p)._replace(free=1000),  # type: ignore[attr-defined]
    )
    mgr = ts.CheckpointManager(
        tmp_path / "durable",
        memory=ts.MemoryTier(root=str(tmp_path / "shm"), allow_fewer_copies=True),
        async_save=False,
    )
    with pytest.raises(ts.InvalidArgumentError) as refused:
        mgr.step(1, _small(1))
    message = str(refused.value)
    needed, room = map(int, re.search(r"needs (\d+) bytes.* and (\d+) are free", message).groups())
    assert needed >= 3 * 32 * 32 * 4 and 1000 <= room < needed and "keep=2" in message
    assert str(tmp_path / "shm") in message and refused.value.path is not None
    assert ts.list_snapshots(refused.value.path) == []
    mgr.close()


def test_another_jobs_or_a_superseded_writers_snapshots_are_never_restored(tmp_path):
    memory = ts.MemoryTier(root=str(tmp_path / "shm"), allow_fewer_copies=True)
    with ts.CheckpointManager(tmp_path / "durable", memory=memory, async_save=False) as mgr:
        for step in (1, 2):
            mgr.step(step, _small(step))
        assert mgr.memory is not None
        node = mgr.memory.storage
        job, generation = mgr.memory.job, mgr.memory.generation
    found = {c.step: c for c in commit.list_committed(node)}
    writer = dict(found[2].marker.writer)
    assert writer["job"] == job and writer["copies"] == 1 and writer["generation"] == generation
    # The same writer's own snapshots restore; another job's never.
    assert refusal(writer, job, generation, set(), found[2].snapshot_id) == ""
    assert "another job" in refusal(writer, "0" * 16, generation, set(), found[2].snapshot_id)
    # Generation 2 takes over: what was present then restores; an older generation's snapshot
    # written after that does not.
    present = take_over(node, job, generation + 1)
    assert refusal(writer, job, generation + 1, present, found[2].snapshot_id) == ""
    assert "superseded" in refusal(writer, job, generation + 1, set(), "step-000000000003-abcd")
    fresh = {"w": torch.zeros(32, 32), "step": None}
    with ts.CheckpointManager(tmp_path / "durable", memory=memory) as again:
        info = again.restore(fresh)
    assert info is not None and info.step == 2 and torch.equal(fresh["w"], _small(2)["w"])


def test_a_memory_step_while_the_previous_save_is_in_flight_is_skipped_or_waits(tmp_path):
    from trainsnap import faults

    faults.install("before_marker=delay:0.3")
    try:
        for wait in (False, True):
            memory = ts.MemoryTier(
                root=str(tmp_path / f"shm-{wait}"), wait_if_busy=wait, allow_fewer_copies=True
            )
            with ts.CheckpointManager(tmp_path / f"durable-{wait}", memory=memory) as mgr:
                saved = [mgr.step(step, _small(step)) for step in range(1, 7)]
                assert mgr.memory is not None
                skipped = mgr.memory.skipped
            steps = [s.step for s in ts.list_snapshots(mgr.memory.storage)]
            if wait:
                assert saved == [True] * 6 and skipped == 0 and steps == [5, 6]
            else:  # never queued: each save in flight makes the next steps skip
                assert saved[0] and not all(saved) and skipped == saved.count(False)
                assert steps[-1] == max(s for s, ok in zip(range(1, 7), saved, strict=True) if ok)
    finally:
        faults.clear()


def test_partners_are_the_next_nodes_outside_the_failure_domain():
    from trainsnap.manager.memory_nodes import Topology

    three = Topology((0, 0, 1, 1, 2, 2), (0, 1, 0, 1, 0, 1), replicas=1)
    assert [three.partners(n) for n in three.ring] == [[1], [2], [0]]
    assert three.targets(1) == [3] and three.sources(1) == [5] and three.copies == 2
    racks = Topology((0, 1, 2, 3), (0, 0, 0, 0), replicas=1, domains=(0, 0, 1, 1))
    assert [racks.partners(n) for n in range(4)] == [[2], [2], [0], [0]]
    two = Topology((0, 1), (0, 0), replicas=3)
    assert two.partners(0) == [1] and two.copies == 2  # no more copies than nodes
