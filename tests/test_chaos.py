"""The chaos suite: every fault the field reports, injected into real saves and loads, with the
correctness contract checked after every trial (see tests/chaos.py).

Bounded in CI; the soak is ``TRAINSNAP_CHAOS_TRIALS=25 sh scripts/test.sh -m chaos`` (README).
The summary table is printed at the end of the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import trainsnap as ts
from chaos import blank, check_contract, expected, record, same, trials
from trainsnap.format import encoding, manifest
from trainsnap.format.checksums import Hasher
from trainsnap.manager import collection
from trainsnap.protocol import commit
from trainsnap.storage import PosixStorage, RetryingStorage
from trainsnap.storage.faulty import FaultPlan, FaultyStorage
from trainsnap.testing import run_ranks

pytestmark = pytest.mark.chaos

STORAGE_FAULTS = {
    "storage: timeouts (transient)": "timeout=0.3",
    "storage: connection resets (transient)": "transient=0.3",
    "storage: truncated write reported as success": "truncate=0.3",
    "storage: bit flips at rest": "bitflip=0.3",
    "storage: listings lag behind writes": "lag=5",
    "storage: listings reordered": "reorder=1",
    "storage: duplicated operations": "duplicate=0.5",
    "storage: full disk (ENOSPC)": "enospc=150000",
    "storage: the root disappears": "vanish=12",
    "storage: latency": "latency=0.002",
}


def _faulty(root: Path, spec: str, seed: int) -> RetryingStorage:
    plan = FaultPlan.parse(f"{spec},seed={seed}")
    return RetryingStorage(FaultyStorage(PosixStorage(root), plan), base_delay=0.001)


@pytest.mark.parametrize("fault", list(STORAGE_FAULTS))
def test_storage_faults(fault, tmp_path):
    total = 0
    for trial in range(trials(3)):
        root = tmp_path / f"t{trial}"
        ts.save(expected(1), root, step=1)
        storage = _faulty(root, STORAGE_FAULTS[fault], seed=trial)
        saver = ts.AsyncSaver()
        raised = False
        for step in (2, 3, 4):
            try:
                if step == 3:  # one asynchronous save among the synchronous ones
                    h = ts.async_save(expected(step), storage, step=step, saver=saver)
                    h.wait()
                else:
                    ts.save(expected(step), storage, step=step)
            except (ts.TrainsnapError, OSError):
                raised = True
        try:
            saver.close()
        except (ts.TrainsnapError, OSError):
            raised = True
        raised |= _read_and_collect_through(storage)
        violations, damaged = check_contract(root)
        injected = sum(storage.inner.injected.values())
        total += injected
        if injected:
            record(fault, raised or damaged or storage.retries > 0, violations, injected)
        assert not violations, violations
    assert total > 0, "the fault was never injected"


def _read_and_collect_through(storage: RetryingStorage) -> bool:
    """Readers and the collector under the same faults: whatever they see must be committed
    and bitwise what was saved; the collection (a writer may be active: grace period) must not
    break anything (checked afterwards). True when an error was raised."""
    try:
        listed = ts.list_snapshots(storage)
        if listed:
            dst = blank()
            info = ts.load(dst, storage)
            if not same(dst, expected(info.step)):
                raise AssertionError(f"snapshot of step {info.step} loaded different values")
        collection.collect(storage, grace=60.0)
    except (ts.TrainsnapError, OSError):
        return True
    return False


# -- SIGKILL of a random rank during asynchronous multi-process saves -------------------------


def _rank_part(step: int, rank: int, world: int) -> dict[str, object]:
    """This rank's part of the state of ``step``: its rows of ``w``, the rest replicated."""
    full = expected(step)
    w = full["w"]
    assert isinstance(w, torch.Tensor)
    rows = 96 // world
    local = w[rank * rows : (rank + 1) * rows].clone()
    return {
        "w": ts.Sharded(local, global_shape=(96, 1024), offsets=(rank * rows, 0)),
        "small": full["small"],
        "step": step,
    }


def _saving_ranks(rank: int, world: int, root: str, steps: int) -> None:
    after = os.environ.get("CHAOS_KILL_AFTER")
    if after:  # die at a random moment: training, staging, writing or committing
        threading.Timer(float(after), os.kill, (os.getpid(), signal.SIGKILL)).start()
    mgr = ts.CheckpointManager(
        root, interval=ts.Every(steps=1), options=ts.ManagerOptions(timeout=30)
    )
    for step in range(1, steps + 1):
        mgr.step(step, _rank_part(step, rank, world))
        time.sleep(0.05)
    mgr.close()


def test_sigkill_random_rank_during_async_saves(tmp_path):
    rng = random.Random(0)
    for trial in range(trials(1)):
        root = str(tmp_path / f"t{trial}")
        victim, after = rng.randrange(2), rng.uniform(4.0, 7.0)
        results = run_ranks(
            _saving_ranks,
            2,
            args=(root, 40),
            timeout=120,
            env={"TRAINSNAP_HEARTBEAT_SECONDS": "5"},
            rank_env={victim: {"CHAOS_KILL_AFTER": str(after)}},
        )
        killed = any(r.killed for r in results)
        violations, damaged = check_contract(Path(root), fresh=blank)
        record("SIGKILL of a random rank during async saves", killed or damaged, violations)
        assert not violations, violations


# -- a save while the previous one drains; preemption during a save ---------------------------


def test_a_save_while_the_previous_one_drains(tmp_path):
    for trial in range(trials(2)):
        root = tmp_path / f"t{trial}"
        storage = _faulty(root, "latency=0.01", seed=trial)
        saver = ts.AsyncSaver(max_in_flight=1)
        handles = [ts.async_save(expected(s), storage, step=s, saver=saver) for s in (1, 2, 3)]
        saver.close()
        ok = all(
            h is not None and h.wait().step == s for h, s in zip(handles, (1, 2, 3), strict=True)
        )
        violations, _ = check_contract(root)
        if saver.peak_in_flight > 1:
            violations.append(f"{saver.peak_in_flight} saves were in flight at once")
        record("a save triggered while the previous one drains", ok, violations)
        assert not violations and ok, violations


_PREEMPT = textwrap.dedent(
    """
    import sys, time, torch, trainsnap as ts
    sys.path.insert(0, sys.argv[2])
    from chaos import expected
    from trainsnap.storage import open_storage
    mgr = ts.CheckpointManager(sys.argv[1], interval=ts.Every(steps=5))
    for step in range(1, 10_000):
        mgr.step(step, expected(step))
        if step % 5 == 0:
            print(f"saving {step}", flush=True)
        if mgr.preempted:
            print(f"preempted {step}", flush=True)
            break
        time.sleep(0.01)
    mgr.close()
    """
)


def test_preemption_during_a_save(tmp_path):
    for trial in range(trials(1)):
        root = tmp_path / f"t{trial}"
        env = dict(os.environ, TRAINSNAP_STORAGE_FAULTS="latency=0.02")
        proc = subprocess.Popen(
            [sys.executable, "-c", _PREEMPT, str(root), str(Path(__file__).parent)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("saving 10"):
                proc.send_signal(signal.SIGTERM)  # while the save of step 10 drains
                break
        out, _ = proc.communicate(timeout=120)
        preempted = [int(x.split()[1]) for x in out.splitlines() if x.startswith("preempted")]
        violations, _ = check_contract(root)
        steps = [s.step for s in ts.list_snapshots(root)]
        if proc.returncode != 0 or len(preempted) != 1 or preempted[0] not in steps:
            violations.append(f"exit {proc.returncode}, preempted {preempted}, committed {steps}")
        record("preemption (SIGTERM) during a save", True, violations)
        assert not violations, violations


# -- incompatible restores ------------------------------------------------------------------------


def _reseal(root: Path, sid: str, edit) -> None:
    mpath = root / manifest.manifest_key(sid)
    doc, body = encoding.unpack(mpath.read_bytes())
    edit(doc)
    raw = encoding.pack(doc, bytes(body))
    mpath.write_bytes(raw)
    kpath = root / manifest.marker_key(sid)
    mk = json.loads(kpath.read_bytes())
    mk["manifest"] = {
        "size": len(raw),
        "algorithm": "xxh3-128",
        "digest": Hasher().digest(raw).hex(),
    }
    kpath.write_bytes(json.dumps(mk).encode())


def test_restore_with_incompatible_format_model_or_optimizer(tmp_path):
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    cases = {
        "restore: newer format version": ts.IncompatibleError,
        "restore: changed model version": ts.IncompatibleError,
        "restore: different optimizer": (ts.NotFoundError, ts.IncompatibleError),
    }
    for trial in range(trials(1)):
        for case, kinds in cases.items():
            root = tmp_path / f"{trial}-{len(case)}"
            info = ts.save(ts.TrainState(model, opt, versions={"model": "v1"}), root, step=1)
            m2 = torch.nn.Linear(8, 4)
            o2: torch.optim.Optimizer = torch.optim.AdamW(m2.parameters())
            versions = {"model": "v1"}
            if case.endswith("format version"):
                newer = manifest.FORMAT_VERSION + 1
                _reseal(root, info.id, lambda d, v=newer: d.update(format_version=v))
            elif case.endswith("model version"):
                versions = {"model": "v2"}
            else:
                o2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
                o2.step()
            try:
                ts.load(ts.TrainState(m2, o2, versions=versions), root)
                detected = False
            except kinds:
                detected = True
            violations = [] if detected else [f"{case}: loaded without complaint"]
            record(case, detected, violations)
            assert not violations, violations


# -- the coordinator dies between the manifest and the marker --------------------------------------


def _two_rank_save(rank: int, world: int, root: str, step: int, coordinator: int) -> str:
    state = _rank_part(step, rank, world)
    return ts.save(state, root, step=step, coordinator=coordinator, timeout=30).id


def test_coordinator_dies_between_manifest_and_marker(tmp_path):
    for trial in range(trials(1)):
        root = str(tmp_path / f"t{trial}")
        ts.save(expected(1), root, step=1)
        env = {"TRAINSNAP_HEARTBEAT_SECONDS": "5"}
        first = run_ranks(
            _two_rank_save,
            2,
            args=(root, 2, 0),
            timeout=120,
            env=env,
            rank_env={0: {"TRAINSNAP_FAULTS": "before_marker=crash"}},
        )
        assert first[0].killed
        # The job restarts with another coordinator and retries the same step.
        again = run_ranks(_two_rank_save, 2, args=(root, 2, 1), timeout=120, env=env)
        sids = {r.value for r in again}
        storage = ts.open_storage(root)
        leftovers = commit.snapshot_ids(storage) - {s.id for s in ts.list_snapshots(storage)}
        violations, _ = check_contract(Path(root))
        if len(sids) != 1 or [s.step for s in ts.list_snapshots(root)] != [1, 2]:
            violations.append(
                f"retry gave {sids}, listed {[s.step for s in ts.list_snapshots(root)]}"
            )
        if not leftovers:
            violations.append(
                "the dead coordinator's manifest was not left as an uncommitted snapshot"
            )
        if commit.snapshot_ids(storage) - {s.id for s in ts.list_snapshots(storage)}:
            violations.append("collection left the dead attempt's manifest behind")
        record("coordinator dies between manifest and marker", first[0].killed, violations)
        assert not violations, violations


# -- collection right after the writer closed, under lagging listings ----------------------------


BIG = (512, 1024)  # 2 MiB: w gets an object of its own, which step 2 reuses


def test_collection_after_close_under_a_lagging_listing(tmp_path):
    """Found by this suite: with no writer active, ``trainsnap gc`` collects everything
    unreferenced at once; a listing that does not show the newest snapshot yet made its
    objects look unreferenced, and the collection deleted them. The released lease now names
    the newest snapshot, and a collection whose listing lacks it refuses."""
    for trial in range(trials(2)):
        root = tmp_path / f"t{trial}"
        ts.save(expected(1, BIG), root, step=1)  # long ago: visible in every listing
        storage = _faulty(root, "lag=30", seed=trial)
        with ts.CheckpointManager(storage, async_save=False) as mgr:
            state = expected(1, BIG)
            state["step"] = 2
            state["small"] = expected(2)["small"]  # w unchanged: its object is reused
            mgr.save(2, state)
        commit.delete_snapshot(ts.open_storage(root), ts.list_snapshots(root)[0].id)  # step 1
        # Now the only snapshot referencing w's (old, visible) object is step 2, which the
        # lagging listing does not show yet.
        refused = False
        try:
            collection.collect_root(storage)
        except ts.TrainsnapError as e:
            refused = "lagging listing" in str(e)

        def make(step: int) -> dict[str, object]:
            out = expected(1, BIG)
            out["step"], out["small"] = step, expected(step)["small"]
            return out

        violations, _ = check_contract(root, make=make, fresh=lambda: blank(BIG))
        # Retention under the same lag may keep step 1 (it cannot see step 2 yet): safe.
        if 2 not in [s.step for s in ts.list_snapshots(root)]:
            violations.append("the committed snapshot of step 2 was lost")
        record("collection right after close, lagging listing", refused, violations)
        assert refused and not violations, violations


# -- the memory tier: a partner lost mid-copy, the tmpfs full, a stale writer generation -----------

NEVER = 10**9
"""A durable interval (steps) that never fires: only the memory tier saves."""


def _memory_manager(
    root: str, memory: str, node: int, *, alone: bool = False
) -> ts.CheckpointManager:
    """A manager with a memory tier on ``node``; ``alone``: a process by itself (a restore
    checked from one node, a newer job on one node), which accepts fewer copies than the
    partner rule asks."""
    tier = ts.MemoryTier(
        root=f"{memory}/node-{node}", node=node, wait_if_busy=True, allow_fewer_copies=alone
    )
    options = ts.ManagerOptions(timeout=8, preemption_signals=())
    return ts.CheckpointManager(root, interval=ts.Every(steps=NEVER), memory=tier, options=options)


def _memory_saving_ranks(rank: int, world: int, root: str, memory: str, steps: int) -> dict:
    """2 ranks as 2 nodes, a memory snapshot every step (each waited for): the steps whose
    snapshot this rank saw committed, and the error that stopped it."""
    mgr = _memory_manager(root, memory, rank)
    done: list[int] = []
    error = None
    try:
        for step in range(1, steps + 1):
            mgr.step(step, _rank_part(step, rank, world))
            mgr.wait()
            done.append(step)
    except (ts.TrainsnapError, OSError) as e:
        error = f"{type(e).__name__}: {e}"
    with contextlib.suppress(ts.TrainsnapError, OSError):
        mgr.close()
    return {"done": done, "error": error}


def _node_dirs(memory: Path) -> list[Path]:
    (job,) = [p for p in memory.glob("node-0/*") if p.is_dir()]
    return [memory / f"node-{n}" / job.name / f"node-{n}" for n in (0, 1)]


def _committed_steps(directory: Path) -> list[int]:
    return [c.step for c in commit.list_committed(ts.open_storage(directory))]


def _restore_as_node(root: Path, memory: Path, node: int) -> tuple[int | None, bool]:
    """A restart of one node alone (this process, another topology): the step it restores
    from the memory tier and whether it holds what was saved at that step."""
    destination = blank()
    mgr = _memory_manager(str(root), str(memory), node, alone=True)
    try:
        info = mgr.restore(destination)
    finally:
        mgr.close()
    if info is None:
        return None, False
    return info.step, same(destination, expected(info.step))


def _memory_contract(root: Path, memory: Path, failed: int | None) -> list[str]:
    """The memory tier after a fault: each node directory keeps the contract (chaos.py), no
    node committed ``failed`` or a later step, both nodes hold the same committed steps, and
    a restart of either node restores the newest of them bitwise."""
    violations: list[str] = []
    held = []
    for node, directory in enumerate(_node_dirs(memory)):
        steps = _committed_steps(directory)
        held.append(steps)
        if failed is not None and any(s >= failed for s in steps):
            violations.append(f"node {node} committed {steps}, though step {failed} failed")
        found, _ = check_contract(directory)
        violations += [f"node {node}: {v}" for v in found]
    if held[0] != held[1]:
        violations.append(f"the nodes hold different committed steps: {held}")
    for node in (0, 1):
        step, ok = _restore_as_node(root, memory, node)
        newest = max(held[node], default=None)
        if step != newest or not (ok or newest is None):  # nothing committed: nothing restores
            violations.append(f"node {node} restored step {step} (ok={ok}), newest is {newest}")
    return violations


def _failed_step(results: list) -> int | None:
    """The step whose memory snapshot failed: the one after the last that every surviving
    rank saw committed."""
    values = [r.value for r in results if r.value is not None]
    return min(len(v["done"]) for v in values) + 1 if values else None


def test_memory_tier_partner_lost_mid_copy(tmp_path):
    """A rank SIGKILLed while its node replicates a memory snapshot to its partner (before or
    during the copy of its objects): that snapshot is committed on no node, the previous one
    restores bitwise."""
    rng = random.Random(1)
    for trial in range(trials(1)):
        root, memory = tmp_path / f"t{trial}", tmp_path / f"m{trial}"
        victim = rng.randrange(2)
        point = rng.choice(["replicate_objects", "replicate_object"])
        fault = f"{point}=crash#{rng.randint(2, 4)}"
        results = run_ranks(
            _memory_saving_ranks,
            2,
            args=(str(root), str(memory), 6),
            timeout=60,
            env={"TRAINSNAP_HEARTBEAT_SECONDS": "5"},
            rank_env={victim: {"TRAINSNAP_FAULTS": fault}},
        )
        killed = results[victim].killed and not results[victim].timed_out
        survivor = results[1 - victim]
        violations = [] if killed else [f"{fault} on rank {victim}: {results[victim].describe()}"]
        if survivor.value is None or survivor.value["error"] is None:
            violations.append(f"the survivor did not see the failure: {survivor.describe()}")
        failed = _failed_step(results)
        violations += [f"{fault} on rank {victim}, step {failed}: {v}" for v in
                       _memory_contract(root, memory, failed)]  # fmt: skip
        record("memory tier: partner lost mid-copy", killed, violations)
        assert not violations, violations


# Node 1's writes into its directory, in order (rank 1 writes nothing else): the writer record
# once, then per snapshot its 2 own objects, the manifest from the coordinator, the copy of node
# 0's object, the marker. Hits 7-20 fall in the snapshots of steps 2-4, markers included (11, 16):
# a marker that fails after the other node wrote its own makes that node take its marker back.
_NODE_1_WRITES = list(range(7, 21))


def test_memory_tier_tmpfs_full(tmp_path):
    """A node's tmpfs full (ENOSPC) while a memory snapshot is written there: its own objects,
    a copy received from the partner, its manifest or its marker. The save fails on every rank,
    no node commits it, no temporary file is left, and the previous snapshot restores."""
    rng = random.Random(2)
    for trial in range(trials(2)):
        root, memory = tmp_path / f"t{trial}", tmp_path / f"m{trial}"
        if rng.random() < 0.5:  # a rank's own objects (the save protocol's writes)
            fault, rank = f"before_write=enospc#{rng.randint(2, 4)}", rng.randrange(2)
        else:  # a write into node 1's directory: its objects, a copy, a manifest
            fault, rank = f"mid_write=enospc#{rng.choice(_NODE_1_WRITES)}", 1
        results = run_ranks(
            _memory_saving_ranks,
            2,
            args=(str(root), str(memory), 6),
            timeout=60,
            env={"TRAINSNAP_HEARTBEAT_SECONDS": "5"},
            rank_env={rank: {"TRAINSNAP_FAULTS": fault}},
        )
        values = [r.value for r in results]
        violations = [f"rank {r.rank}: {r.describe()}" for r in results if not r.ok]
        failed = None
        if not violations:
            failed = _failed_step(results)
            errors = [v["error"] for v in values]
            if failed is None or failed > 6 or not all(errors):
                violations.append(f"{fault} on rank {rank}: not every rank failed: {values}")
            elif "no space left" not in errors[rank]:  # its own error, not a timeout's
                violations.append(f"{fault} on rank {rank}: the ENOSPC is not named: {values}")
        leftovers = [p for p in memory.rglob("*") if ".tmp-" in p.name]
        if leftovers:
            violations.append(f"temporary files left: {leftovers[:3]}")
        violations += _memory_contract(root, memory, failed)
        record("memory tier: tmpfs full (ENOSPC)", failed is not None, violations)
        assert not violations, violations


def _wait_for(path: Path, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {seconds} s")
        time.sleep(0.02)


def _superseded_writer(rank: int, world: int, root: str, memory: str, signals: str) -> dict:
    """An old job on node 0: snapshots of steps 1 and 2; at step 3 it passes its writer check,
    then (held there until a newer job took the node over) writes its marker anyway: the race
    between the check and the marker. Step 4 finds itself superseded."""
    from trainsnap.manager import memory_tier

    checked, taken, written = (Path(signals) / n for n in ("checked", "taken", "written"))
    real_check = memory_tier.check_writer

    def check_then_lose_the_race(storage: Any, generation: int) -> None:
        real_check(storage, generation)
        if not checked.exists():
            checked.touch()
            _wait_for(taken)

    mgr = _memory_manager(root, memory, 0, alone=True)
    errors = []
    for step in (1, 2, 3, 4):
        if step == 3:
            memory_tier.check_writer = check_then_lose_the_race  # type: ignore[assignment]
        try:
            mgr.step(step, expected(step))
            mgr.wait()
        except ts.TrainsnapError as e:
            errors.append((step, str(e)))
        if step == 3:
            written.touch()
    with contextlib.suppress(ts.TrainsnapError):
        mgr.close()
    return {"errors": errors}


def _run_into(out: list, function: Any, args: tuple) -> None:
    """One process without a process group (a thread's work): its result into ``out``."""
    out.extend(run_ranks(function, 1, args=args, timeout=60, init_pg=False))


def test_memory_tier_stale_generation_is_never_restored(tmp_path):
    """A memory snapshot whose marker an older writer generation wrote after a newer one took
    the node over is never restored: not by the job that took over, nor by a later restart."""
    for trial in range(trials(1)):
        root, memory, signals = (tmp_path / f"{n}{trial}" for n in ("t", "m", "s"))
        signals.mkdir()
        old: list = []
        thread = threading.Thread(
            target=_run_into,
            args=(old, _superseded_writer, (str(root), str(memory), str(signals))),
        )
        thread.start()
        violations: list[str] = []
        restored: list[int | None] = []
        try:
            _wait_for(signals / "checked", 50)
            # the newer job takes over
            newer = _memory_manager(str(root), str(memory), 0, alone=True)
            try:
                assert newer.memory is not None
                newer.memory.start(newer.generation)
                (signals / "taken").touch()
                _wait_for(signals / "written")
                destination = blank()
                info = newer.restore(destination)
                restored.append(None if info is None else info.step)
                if info is None or not same(destination, expected(info.step)):
                    violations.append(f"the newer job restored {info} wrongly")
            finally:
                newer.close()
        finally:
            (signals / "taken").touch()
            thread.join()
        (directory,) = _node_dirs(memory)[:1]
        stale = 3 in _committed_steps(directory)  # the old writer's marker is there
        step, ok = _restore_as_node(root, memory, 0)  # a later restart
        restored.append(step)
        if restored != [2, 2] or not ok:
            violations.append(f"restored steps {restored} (ok={ok}); the stale one is step 3")
        (result,) = old
        errors = result.value["errors"] if result.value else []
        if [s for s, _ in errors] != [4] or "superseded" not in errors[0][1]:
            violations.append(f"the old writer's step 4 was not refused: {result.describe()}")
        record("memory tier: stale writer generation", stale, violations)
        assert stale and not violations, violations
