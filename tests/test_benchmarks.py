"""A smoke run of every benchmark at tiny sizes (``--smoke``), as its README command runs it
(``python -m benchmarks.<name>`` from the repository root): each must finish, measure every
method, verify what it loaded bit for bit, and print its ratios with their verdicts.

The sizes are far too small for the figures to mean anything: only their presence is checked,
never a verdict.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
VERDICT = re.compile(
    r"^(?P<label>\S.*?)\s+(?P<value>-?[\d.]+|-)\s+(?P<target>-|[<>]=? [\d.]+)\s+"
    r"(?P<result>met|MISSED|-)$"
)


def run_benchmark(name: str, tmp_path: Path, *extra: str) -> tuple[str, dict[str, Any]]:
    """Run ``python -m benchmarks.<name> --smoke``; its stdout and its JSON results."""
    results = tmp_path / f"{name}.json"
    command = [sys.executable, "-m", f"benchmarks.{name}", "--smoke", "--dir", str(tmp_path)]
    command += ["--json", str(results), *extra]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout, json.loads(results.read_text())


def verdict_rows(text: str) -> dict[str, tuple[float, str, str]]:
    """label -> (value, target, result) of every row of the report's verdict tables."""
    rows = {}
    for line in text.splitlines():
        match = VERDICT.match(line)
        if match and match["value"] != "-":
            rows[match["label"]] = (float(match["value"]), match["target"], match["result"])
    return rows


def assert_verdicts(text: str, labels: list[str]) -> None:
    """Each label has a row with a finite value; a row with a target has met or MISSED."""
    rows = verdict_rows(text)
    for label in labels:
        assert label in rows, f"no verdict row {label!r} in:\n{text[-3000:]}"
        value, target, result = rows[label]
        assert math.isfinite(value), label
        assert (result in ("met", "MISSED")) == (target != "-"), (label, target, result)


def assert_measured(results: dict[str, Any], methods: list[str], metrics: list[str]) -> None:
    """Every (method, metric) has a positive finite median."""
    for method in methods:
        for metric in metrics:
            median = results["medians"][method][metric]
            assert math.isfinite(median) and median > 0, (method, metric, median)


def test_save_load(tmp_path: Path) -> None:
    text, out = run_benchmark("save_load", tmp_path)
    reps = out["config"]["reps"]
    assert text.count("(save/load, verified)") == reps
    assert len(out["results"]["orders"]) == reps
    assert_measured(out["results"], ["trainsnap", "torch", "dcp", "raw"], ["save", "load"])
    loads = out["config"]["loads"]
    assert loads > 1  # the smoke size runs the rounds of loads
    for method in ("trainsnap", "torch", "dcp", "raw"):
        series = out["results"]["values"][method]
        assert len(series["save"]) == reps and len(series["load"]) == reps * loads, method
    labels = [f"{op}: trainsnap/{other}" for op in ("save", "load") for other in ("DCP", "raw")]
    assert_verdicts(text, [*labels, "save: trainsnap/torch.save", "load: trainsnap/torch.load"])
    assert out["eviction_probe"]["cold_read_s"] > 0


def test_async_pause(tmp_path: Path) -> None:
    text, out = run_benchmark("async_pause", tmp_path)
    for method in ("trainsnap", "dcp"):
        assert f"warm-up {method}: saved, changed while draining, loaded, verified" in text
    results = out["pause"]["results"]
    assert_measured(results, ["memcpy", "np.copyto", "trainsnap", "dcp"], ["pause"])
    assert_measured(results, ["trainsnap"], ["call", "drain", "capture", "stage"])
    assert_verdicts(
        text,
        [
            "trainsnap pause / memcpy limit",
            "trainsnap call / memcpy limit",
            "trainsnap pause / np.copyto",
            "dcp (default) pause / trainsnap pause",
        ],
    )
    cases = out["drain"]["cases"]
    assert cases and all(case["slowdown_median"] > 0 for case in cases.values())
    assert "draining, io_threads=" in text


def test_distributed(tmp_path: Path) -> None:
    text, out = run_benchmark("distributed", tmp_path)
    sharded, reshard = out["io"]["sharded"], out["io"]["reshard"]
    assert_measured(sharded["results"], ["trainsnap", "dcp"], ["save", "load"])
    assert_measured(sharded["results"], ["raw"], ["load"])
    assert_measured(reshard["results"], ["trainsnap", "dcp", "raw"], ["load"])
    if out["io"]["direct"]:  # the file system takes O_DIRECT: the second limit was measured
        assert_measured(reshard["results"], ["raw_direct"], ["load"])
        assert_verdicts(text, ["resharded load: trainsnap/raw reads past the page cache"])
    for part, world in ((sharded, 4), (reshard, 2)):
        assert len(part["per_rank"]) == world
        for rank in part["per_rank"]:
            assert rank["checked_bytes"]["trainsnap"] == rank["checked_bytes"]["dcp"] > 0
            assert rank["raw_bytes"] > 0
    assert_verdicts(
        text,
        [
            "sharded save: trainsnap/DCP",
            "sharded load: trainsnap/DCP",
            "sharded load: trainsnap/raw reads",
            "resharded load: trainsnap/DCP",
            "resharded load: DCP/raw reads",
            "16-rank plan_save (s)",
            "16-rank manifest decode (s)",
        ],
    )
    assert out["sim"]["bytes_written"] == out["sim"]["bytes_expected"]


def test_planner_sim(tmp_path: Path) -> None:
    text, out = run_benchmark("planner_sim", tmp_path)
    sim = out["sim"]
    assert sim["world"] == 16 and sim["bytes_written"] == sim["bytes_expected"] > 0
    assert sim["objects"] > 0 and sim["manifest_bytes"] > 0
    assert_verdicts(text, ["16-rank plan_save (s)", "16-rank manifest decode (s)"])
    labels = [check["label"] for check in out["checks"]]
    assert labels[2].startswith("writer balance") and "16-rank cached plan (s)" in labels
    assert sim["cached_send_bytes_max"] < 1024 < sim["full_send_bytes_median"]


def test_scale(tmp_path: Path) -> None:
    """16 logical ranks over one TCPStore: two saves (the second from the cached plan) and a
    load through the real protocols, every figure reported."""
    text, out = run_benchmark("scale", tmp_path)
    (summary,) = out["summaries"]
    assert summary["world"] == 16 and summary["manifest_size"] > 0
    for phase in ("first save", "cached save", "load"):
        assert summary[phase]["errors"] == 0, summary[phase]["first_error"]
    cached = summary["cached save"]
    assert 0 < cached["meta_sent_rank_max"] < summary["first save"]["meta_sent_rank_max"]
    assert summary["load"]["manifest_read_bytes"] > 0
    assert_verdicts(
        text,
        [
            "16-rank cached save: bytes sent per rank (max)",
            "16-rank cached save: coordinator ingest (MiB)",
            "16-rank load: manifest bytes read / manifest size",
        ],
    )


def test_replica_reads(tmp_path: Path) -> None:
    """4 ranks, both layouts, on both stores: every load checked bit for bit; sharing pulls each
    stored byte about once, trainsnap reading alone and DCP every replica's bytes."""
    text, out = run_benchmark("replica_reads", tmp_path)
    for store, sharing, alone in (
        ("file", "trainsnap-shared", "trainsnap"),
        ("s3", "trainsnap", "trainsnap-alone"),
    ):
        for layout, replicas in (("ddp", 4), ("mesh", 2)):
            methods = out["layouts"][f"{store}/{layout}"]
            assert methods[sharing]["read_ratio"] <= 1.3
            assert methods[alone]["read_ratio"] >= 0.9 * replicas
            assert methods["dcp"]["read_ratio"] >= 0.9 * replicas
            assert all(m["stored"] > 0 and m["seconds"] > 0 for m in methods.values())
    assert_verdicts(
        text,
        [
            "file ddp: trainsnap-shared bytes pulled / stored",
            "file mesh: trainsnap-shared bytes pulled / stored",
            "s3 ddp: trainsnap bytes pulled / stored",
            "s3 mesh: trainsnap bytes pulled / stored",
            "s3 ddp: load time, sharing / each rank reading alone",
            "s3 mesh: load time, sharing / each rank reading alone",
        ],
    )


def _assert_compression(out: dict[str, Any]) -> None:
    results = out["results"]
    assert len(results) == 12  # 4 kinds x 3 codecs
    assert all(r["bitwise_equal"] and r["save_MBps"] > 0 and r["load_MBps"] > 0 for r in results)
    assert all(r["ratio"] < 1 for r in results if r["codec"] == "bytegroup+zstd")


def test_incremental(tmp_path: Path) -> None:
    text, out = run_benchmark("incremental", tmp_path, "--part", "incremental")
    scenarios = {result["label"]: result for result in out["incremental"]}
    assert len(scenarios) == 5
    for result in scenarios.values():
        assert result["log_agrees"], result["label"]
        assert len(result["snapshots"]) == out["config"]["snapshots"]
        assert result["snapshots"][1]["chunk_changed_bytes"] > 0
    sparse = scenarios["sparse-sgd chunk=1MiB"]["snapshots"][1]
    assert sparse["written"] < sparse["referenced"]
    assert_verdicts(text, ["lora chunk=32MiB: largest written/referenced after the first"])
    assert "compression" not in out  # part 2 is benchmarks.compression: test_compression


def test_compression(tmp_path: Path) -> None:
    text, out = run_benchmark("compression", tmp_path)
    assert text.count("(bitwise equal)") == 12
    _assert_compression(out["compression"])
    assert_verdicts(text, ["fp32 weights bytegroup+zstd: stored/raw"])


def test_memory_tier(tmp_path: Path) -> None:
    text, out = run_benchmark("memory_tier", tmp_path)
    forms = {form["name"]: form for form in out["forms"]}
    assert set(forms) == {"2 nodes", "1 process"}
    for name, form in forms.items():
        for figure in ("copy_s", "step_none_s", "step_memory_s", "restore_memory_s"):
            assert math.isfinite(form[figure]) and form[figure] > 0, (name, figure)
        assert form["restore_durable_s"] > 0
        steps = out["config"]["steps"] * out["config"]["reps"]
        assert all(saved == steps + 1 for saved in form["saved"]), form["saved"]  # + warm-up
        assert all(skipped == 0 for skipped in form["skipped"])
        for sources in form["sources"]:  # the memory restore read the node's own memory only
            assert sources["memory"]["memory (this node)"] > 0, sources
            assert sources["memory"]["memory (partner node)"] == 0, sources
    assert_verdicts(
        text,
        [
            f"{name}: {figure}"
            for name in forms
            for figure in (
                "extra step time / one memory copy",
                f"extra step time, % of a step {out['config']['factor']:g}x the copy",
                "restore durable (disk, cold) / memory",
            )
        ],
    )


def test_no_sys_path() -> None:
    """The benchmarks are a package run with ``-m``: none of them edits ``sys.path``."""
    sources = sorted((REPO / "benchmarks").rglob("*.py"))
    assert len(sources) > 10
    assert [p.name for p in sources if "sys.path" in p.read_text()] == []


def test_gpu_check_cpu_dry_run(tmp_path: Path) -> None:
    text, out = run_benchmark("gpu_check", tmp_path)  # --smoke is the CPU dry run
    assert out["dry_run"] and out["device"] == "cpu"
    assert out["resume"]["losses_equal"] and out["resume"]["level"] == "strict"
    assert out["collective"] == {"backend": "gloo", "world": 2, "bitwise": True}
    assert "== GPU check (CPU dry run)" in text and out["pause"]["pause_s"] > 0
    memory = out["memory"]
    assert memory["restored_bitwise"] and memory["copy_s"] > 0
    assert len(memory["medians"]["none"]) == len(memory["medians"]["memory"]) == 1
    assert_verdicts(
        text,
        [
            "memory snapshot: extra step / one copy",
            "memory snapshot: extra step / one copy, % of the step",
            "memory tier restore bitwise",
        ],
    )


@pytest.mark.s3
def test_object_store(tmp_path: Path) -> None:
    """trainsnap, DCP (fsspec) and parallel PUT/GET on a SeaweedFS S3 server, each verified."""
    from trainsnap.testing.seaweedfs import ServerUnavailable, weed_binary

    try:
        weed_binary()
    except ServerUnavailable as e:
        pytest.skip(f"SeaweedFS S3 server unavailable: {e}")
    text, out = run_benchmark("object_store", tmp_path)
    assert text.count("(save/load, verified)") == out["config"]["reps"]
    assert_measured(out["results"], ["trainsnap", "dcp", "raw"], ["save", "load"])
    labels = [f"{op}: trainsnap/{other}" for op in ("save", "load") for other in ("DCP", "raw")]
    assert_verdicts(text, labels)


def test_manager_step(tmp_path: Path) -> None:
    text, out = run_benchmark("manager_step", tmp_path)
    assert (out["idle_steps"], out["saving_steps"]) == (4, 4)  # a local save every 2 steps
    assert out["idle_step_s"] > 0 and out["pause_s"] > 0 and out["memcpy_s"] > 0
    assert "manager step: state=4 MiB" in text


def test_compare_alternates_and_reports_every_number(tmp_path: Path) -> None:
    results = tmp_path / "compare.json"
    command = [sys.executable, "-m", "benchmarks.compare", "WORKTREE", "WORKTREE"]
    command += ["--rounds", "2", "--json", str(results), "--", "manager_step", "--smoke"]
    command += ["--dir", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rounds = re.findall(r"^round (\d)/2: (old|new)", done.stdout, re.MULTILINE)
    assert rounds == [("1", "old"), ("1", "new"), ("2", "new"), ("2", "old")]
    numbers = json.loads(results.read_text())["numbers"]
    assert numbers["saving_steps"] == {"old": 4.0, "new": 4.0, "new_over_old": 1.0}
    assert numbers["pause_s"]["new"] > 0


def test_mlperf_checkpointing(tmp_path: Path) -> None:
    text, out = run_benchmark("mlperf_checkpointing", tmp_path)  # 2 ranks, ZeRO-3
    assert_measured(out["results"], ["raw", "dcp", "trainsnap"], ["save", "load"])
    assert_measured(out["results"], ["trainsnap"], ["save.write", "load.read"])
    assert out["checked"] == ["dcp", "raw", "trainsnap"]
    assert len(out["local_bytes"]) == 2 and sum(out["local_bytes"]) == out["config"]["bytes"]
    labels = [f"trainsnap / {other} {op}" for other in ("raw", "dcp") for op in ("write", "read")]
    assert_verdicts(text, labels)
