"""accelerate through the helper: 2 real processes run accelerate's own ``prepare`` /
``accumulate`` / ``backward`` loop, save through ``train_state`` and the manager every 3
optimizer steps, are killed, and a fresh pair restores and trains on: bitwise the
uninterrupted run. And what the helper refuses, each refusal naming its fix."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import trainsnap as ts
from trainsnap.testing import assert_all_ok, run_ranks

pytest.importorskip("accelerate")
pytest.importorskip("torchdata")

STEPS = 12  # optimizer steps: 3 epochs of 4 (8 batches of 2 per process, 2 per step)
KILL_AFTER = 7  # the newest snapshot is then step 6, in the middle of epoch 1


class Seen:
    """A custom object registered with ``accelerator.register_for_checkpointing``."""

    def __init__(self) -> None:
        self.samples = 0

    def state_dict(self) -> dict[str, int]:
        return {"samples": self.samples}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.samples = state_dict["samples"]


def _prepared(accelerator: Any) -> tuple[Any, Any, Any, Any, Seen]:
    """The tiny run's model, optimizer, scheduler and data, prepared; and a registered object."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    seen = Seen()
    accelerator.register_for_checkpointing(seen)
    return model, opt, sched, loader, seen


def _config() -> Any:
    from accelerate.utils import DataLoaderConfiguration

    return DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True)


def _train(
    rank: int, world: int, root: str | None, kill_after: int | None, restore_step: int | None
) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from trainsnap.integrations.accelerate import train_state

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, dataloader_config=_config())
    resumed = root is not None and kill_after is None
    set_seed(1 if resumed else 0)  # so a resumed run's state all comes from the snapshot
    model, opt, sched, loader, seen = _prepared(accelerator)
    state = train_state(accelerator, extra={"tokens_seen": 0})
    manager = None
    step = 0
    if root is not None:
        manager = ts.CheckpointManager(root, interval=ts.Every(steps=3))
        restored = manager.restore(state, step=restore_step)
        step = 0 if restored is None else restored.step + 1
    losses: dict[int, list[tuple[float, float]]] = {}  # per step: (loss, batch sum) each micro
    while step < STEPS:
        for xb, yb in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                accelerator.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            losses.setdefault(step, []).append((loss.item(), xb.sum().item()))
            seen.samples += len(xb)
            state.extra["tokens_seen"] += xb.numel()
            if not accelerator.sync_gradients:
                continue
            if manager is not None:
                manager.step(step, state)
            if step == kill_after:
                assert manager is not None
                manager.wait()
                os.kill(os.getpid(), signal.SIGKILL)  # stopped, as by a preemption
            step += 1
            if step == STEPS:
                break
    if manager is not None:
        manager.close()
    inner = opt.optimizer
    return {
        "losses": losses,
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "moments": {f"{i}.{k}": v.clone() for i, s in inner.state.items() for k, v in s.items()},
        "lr": sched.get_last_lr(),
        "seen": seen.samples,
        "tokens_seen": state.extra["tokens_seen"],
        "accelerator_step": accelerator.step,
    }


@pytest.fixture
def accelerate_state() -> Iterator[None]:
    """accelerate keeps process-wide singletons: start each test from none, leave none."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_killed_and_resumed_accelerate_run_is_bitwise_the_uninterrupted_one(
    tmp_path: Path, accelerate_state: None
) -> None:
    from accelerate import Accelerator

    from trainsnap.integrations.accelerate import train_state

    root = str(tmp_path / "snapshots")
    straight = assert_all_ok(run_ranks(_train, 2, args=(None, None, None), timeout=90))
    killed = run_ranks(_train, 2, args=(root, KILL_AFTER, None), timeout=90)
    assert all(r.killed and r.error is None for r in killed), [r.describe() for r in killed]
    assert [s.step for s in ts.list_snapshots(root)] == [0, 3, 6]
    # from the newest (step 6, mid-epoch), then from step 3 (the last batch of epoch 0)
    for restore_step in (None, 3):
        resumed = assert_all_ok(run_ranks(_train, 2, args=(root, None, restore_step), timeout=90))
        first = KILL_AFTER if restore_step is None else restore_step + 1
        for rank, (want, got) in enumerate(zip(straight, resumed, strict=True)):
            assert sorted(got["losses"]) == list(range(first, STEPS)), rank
            for step, micro in got["losses"].items():
                assert micro == want["losses"][step], (restore_step, rank, step)
            assert _same(got["weights"], want["weights"]), (restore_step, rank)
            assert _same(got["moments"], want["moments"]), (restore_step, rank)
            for key in ("lr", "seen", "tokens_seen", "accelerator_step"):
                assert got[key] == want[key], (restore_step, rank, key)
    assert ts.verify(root).ok
    # each process's data cursor is its shard's: one process may not take it up strictly
    alone = Accelerator(cpu=True, gradient_accumulation_steps=2, dataloader_config=_config())
    _prepared(alone)
    with pytest.raises(ts.IncompatibleError, match="data state is per rank"):
        ts.load(train_state(alone), root)
    assert ts.load(train_state(alone), root, level="training").level == "training"


# -- refusals and in-process round trips ----------------------------------------------------


def _net() -> torch.nn.Module:
    return torch.nn.Linear(2, 2)


def test_the_helper_refuses_what_it_cannot_capture_exactly(accelerate_state: None) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DataLoaderConfiguration

    from trainsnap.integrations.accelerate import train_state

    data = torch.utils.data.TensorDataset(torch.zeros(4, 2))
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=2))
    with pytest.raises(ts.InvalidArgumentError, match="use_stateful_dataloader=True"):
        train_state(accelerator)

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)
    )
    accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=2, shuffle=True))
    with pytest.raises(ts.InvalidArgumentError, match="use_seedable_sampler=True"):
        train_state(accelerator)

    accelerator.free_memory()
    a, b = _net(), _net()
    both = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    accelerator.prepare(a, b, both)
    with pytest.raises(ts.InvalidArgumentError, match="no single prepared model holds"):
        train_state(accelerator)

    accelerator.free_memory()
    a, b = _net(), _net()
    accelerator.prepare(a, b, torch.optim.SGD(a.parameters(), lr=0.1))
    with pytest.raises(ts.InvalidArgumentError, match="model 1 has 0 optimizers"):
        train_state(accelerator)

    accelerator.free_memory()
    accelerator.prepare(torch.optim.SGD(_net().parameters(), lr=0.1))
    with pytest.raises(ts.InvalidArgumentError, match="no model"):
        train_state(accelerator)

    accelerator.free_memory()
    accelerator.prepare(_net())
    with pytest.raises(ts.InvalidArgumentError, match="rename your entry"):
        train_state(accelerator, extra={"accelerate": 1})


def test_two_models_with_an_optimizer_each_round_trip(
    accelerate_state: None, tmp_path: Path
) -> None:
    from accelerate import Accelerator

    from trainsnap.integrations.accelerate import train_state

    accelerator = Accelerator(cpu=True)
    gen, disc = _net(), _net()
    opt_g = torch.optim.AdamW(gen.parameters(), lr=0.1)
    opt_d = torch.optim.AdamW(disc.parameters(), lr=0.1)
    gen, disc, opt_g, opt_d = accelerator.prepare(gen, disc, opt_g, opt_d)
    for model, opt in ((gen, opt_g), (disc, opt_d)):
        accelerator.backward(model(torch.ones(1, 2)).sum())
        opt.step()
    state = train_state(accelerator)
    assert state.optimizers == [opt_g.optimizer, opt_d.optimizer]  # torch's, unwrapped
    ts.save(state, tmp_path, step=1)
    keys = ts.read(tmp_path, keys=["model", "optim"])
    assert set(keys["model"]) == {"0", "1"} and set(keys["optim"]) == {"0", "1"}
    assert set(keys["optim"]["1"]["state"]) == {"weight", "bias"}  # by parameter name
    want = {k: v.clone() for k, v in opt_d.optimizer.state[disc.weight].items()}
    with torch.no_grad():
        disc.weight.zero_()
    opt_d.optimizer.state.clear()
    ts.load(train_state(accelerator), tmp_path)
    got = opt_d.optimizer.state[disc.weight]
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert disc.weight.abs().sum() > 0


def test_a_cursor_restored_and_saved_before_the_next_batch_keeps_its_place(
    accelerate_state: None, tmp_path: Path
) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    from trainsnap.integrations.accelerate import train_state

    config = DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    data = torch.utils.data.TensorDataset(torch.arange(16.0))
    loader = accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=2, shuffle=True))
    state = train_state(accelerator, rng=False)
    batches = iter(loader)
    next(batches), next(batches)
    ts.save(state, tmp_path / "a", step=2)
    third = next(batches)[0]
    ts.load(state, tmp_path / "a")
    ts.save(state, tmp_path / "b", step=2)  # preempted again before any batch
    assert torch.equal(next(iter(loader))[0], third)
    ts.load(state, tmp_path / "b")
    assert torch.equal(next(iter(loader))[0], third)


def test_a_save_after_the_epoch_loop_exits_resumes_at_the_next_epochs_order(
    accelerate_state: None, tmp_path: Path
) -> None:
    """accelerate's canonical pattern: ``for epoch: for batch in loader: ...`` then save at the
    end of the epoch. The epoch is counted once: the resumed run sees the next epoch's order."""
    from accelerate import Accelerator

    from trainsnap.integrations.accelerate import train_state

    accelerator = Accelerator(cpu=True, dataloader_config=_config())
    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    loader = accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=2, shuffle=True))
    state = train_state(accelerator, rng=False)
    orders = []
    for epoch in range(3):
        orders.append([b[0].tolist() for b in loader])
        if epoch == 0:
            ts.save(state, tmp_path, step=epoch)  # after the loop exited
    assert orders[0] != orders[1] != orders[2]
    AcceleratorState = type(accelerator.state)
    AcceleratorState._reset_state(reset_partial_state=True)
    fresh = Accelerator(cpu=True, dataloader_config=_config())
    loader = fresh.prepare(torch.utils.data.DataLoader(data, batch_size=2, shuffle=True))
    ts.load(train_state(fresh, rng=False), tmp_path)
    assert [b[0].tolist() for b in loader] == orders[1]
    assert [b[0].tolist() for b in loader] == orders[2]


def test_a_restored_run_once_dropped_stops_its_loader_workers_at_once(
    accelerate_state: None, tmp_path: Path
) -> None:
    """A run dropped after a restore is freed when its last reference goes, its loaders'
    workers stopped then: the restore leaves no reference cycle holding the state. A
    DataLoader iterator that only a cyclic collection frees has its queues' feeder threads
    stopped (their finalizers run first) before its own shutdown sends each worker its last
    message, so every worker is joined on torch's 5 s timeout, one after the other."""
    import gc
    import time
    import weakref

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from trainsnap.integrations.accelerate import train_state

    def run() -> tuple[Any, Any, ts.TrainState]:
        accelerator = Accelerator(cpu=True, dataloader_config=_config())
        data = torch.utils.data.TensorDataset(torch.arange(16.0))
        plain = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True, num_workers=2)
        loader = accelerator.prepare(plain)
        return accelerator, loader, train_state(accelerator, rng=False)

    accelerator, loader, state = run()
    next(iter(loader))
    with ts.CheckpointManager(tmp_path) as manager:
        manager.save(1, state)
    del accelerator, loader, state, manager
    AcceleratorState._reset_state(reset_partial_state=True)
    gc.collect()
    gc.disable()  # what only a cyclic collection would free stays, whenever gc would run
    try:
        accelerator, loader, state = run()
        with ts.CheckpointManager(tmp_path) as manager:
            manager.restore(state, level="training")
        iterator = loader.base_dataloader._iterator  # the resumed one, its workers started
        workers = list(iterator._workers)
        assert len(workers) == 2 and all(w.is_alive() for w in workers)
        ref = weakref.ref(iterator)
        started = time.perf_counter()
        del iterator, accelerator, loader, state, manager
        freed = ref() is None
        gc.collect()
        took = time.perf_counter() - started
    finally:
        gc.enable()
    assert freed, "the restore left the run's objects in a reference cycle"
    assert not any(w.is_alive() for w in workers)
    assert took < 4.0  # under one worker's join timeout; 2 x 5 s when collected by gc


def test_a_state_saved_before_the_first_batch_resumes_the_first_epochs_order_with_workers(
    accelerate_state: None, tmp_path: Path
) -> None:
    """Saved before the loop's first batch, with workers: accelerate's loader starts its
    iterator (and its workers' first indices) when it is prepared, before its seedable
    sampler is put in, so the first epoch's order is the one a fresh loader draws; the resumed
    run, prepared as the first was, sees that order, and the next epoch's."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import set_seed

    from trainsnap.integrations.accelerate import train_state

    data = torch.utils.data.TensorDataset(torch.arange(24.0))

    def prepared() -> tuple[Any, Any]:
        set_seed(3)
        accelerator = Accelerator(cpu=True, dataloader_config=_config())
        plain = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True, num_workers=2)
        return accelerator, accelerator.prepare(plain)

    def epoch(loader: Any) -> list[float]:
        return [v for batch in loader for v in batch[0].tolist()]

    accelerator, loader = prepared()
    ts.save(train_state(accelerator), tmp_path, step=0)
    want = [epoch(loader), epoch(loader)]
    assert want[0] != want[1] and sorted(want[0]) == sorted(want[1])
    del accelerator, loader
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator, loader = prepared()
    ts.load(train_state(accelerator), tmp_path)
    assert [epoch(loader), epoch(loader)] == want
