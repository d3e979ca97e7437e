"""trainsnap.testing.check_resume finds a planted drift and passes exact loops; a TrainState
without a data cursor says `training` and why; a save changes nothing it reads."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import trainsnap as ts
from trainsnap.testing import check_resume

sys.path.insert(0, str(Path(__file__).parent))
import everyday_loop as ev

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class LoopRun:
    """One run of the everyday loop, one step at a time (the step-based shape)."""

    def __init__(self, kind: str, workers: int = 0) -> None:
        self.objs = ev.make_state(kind, workers, total=20)
        self.state = self.objs["state"]
        self.it = None

    def step(self, i: int) -> str:
        if self.it is None:
            self.it = iter(self.objs["loader"])
        try:
            batch = next(self.it)
        except StopIteration:
            self.it = iter(self.objs["loader"])
            batch = next(self.it)
        return ev.train_step(self.objs, batch)[1]


@pytest.mark.parametrize("kind", ["stateful", "elastic"])
def test_the_everyday_loop_passes_the_check(kind):
    report = check_resume(lambda: LoopRun(kind), LoopRun.step, steps=18, restore_after=9)
    report.assert_exact()
    assert report.equal and report.level == "strict"


class NoisyRun(LoopRun):
    """Adds noise from a generator the loop owns and no state part saves: planted drift."""

    def __init__(self) -> None:
        super().__init__("stateful")
        self.noise = np.random.default_rng(0)

    def step(self, i: int) -> str:
        with torch.no_grad():
            p = next(self.objs["model"].parameters())
            p.add_(float(self.noise.standard_normal()) * 1e-3)
        return super().step(i)


def test_the_check_names_the_first_step_of_a_planted_drift():
    report = check_resume(NoisyRun, NoisyRun.step, steps=12, restore_after=5)
    assert not report.equal
    assert report.step == 6 and report.where == "loss"
    assert "step 6" in str(report) and "loss" in str(report)
    with pytest.raises(AssertionError, match="first at step 6"):
        report.assert_exact()


def test_the_check_names_the_tensor_when_losses_agree():
    """State outside the TrainState that the loss does not see yet: the parameter names it."""

    class Run(LoopRun):
        def __init__(self) -> None:
            super().__init__("elastic")
            self.count = 0

        def step(self, i: int) -> str:
            loss = super().step(i)
            self.count += 1
            with torch.no_grad():
                self.objs["model"][3].bias.fill_(float(self.count))
            return loss

    report = check_resume(Run, Run.step, steps=8, restore_after=3)
    assert (report.step, report.where) == (4, "model.3.bias")


# -- levels ---------------------------------------------------------------------------------


def _model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def test_a_train_state_without_a_data_cursor_says_training_and_why(tmp_path, caplog):
    model, opt = _model_and_opt()
    ts.save(ts.TrainState(model, opt), tmp_path, step=1)
    assert ts.list_snapshots(tmp_path)[0].level == "training"
    with caplog.at_level(logging.INFO, logger="trainsnap"):
        info = ts.load(ts.TrainState(*_model_and_opt()), tmp_path)
    assert info.level == "training"
    assert any("no data cursor" in why and "no_data_order=True" in why for why in info.reasons)
    line = next(r.getMessage() for r in caplog.records if "loaded snapshot" in r.getMessage())
    assert "level=training" in line and "no data cursor" in line
    # The manager restores it too (it is the best this state can reach), saying the same.
    mgr = ts.CheckpointManager(tmp_path, interval=ts.Every(steps=1))
    try:
        assert mgr.restore(ts.TrainState(*_model_and_opt())).level == "training"
    finally:
        mgr.close()


def test_no_data_order_declares_strict(tmp_path):
    model, opt = _model_and_opt()
    ts.save(ts.TrainState(model, opt, no_data_order=True), tmp_path, step=1)
    assert ts.list_snapshots(tmp_path)[0].level == "strict"
    info = ts.load(ts.TrainState(*_model_and_opt(), no_data_order=True), tmp_path)
    assert (info.level, info.reasons) == ("strict", ())
    with pytest.raises(ts.InvalidArgumentError, match="no_data_order"):
        ts.TrainState(
            model,
            opt,
            dataloader=ts.ElasticSampler(8, global_batch_size=2, rank=0, world_size=1),
            no_data_order=True,
        )


def test_a_train_state_with_a_data_cursor_says_strict(tmp_path):
    sampler = ts.ElasticSampler(16, global_batch_size=4, rank=0, world_size=1)
    ts.save(ts.TrainState(*_model_and_opt(), dataloader=sampler), tmp_path, step=1)
    sampler2 = ts.ElasticSampler(16, global_batch_size=4, rank=0, world_size=1)
    assert ts.load(ts.TrainState(*_model_and_opt(), dataloader=sampler2), tmp_path).level == (
        "strict"
    )


# -- a save changes nothing ------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.01),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    ],
    ids=["adamw", "sgd-momentum"],
)
def test_saving_a_fresh_optimizer_then_training_equals_training(tmp_path, make_opt):
    finals = []
    for save_first in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1)
        )
        opt = make_opt(model.parameters())
        if save_first:
            ts.save(ts.TrainState(model, opt, no_data_order=True), tmp_path, step=0)
            assert not opt.state and all(p.grad is None for p in model.parameters())
        for _ in range(3):
            model(torch.randn(5, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        finals.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*finals, strict=True))


@pytest.mark.parametrize("kind", ["stateful", "elastic"])
def test_a_save_leaves_the_rng_and_the_data_cursor_as_they_were(tmp_path, kind):
    """Saved before the first batch and in the middle of an epoch: the batches and every RNG
    stream after the save are the ones without it."""

    def draws(save_at: set[int]) -> list:
        run = LoopRun(kind, workers=0)
        out = []
        for i in range(6):
            if i in save_at:
                ts.save(run.state, tmp_path / f"{len(save_at)}-{i}", step=i)
            out.append(
                (
                    run.step(i),
                    torch.rand(2).tolist(),
                    np.random.rand(),
                    __import__("random").random(),
                )
            )
        return out

    assert draws(set()) == draws({0, 3})


# -- a real crash, NaN, the likely cause, bad arguments ----------------------------------------


def _stateful_run() -> LoopRun:
    return LoopRun("stateful")


def test_a_real_crash_in_a_fresh_process_resumes_exactly_and_finds_a_planted_drift():
    """Why: the check simulated the crash in its own process only, where a global or a cache of
    the first run could hide a resume that a real restart breaks."""
    report = check_resume(_stateful_run, LoopRun.step, steps=10, restore_after=4, crash="process")
    report.assert_exact()
    drift = check_resume(NoisyRun, NoisyRun.step, steps=10, restore_after=4, crash="process")
    assert (drift.equal, drift.step, drift.where) == (False, 5, "loss")


class NanRun:
    """A loop whose loss is NaN at every step, bitwise the same in every run."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.ones(3))
        self.state = ts.TrainState(
            model=torch.nn.ParameterDict({"w": self.w}),
            extra={"nan": float("nan")},
            no_data_order=True,
        )

    def step(self, i: int) -> torch.Tensor:
        with torch.no_grad():
            self.w.add_(1.0)
        return torch.tensor(float("nan")) * self.w.sum()


def test_nan_losses_of_bitwise_equal_runs_are_equal():
    """Why: the check reported a drift for NaN losses (and NaN values) in runs that are bitwise
    equal (NaN != NaN)."""
    report = check_resume(NanRun, NanRun.step, steps=6, restore_after=2)
    report.assert_exact()


def test_the_report_names_the_likely_cause():
    """Why: the report named where the runs part, not why; a user had to guess."""
    noisy = check_resume(NoisyRun, NoisyRun.step, steps=8, restore_after=3)
    assert "RNG the state does not hold" in noisy.cause and "likely cause" in str(noisy)
    from trainsnap.testing.resume_check import likely_cause

    assert "data order" in likely_cause("data.consumed")
    assert "loop-owned counter" in likely_cause("scheduler.last_epoch")
    assert "RNG stream" in likely_cause("rng.torch")


@pytest.mark.parametrize(
    "arguments",
    [
        {"steps": 5, "restore_after": 4},
        {"steps": 5, "restore_after": -1},
        {"steps": 5, "restore_after": 1.5},
        {"steps": 5, "restore_after": 1, "level": "exact"},
        {"steps": 5, "restore_after": 1, "crash": "thread"},
    ],
)
def test_bad_arguments_are_invalid_argument_errors(arguments):
    """Why: a bad ``restore_after`` raised a plain ``ValueError``."""
    with pytest.raises(ts.InvalidArgumentError, match="check_resume"):
        check_resume(_stateful_run, LoopRun.step, **arguments)
