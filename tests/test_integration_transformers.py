"""``transformers.Trainer`` through ``TrainsnapTrainer``: real processes run the Trainer's own
loop on a tiny GPT-2 (dropout, shuffled data, gradient accumulation 2), are SIGKILLed in the
middle of an epoch or of a save, and ``train(resume_from_checkpoint=True)`` continues: the same
samples in the same order and the same losses, bit for bit, as the uninterrupted run. Runs are in
``tests/transformers_worker.py``; each takes some seconds (a spawned process imports
transformers), so the default run keeps to one killed-and-resumed pair per sampler."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import transformers_worker as worker
from trainsnap.integrations import _transformers_data as data_position
from trainsnap.testing import assert_all_ok, run_ranks

KILL_AT = 4
"""Killed after optimizer step 4 (saves every 2 steps): on 2 processes, 3 steps an epoch, the
newest snapshot is in the middle of the second epoch."""
TIMEOUT = 240


def _run(world: int, out: Path, **kwargs: Any) -> list[Any]:
    return run_ranks(
        worker.train, world, args=(str(out),), kwargs=kwargs, timeout=TIMEOUT, init_pg=True
    )


def _ok(world: int, out: Path, **kwargs: Any) -> list[dict[str, Any]]:
    return assert_all_ok(_run(world, out, **kwargs))


def _killed(world: int, out: Path, **kwargs: Any) -> None:
    results = _run(world, out, **kwargs)
    assert all(r.killed and r.error is None for r in results), [r.describe() for r in results]


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _assert_continues(reference: dict[str, Any], resumed: dict[str, Any], step: int) -> None:
    """``resumed`` (from the snapshot of ``step``) is ``reference`` from that step on."""
    samples = step * 2 * 2  # per process: 2 micro-batches of 2 per step
    assert resumed["seen"] == reference["seen"][samples:]
    assert resumed["losses"] == reference["losses"][step * 2 :]
    assert resumed["logged"] == reference["logged"]  # the restored log history, then the rest
    assert _same_weights(resumed["weights"], reference["weights"])


@pytest.mark.parametrize(
    "seedable",
    [pytest.param(True, marks=pytest.mark.slow), False],
    ids=["seedable-sampler", "own-generator"],
)
def test_a_sigkilled_two_process_trainer_resumes_bit_for_bit(tmp_path: Path, seedable: bool):
    reference = _ok(2, tmp_path / "reference", seedable=seedable)
    _killed(2, tmp_path / "run", seedable=seedable, kill_at=KILL_AT)
    resumed = _ok(2, tmp_path / "run", seedable=seedable, resume=True)
    for rank in range(2):
        assert resumed[rank]["restored"] == (KILL_AT, "strict")
        _assert_continues(reference[rank], resumed[rank], KILL_AT)


@pytest.mark.slow
def test_the_stock_trainer_killed_in_the_middle_of_a_save_resumes_from_the_half_written_one(
    tmp_path: Path,
):
    """What the snapshot fixes: killed after writing the model and optimizer of checkpoint-4,
    the stock Trainer's next resume picks that directory (and fails)."""
    stock = tmp_path / "stock"
    _killed(1, stock, kind="stock", kill_at=KILL_AT, kill_in_save="stock")
    assert not (stock / "checkpoint-4" / "trainer_state.json").exists()
    assert (stock / "checkpoint-4" / "optimizer.pt").exists()
    failed = _run(1, stock, kind="stock", resume=True)
    assert failed[0].error is not None and "checkpoint-4/trainer_state.json" in failed[0].error


def test_a_kill_in_the_middle_of_a_save_resumes_from_the_previous_snapshot(tmp_path: Path):
    """Killed before the marker of the step-4 snapshot, the run resumes from step 2, bit for
    bit the uninterrupted one."""
    reference = _ok(1, tmp_path / "reference")
    run = tmp_path / "run"
    crash = {"TRAINSNAP_FAULTS": "before_marker=crash#2"}  # the second save: step 4
    results = run_ranks(
        worker.train,
        1,
        args=(str(run),),
        kwargs={"kill_at": KILL_AT, "kill_in_save": "trainsnap"},
        timeout=TIMEOUT,
        init_pg=True,
        env=crash,
    )
    assert results[0].killed, results[0].describe()
    resumed = _ok(1, run, resume=True)[0]
    assert resumed["restored"] == (2, "strict")
    _assert_continues(reference[0], resumed, 2)


@pytest.mark.slow
def test_a_sigkilled_one_process_trainer_without_the_seedable_sampler_resumes_bit_for_bit(
    tmp_path: Path,
):
    """On one process accelerate gives the sampler no generator: each epoch's order comes from
    torch's global generator, whose state at the epoch's start the cursor keeps."""
    reference = _ok(1, tmp_path / "reference", seedable=False)[0]
    _killed(1, tmp_path / "run", seedable=False, kill_at=KILL_AT)
    resumed = _ok(1, tmp_path / "run", seedable=False, resume=True)[0]
    assert resumed["restored"] == (KILL_AT, "strict")
    _assert_continues(reference, resumed, KILL_AT)


def _global_order(per_rank: list[list[int]], batch: int) -> list[int]:
    """The samples of every micro-step over all processes, in order: each process's batch of
    that micro-step, process by process (accelerate gives process r every r-th batch)."""
    batches = [[seen[i : i + batch] for i in range(0, len(seen), batch)] for seen in per_rank]
    return [s for step in zip(*batches, strict=True) for b in step for s in b]


@pytest.mark.slow
def test_a_snapshot_of_two_processes_resumes_on_one_with_the_same_global_samples(
    tmp_path: Path,
):
    reference = _ok(2, tmp_path / "reference")
    _killed(2, tmp_path / "run", kill_at=KILL_AT)
    resumed = _ok(1, tmp_path / "run", resume=True, per_device=4)[0]  # the same global batch
    # The Trainer seeds every process alike and they draw alike, so their RNG states were
    # identical, stored once, and restore here too: strict, said because it is true.
    assert resumed["restored"] == (KILL_AT, "strict")
    order = _global_order([r["seen"] for r in reference], 2)
    assert resumed["seen"] == order[KILL_AT * 8 :]


@pytest.mark.slow
def test_the_stock_trainer_with_its_own_generator_resumes_another_order(tmp_path: Path):
    """What the snapshot fixes: with ``use_seedable_sampler=False`` the stock checkpoint
    keeps no state of the sampler's generator, and the resumed epoch has another order."""
    reference = _ok(2, tmp_path / "reference", kind="stock", seedable=False)
    _killed(2, tmp_path / "run", kind="stock", seedable=False, kill_at=KILL_AT)
    resumed = _ok(2, tmp_path / "run", kind="stock", seedable=False, resume=True)
    assert resumed[0]["seen"] != reference[0]["seen"][KILL_AT * 4 :]


# -- the data position, without processes ----------------------------------------------------


def _samplers() -> list[Any]:
    from accelerate.data_loader import SeedableRandomSampler

    data = list(range(11))
    seedable = SeedableRandomSampler(data, generator=torch.Generator(), data_seed=5)
    seedable.set_epoch(3)
    return [
        torch.utils.data.RandomSampler(data, generator=torch.Generator().manual_seed(1)),
        torch.utils.data.RandomSampler(data),
        torch.utils.data.SequentialSampler(data),
        seedable,
    ]


@pytest.mark.parametrize("index", range(4), ids=["generator", "global", "sequential", "seedable"])
@pytest.mark.parametrize("offset", [0, 4, 11])
def test_the_order_from_an_offset_is_the_samplers_own_and_leaves_its_generator_alike(
    index: int, offset: int
):
    torch.manual_seed(3)
    sampler = _samplers()[index]
    recorder = data_position.OrderRecorder(sampler)
    gen = data_position._order_generator(sampler)
    before = torch.get_rng_state() if gen is None else gen.get_state()
    whole = list(recorder)
    after = torch.get_rng_state() if gen is None else gen.get_state()
    if hasattr(sampler, "epoch"):
        sampler.set_epoch(3)
    recorder.seek(offset, before)
    assert list(recorder) == whole[offset:]
    now = torch.get_rng_state() if gen is None else gen.get_state()
    assert torch.equal(now, after)


def test_the_trainers_outputs_keep_working(tmp_path: Path):
    got = assert_all_ok(run_ranks(worker.outputs, 1, args=(str(tmp_path),), timeout=TIMEOUT))[0]
    assert got["best_is_dir"] and "/trainsnap/snapshots/step-" in got["best"]
    assert got["loaded_best"]  # load_best_model_at_end: the best snapshot's weights
    assert got["best_step"] in got["kept"] and len(got["kept"]) <= 2  # save_total_limit=1
    assert got["saved_model"] and got["exported"]
    assert "no committed snapshot" in got["refusals"]["True"]
    assert "stock Trainer" in next(v for k, v in got["refusals"].items() if k != "True")


def test_a_checkpoint_not_held_is_refused_in_the_trainers_own_words(tmp_path: Path):
    """Scripts and the Trainer's own tests match its messages ("No valid checkpoint found in
    output directory", "Can't find a valid checkpoint at"): the refusals carry them, before any
    training starts (in process: nothing is trained)."""
    from transformers import TrainingArguments

    import trainsnap as ts
    from trainsnap.integrations.transformers import TrainsnapTrainer

    args = TrainingArguments(str(tmp_path), report_to=[], use_cpu=True)
    trainer = TrainsnapTrainer(model=torch.nn.Linear(1, 1), args=args, train_dataset=[])
    with pytest.raises(ts.NotFoundError, match="No valid checkpoint found in output directory"):
        trainer.train(resume_from_checkpoint=True)
    bogus = str(tmp_path / "checkpoint-5-bogus")
    with pytest.raises(ts.NotFoundError, match="Can't find a valid checkpoint at") as refused:
        trainer.train(resume_from_checkpoint=bogus)
    assert "no committed snapshot" in str(refused.value)


class _Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(x * self.a, labels)}


def test_auto_find_batch_size_resumes_with_the_batch_size_found(tmp_path: Path):
    """With ``auto_find_batch_size`` the Trainer resumes at the batch size the run found (from
    ``trainer_state.json``), not the one it was asked for: the snapshot's ``TrainerState`` gives
    it. In process: two optimizer steps of a one-parameter model."""
    from transformers import TrainerCallback, TrainingArguments

    from trainsnap.integrations.transformers import TrainsnapTrainer

    class OutOfMemoryAt16(TrainerCallback):  # what find_executable_batch_size reduces on
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.train_batch_size >= 16:
                raise RuntimeError("CUDA out of memory.")

    data = [{"x": torch.tensor(float(i)), "labels": torch.tensor(2.0 * i)} for i in range(64)]
    args = TrainingArguments(
        str(tmp_path), max_steps=2, save_steps=1, per_device_train_batch_size=16,
        auto_find_batch_size=True, report_to=[], use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    first = TrainsnapTrainer(
        model=_Regression(), args=args, train_dataset=data, callbacks=[OutOfMemoryAt16()]
    )
    first.train()
    found = first._train_batch_size
    assert found < 16
    resumed = TrainsnapTrainer(model=_Regression(), args=args, train_dataset=data)
    resumed.train(resume_from_checkpoint=True)
    assert resumed._train_batch_size == found
