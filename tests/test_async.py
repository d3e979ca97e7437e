"""Asynchronous saves: what is saved is the state at the call, saves in flight are bounded,
background failures surface, exit does not lose a save, and phases are traced."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import trainsnap as ts
from trainsnap import faults, trace
from trainsnap.faults import InjectedFault
from trainsnap.testing import assert_all_ok, run_ranks


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(300, 257, generator=g),
        "half": torch.randn(1000, generator=g).to(torch.bfloat16),
        "ints": torch.randint(0, 1 << 30, (77,), generator=g),
        "flags": torch.rand(33, generator=g) > 0.5,
        "t": torch.randn(40, 30, generator=g).t(),  # non-contiguous
        "small": [torch.randn(5, generator=g) for _ in range(20)],  # packed together
        "cfg": {"lr": 0.25, "history": [1, 2, 3]},
    }


def _mutate(state: dict) -> None:
    state["w"].mul_(-2).add_(1)
    state["half"].add_(1)
    state["ints"].add_(7)
    state["flags"].logical_not_()
    state["t"].add_(3)
    for s in state["small"]:
        s.zero_()
    state["cfg"]["lr"] = 9.0
    state["cfg"]["history"].append(4)


def _blank(state: dict) -> dict:
    return {
        "w": torch.zeros_like(state["w"]),
        "half": torch.zeros_like(state["half"]),
        "ints": torch.zeros_like(state["ints"]),
        "flags": torch.zeros_like(state["flags"]),
        "t": torch.zeros(30, 40),
        "small": [torch.zeros(5) for _ in range(20)],
        "cfg": {"lr": None, "history": None},
    }


def _equal(a: dict, b: dict) -> bool:
    tensors = ["w", "half", "ints", "flags", "t"]
    ok = all(torch.equal(a[k].contiguous(), b[k].contiguous()) for k in tensors)
    ok = ok and all(torch.equal(x, y) for x, y in zip(a["small"], b["small"], strict=True))
    return ok and a["cfg"] == b["cfg"]


def test_mutating_every_tensor_right_after_return_does_not_change_the_snapshot(tmp_path):
    saver = ts.AsyncSaver()
    state = _state()
    expected = []
    handles = []
    for step in range(3):
        expected.append(
            {
                **{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()},
                "small": [s.clone() for s in state["small"]],
                "cfg": {"lr": state["cfg"]["lr"], "history": list(state["cfg"]["history"])},
            }
        )
        handles.append(ts.async_save(state, tmp_path, step=step, saver=saver))
        _mutate(state)  # at once, while the background writes
    infos = [h.wait() for h in handles]
    saver.close()
    for info, want in zip(infos, expected, strict=True):
        got = _blank(want)
        ts.load(got, tmp_path, snapshot=info.id)
        assert _equal(got, want), info.id
    assert ts.verify(tmp_path).ok


def test_saves_in_flight_never_exceed_the_bound(tmp_path):
    faults.install("after_write=delay:0.05")  # slow writes: saves overlap
    saver = ts.AsyncSaver(max_in_flight=1)
    seen = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(saver.in_flight())

    watcher = threading.Thread(target=watch)
    watcher.start()
    state = {"w": torch.randn(64, 4096)}
    handles = [ts.async_save(state, tmp_path, step=s, saver=saver) for s in range(6)]
    saver.close()
    stop.set()
    watcher.join()
    assert max(seen) == 1 and saver.peak_in_flight == 1
    assert [h.wait().step for h in handles] == list(range(6))
    assert handles[-1].pause > 0  # the wait for the previous save is counted as pause
    assert [s.step for s in ts.list_snapshots(tmp_path)] == list(range(6))


def test_a_busy_saver_can_skip_instead_of_waiting(tmp_path, caplog):
    faults.install("after_write=delay:0.3")
    saver = ts.AsyncSaver(max_in_flight=1, skip_if_busy=True)
    state = {"w": torch.randn(8, 8)}
    first = ts.async_save(state, tmp_path, step=1, saver=saver)
    with pytest.raises(ts.TrainsnapError, match="step 2 was skipped"):
        ts.async_save(state, tmp_path, step=2, saver=saver)
    assert first.snapshot_id
    assert any("skipped" in r.getMessage() for r in caplog.records)
    saver.close()
    assert [s.step for s in ts.list_snapshots(tmp_path)] == [1]


def test_a_failing_background_write_surfaces_at_the_next_call_with_its_cause(tmp_path):
    saver = ts.AsyncSaver()
    state = {"w": torch.randn(16, 16)}
    faults.install("before_write=raise")
    failed = ts.async_save(state, tmp_path, step=1, saver=saver)
    assert failed is not None
    failed._done.wait(30)
    faults.clear()
    with pytest.raises(ts.CommitFailedError) as e:
        ts.async_save(state, tmp_path, step=2, saver=saver)
    assert isinstance(e.value.__cause__, InjectedFault)
    assert "injected fault at before_write" in str(e.value)
    # Raised once: the saver goes on working afterwards.
    ok = ts.async_save(state, tmp_path, step=3, saver=saver)
    saver.close()
    assert ok is not None and ok.wait().step == 3
    assert [s.step for s in ts.list_snapshots(tmp_path)] == [3]
    with pytest.raises(ts.CommitFailedError):
        failed.wait()  # the handle itself also says why


def test_close_raises_a_background_error(tmp_path):
    saver = ts.AsyncSaver()
    faults.install("before_marker=raise")
    ts.async_save({"w": torch.ones(3)}, tmp_path, step=1, saver=saver)
    with pytest.raises(ts.CommitFailedError):
        saver.close()
    assert ts.list_snapshots(tmp_path) == []


def test_exit_waits_for_the_save_in_flight(tmp_path):
    code = textwrap.dedent(
        f"""
        import torch, trainsnap as ts
        from trainsnap import faults
        faults.install("after_write=delay:0.5")
        ts.async_save({{"w": torch.ones(1000)}}, {str(tmp_path)!r}, step=4)
        print("returned", flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "returned" in out.stdout
    assert [s.step for s in ts.list_snapshots(tmp_path)] == [4]


def test_staging_budget_falls_back_to_a_synchronous_save(tmp_path, caplog):
    saver = ts.AsyncSaver(staging_budget=1024)
    h = ts.async_save({"w": torch.randn(1000)}, tmp_path, step=1, saver=saver)
    assert h is not None and h.wait().step == 1
    saver.close()
    assert saver.pool.allocated == 0
    assert any("saved synchronously" in r.getMessage() for r in caplog.records)


def test_buffers_are_reused_across_saves(tmp_path):
    saver = ts.AsyncSaver()
    state = {"w": torch.randn(1 << 16), "v": torch.randn(3, 1 << 12)}
    ts.async_save(state, tmp_path, step=1, saver=saver).wait()
    after_first = saver.pool.allocated
    for s in range(2, 5):
        ts.async_save(state, tmp_path, step=s, saver=saver).wait()
    saver.close()
    assert after_first == saver.pool.allocated == (1 << 16) * 4 + 3 * (1 << 12) * 4


# -- tracing ---------------------------------------------------------------------------------------


def _traced_async_save(rank: int, world: int, root: str, out: str) -> list[str]:
    trace.enable(rank)
    local = torch.full((256, 256), float(rank))
    state = {"w": ts.Sharded(local, global_shape=(256 * world, 256), offsets=(256 * rank, 0))}
    handle = ts.async_save(state, root, step=7, timeout=60)
    handle.wait()
    path = trace.export(f"{out}/trace.rank{rank}.json")
    return [e["name"] for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]


def test_a_two_rank_async_save_is_traced_in_chrome_format(tmp_path, caplog):
    root = str(tmp_path / "root")
    names = assert_all_ok(run_ranks(_traced_async_save, 2, args=(root, str(tmp_path)), timeout=120))
    for per_rank in names:
        assert per_rank == ["capture", "plan", "stage", "write", "commit"]
    events = []
    for rank in range(2):
        doc = json.loads((tmp_path / f"trace.rank{rank}.json").read_text())
        assert isinstance(doc["traceEvents"], list)
        events += doc["traceEvents"]
    for e in events:
        if e["ph"] == "X":
            assert {"name", "ts", "dur", "pid", "tid"} <= e.keys() and e["dur"] >= 0
    assert {e["pid"] for e in events} == {0, 1}
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    assert [s.step for s in ts.list_snapshots(root)] == [7]


def test_each_save_logs_one_summary_line_with_pause_and_drain(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trainsnap")
    ts.async_save({"w": torch.randn(1000)}, tmp_path, step=1).wait()
    lines = [r.getMessage() for r in caplog.records if r.name == "trainsnap.protocol.save_protocol"]
    assert len(lines) == 1
    for field in ("pause=", "drain=", "bytes=", "MBps="):
        assert field in lines[0]
