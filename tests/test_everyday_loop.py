"""The everyday loop resumes bitwise after a SIGKILL, or its loader is refused up front.

An MLP with dropout, AdamW, a cosine schedule and a shuffled dataset, trained through
``ts.CheckpointManager(async_save=True)`` (tests/everyday_loop.py), is SIGKILLed from outside
after a save and restarted in a fresh process: every loss after the restore and the sample ids
of every batch equal the uninterrupted run's, bit for bit -- with a torchdata
``StatefulDataLoader(shuffle=True)`` and with a ``DataLoader`` over a ``ts.ElasticSampler``, with
0 and 2 workers, in a step-based loop that re-creates its iterator at each epoch's end and in a
``for epoch: for batch in loader`` loop. A plain ``DataLoader(shuffle=True)`` is refused when
the ``TrainState`` is built, naming the resumable alternatives.

One crashed process and one resumed process run all eight cases (a process start costs more
than the training); the uninterrupted references run here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import trainsnap as ts

sys.path.insert(0, str(Path(__file__).parent))
import everyday_loop as ev

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _child(mode: str, directory: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "everyday_loop.py"), mode, str(directory)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture(scope="module")
def crashed_and_resumed(tmp_path_factory):
    """Every case trained past a save in one process, SIGKILLed from outside, then resumed in
    a fresh process: {case: (resumed rows, (level, reasons) of the restore)}."""
    directory = tmp_path_factory.mktemp("everyday")
    ready = directory / ev.case_name(*ev.CASES[-1]) / "crash.jsonl.ready"
    crashed = _child("crash", directory)
    deadline = time.monotonic() + 240
    while not ready.exists():
        if crashed.poll() is not None or time.monotonic() > deadline:
            crashed.kill()
            pytest.fail(f"the crashing run ended early:\n{crashed.communicate()[0][-3000:]}")
        time.sleep(0.05)
    crashed.send_signal(signal.SIGKILL)
    crashed.wait()
    assert crashed.returncode == -signal.SIGKILL
    resumed = _child("resume", directory)
    output, _ = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, output[-3000:]
    out = {}
    for case in ev.CASES:
        d = directory / ev.case_name(*case)
        rows = [json.loads(line) for line in (d / "resume.jsonl").read_text().splitlines()]
        out[case] = (rows, json.loads((d / "resume.jsonl.restored").read_text()))
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The uninterrupted run of each loader kind and number of workers (torchdata draws a
    shuffled epoch's order differently with workers). Its trajectory does not depend on the
    loop's shape: both shapes are compared with the step-based one."""
    d = tmp_path_factory.mktemp("reference")
    return {
        (kind, workers): [
            list(r) for r in ev.run(kind, workers, "steps", str(d / f"{kind}{workers}"), ev.TOTAL)
        ]
        for kind, workers, shape in ev.CASES
        if shape == "steps"
    }


@pytest.mark.parametrize("case", ev.CASES, ids=[ev.case_name(*c) for c in ev.CASES])
def test_the_everyday_loop_resumes_bitwise_after_sigkill(case, crashed_and_resumed, references):
    rows, (level, reasons) = crashed_and_resumed[case]
    assert (level, reasons) == ("strict", [])
    want = references[case[:2]][ev.SAVED + 1 :]
    assert [r[0] for r in rows] == list(range(ev.SAVED + 1, ev.TOTAL))
    # The sample ids of every batch and every loss, bitwise (losses as float.hex()).
    diverged = [(got, ref) for got, ref in zip(rows, want, strict=True) if got != ref]
    assert not diverged, f"first differing step: {diverged[0]}"
    # The run crosses an epoch boundary after the restore: the next epoch's order is kept.
    assert ev.TOTAL > ev.PER_EPOCH > ev.SAVED


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_plain_dataloader_is_refused_when_the_train_state_is_built(shuffle):
    loader = torch.utils.data.DataLoader(ev.Samples(), batch_size=ev.BATCH, shuffle=shuffle)
    model = torch.nn.Linear(ev.DIM, 1)
    sampler = "RandomSampler" if shuffle else "SequentialSampler"
    with pytest.raises(ts.InvalidArgumentError, match=sampler) as raised:
        ts.TrainState(model, torch.optim.AdamW(model.parameters()), dataloader=loader)
    assert "StatefulDataLoader" in str(raised.value)
    assert "ts.ElasticSampler" in str(raised.value)


RANKS_TOTAL, RANKS_SAVED = 18, 8


@pytest.fixture(scope="module")
def ranks_runs(tmp_path_factory):
    """The loop on 2 gloo ranks: uninterrupted; stopped after the save of step 8; resumed from
    that root on 2 ranks and on 1."""
    from trainsnap.testing import assert_all_ok, run_ranks

    d = tmp_path_factory.mktemp("ranks")

    def on(world, root, stop):
        return assert_all_ok(
            run_ranks(
                ev.ranks_run,
                world,
                args=(str(root), RANKS_TOTAL, stop),
                timeout=300,
                init_pg=world > 1,
            )
        )[0]

    ref = on(2, d / "ref", None)
    first = on(2, d / "run", RANKS_SAVED)
    assert first == ref[: RANKS_SAVED + 1]
    shutil.copytree(d / "run", d / "run1")
    return ref, {2: on(2, d / "run", None), 1: on(1, d / "run1", None)}


def test_two_ranks_resumed_on_two_ranks_bitwise(ranks_runs):
    ref, resumed = ranks_runs
    assert resumed[2] == ref[RANKS_SAVED + 1 :]


def test_two_ranks_resumed_on_one_rank_same_samples_losses_within_noise(ranks_runs):
    """Same global samples in the same order. Losses: the one rank sums the global batch's
    gradient in another order than DDP's all-reduce of two halves (one rounding of float32,
    ~6e-8 relative, per step), and AdamW carries it on; over the 9 steps after the restore
    that stays below 1e-5 relative, where any wrong sample, mask or moment moves the loss by
    percents."""
    ref, resumed = ranks_runs
    want = ref[RANKS_SAVED + 1 :]
    assert [r[:2] for r in resumed[1]] == [r[:2] for r in want]
    worst = max(
        abs(float.fromhex(got[2]) - float.fromhex(exp[2])) / abs(float.fromhex(exp[2]))
        for got, exp in zip(resumed[1], want, strict=True)
    )
    assert worst < 1e-5, worst
