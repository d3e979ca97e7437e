"""torchtitan through its own extension point: ``TrainsnapCheckpointManager.Config`` in the
trainer config's ``checkpoint`` field, built with torchtitan's ``OptimizersContainer``,
``LRSchedulersContainer`` and ``ParallelAwareDataloader`` around a small transformer laid out
as torchtitan lays out Llama (FSDP2 over TP, dp=2 x tp=2 on 4 ranks), saving every 2 steps.

torchtitan's own Llama needs triton, which CPU-only torch does not have, so the model is
``test_placements``'s ``TinyTransformer`` (torchtitan's Llama FQNs), which the checkpointer
wraps in torchtitan's ``ModelWrapper`` as it wraps any model parts.

One rank is SIGKILLed in the middle of the step-6 save. The restart on the same mesh continues
the uninterrupted run's losses bitwise; a restart on another mesh is refused, naming the fix,
and with the fix continues them within floating-point noise."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import IterableDataset

import trainsnap as ts
from test_placements import VOCAB, TinyTransformer, _parallelize
from trainsnap.integrations.torchtitan import TrainsnapCheckpointManager
from trainsnap.testing import assert_all_ok, run_ranks

STEPS, INTERVAL, GLOBAL_BATCH, SEQ = 8, 2, 4, 5
KILL_AT = 6
# The losses of a resume on another mesh differ from the uninterrupted run's only by the order
# of float32 sums: gradients averaged over 1, 2 or 4 data-parallel ranks, matmuls split by TP.
# Measured: at most 1.7e-7 relative (1-2 ulps of a loss near 3). Losing a part of the restore
# moves them by far more: without the optimizer state 2e-3 to 7e-3, without the LR schedule
# 2e-3 to 5e-3. 1e-5 is 60x above the noise and 200x below the smallest of those.
RESHARD_RTOL = 1e-5


class Tokens(IterableDataset):  # type: ignore[type-arg]
    """A data-parallel rank's share of a fixed stream of global batches: sample ``s`` of the
    global stream depends on ``s`` alone, so every data-parallel degree trains on the same global
    batches. Stateful, as torchtitan's datasets are (the dataloader saves its position)."""

    def __init__(self, dp_rank: int, dp: int) -> None:
        self.dp_rank, self.local, self.index = dp_rank, GLOBAL_BATCH // dp, 0

    def __iter__(self) -> Any:
        while True:
            step, k = divmod(self.index, self.local)
            sample = step * GLOBAL_BATCH + self.dp_rank * self.local + k
            self.index += 1
            ids = torch.randint(
                0, VOCAB, (SEQ + 1,), generator=torch.Generator().manual_seed(sample)
            )
            yield ids[:-1], ids[1:]

    def state_dict(self) -> dict[str, int]:
        return {"index": self.index}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.index = state_dict["index"]


class Progress:
    """What torchtitan's ``Trainer`` hands the checkpointer as ``states["train_state"]``."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


def _build(rank: int, root: str, dp: int, tp: int, **checkpoint: Any) -> dict[str, Any]:
    """torchtitan's trainer set-up, from its own config classes."""
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import (
        LRSchedulersContainer,
        OptimizersContainer,
        ParamGroupConfig,
    )

    torch.manual_seed(0)
    model = _parallelize(TinyTransformer(), dp, tp)
    adamw = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    optimizers = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs=adamw)
        ],
        implementation="for-loop",
    ).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=STEPS
    )
    dp_rank = rank // tp
    loader = ParallelAwareDataloader(
        Tokens(dp_rank, dp),
        dp_rank=dp_rank,
        dp_world_size=dp,
        batch_size=GLOBAL_BATCH // dp,
        # Its own generator: a DataLoader draws each iterator's base seed from the global RNG
        # otherwise, and a resumed trainer makes one iterator more than an uninterrupted one.
        generator=torch.Generator(),
    )
    progress = Progress()
    checkpointer = TrainsnapCheckpointManager.Config(
        **{"enable": True, "folder": root, "interval": INTERVAL, "keep_latest_k": 2, **checkpoint}
    ).build(
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": progress},
        sd_adapter=None,
        base_folder="",
    )
    return {
        "model": model,
        "optimizers": optimizers,
        "schedulers": schedulers,
        "loader": loader,
        "progress": progress,
        "checkpointer": checkpointer,
    }


def _train(
    rank: int,
    world: int,
    root: str,
    dp: int,
    tp: int,
    checkpoint: dict[str, Any],
    kill_at: int | None = None,
    reposition: bool = False,
) -> dict[str, Any]:
    """torchtitan's loop (``Trainer.train``/``train_step``): load, then per step forward,
    backward, wait for staging, optimizer and scheduler steps, save."""
    import torch.distributed as dist

    from trainsnap import faults

    run = _build(rank, root, dp, tp, **checkpoint)
    checkpointer, progress, loader = run["checkpointer"], run["progress"], run["loader"]
    checkpointer.load(step=-1)
    if reposition:  # the data could not be restored on this data-parallel degree: re-derive it
        loader.dataset.index = progress.step * (GLOBAL_BATCH // dp)
    losses: dict[int, float] = {}
    # Draws from the global RNG, as dropout would: a strict resume continues the same ones.
    draws: dict[int, float] = {}
    batches = iter(loader)
    while progress.step < STEPS:
        progress.step += 1
        inputs, labels = next(batches)
        logits = run["model"](inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        torch.autograd.backward(loss)
        checkpointer.maybe_wait_for_staging()
        run["optimizers"].step()
        run["schedulers"].step()
        run["optimizers"].zero_grad()
        progress.ntokens_seen += labels.numel() * dp
        total = loss.detach().clone()
        dist.all_reduce(total)  # tensor-parallel peers hold the same loss: the dp mean
        losses[progress.step] = (total / world).item()
        draws[progress.step] = torch.rand(()).item()
        if progress.step == kill_at and rank == 1:
            faults.install("mid_write=crash")  # this save SIGKILLs rank 1 while it writes
        checkpointer.save(progress.step, last_step=progress.step == STEPS)
    checkpointer.close()
    loaded = checkpointer.loaded
    return {
        "losses": losses,
        "draws": draws,
        "loaded": None if loaded is None else (loaded.step, loaded.level),
    }


def _resume_then_reference(rank: int, world: int, root: str, fresh: str) -> dict[str, Any]:
    """The restart on the mesh that saved, then (in the same processes, to spare 4 process
    starts) the uninterrupted run from scratch on a fresh root: it saves too, the same code."""
    return {
        "resumed": _train(rank, world, root, 2, 2, {}),
        "reference": _train(rank, world, fresh, 2, 2, {}),
    }


def _refuse_then_fix(
    rank: int, world: int, root: str, dp: int, tp: int, fix: dict[str, Any]
) -> dict[str, Any]:
    """The default (strict) resume on this mesh, refused on every rank before any train state
    is given back; then the resume with the fix the refusal names."""
    run = _build(rank, root, dp, tp)
    with pytest.raises(ts.IncompatibleError) as refusal:
        run["checkpointer"].load(step=-1)
    run["checkpointer"].close()
    assert run["progress"].step == 0
    return {"refusal": str(refusal.value), **_train(rank, world, root, dp, tp, fix, None, True)}


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with rank 1 SIGKILLed in the middle of its step-6 save."""
    root = tmp_path_factory.mktemp("titan_crashed")
    results = run_ranks(_train, world_size=4, args=(str(root), 2, 2, {}, KILL_AT), timeout=90)
    assert results[1].killed and results[1].exitcode == -9, results[1].describe()
    assert not any(r.ok for r in results)  # its peers could not go on without it
    assert [s.step for s in ts.list_snapshots(root)] == [2, 4]  # step 6 never committed
    ts.verify(str(root))
    return root


@pytest.fixture(scope="module")
def same_mesh(crashed: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("titan_resumed") / "root"
    shutil.copytree(crashed, root)
    fresh = str(tmp_path_factory.mktemp("titan_reference"))
    args = (str(root), fresh)
    results = assert_all_ok(run_ranks(_resume_then_reference, world_size=4, args=args, timeout=90))
    assert all(r["reference"]["losses"] == results[0]["reference"]["losses"] for r in results)
    return {"root": root, "results": results, "reference": results[0]["reference"]["losses"]}


def test_a_rank_killed_mid_save_resumes_on_the_same_mesh_bitwise(same_mesh: dict[str, Any]) -> None:
    reference = same_mesh["reference"]
    assert sorted(reference) == list(range(1, STEPS + 1))
    for r in same_mesh["results"]:
        assert r["resumed"]["loaded"] == (4, "strict")
        assert r["resumed"]["losses"] == {s: reference[s] for s in range(5, STEPS + 1)}  # bitwise
        draws = r["reference"]["draws"]
        assert r["resumed"]["draws"] == {s: draws[s] for s in range(5, STEPS + 1)}  # RNG too
    snapshots = ts.list_snapshots(same_mesh["root"])
    # keep_latest_k=2: the step-6 save and the final model-only one (last_save_model_only)
    assert [(s.step, s.level) for s in snapshots] == [(6, "strict"), (8, "weights")]
    assert snapshots[0].tokens_seen == 6 * GLOBAL_BATCH * SEQ
    ts.verify(str(same_mesh["root"]))


@pytest.mark.parametrize(
    ("world", "dp", "tp", "fix", "refusal"),
    [
        (4, 4, 1, {"exclude_from_loading": ["dataloader"]}, "dataloader state"),
        (2, 1, 2, {"resume_level": "training"}, "topology changed from 4 to 2 ranks"),
    ],
)
def test_a_resume_on_another_mesh_is_refused_then_fixed_within_noise(
    same_mesh: dict[str, Any],
    crashed: Path,
    tmp_path: Path,
    world: int,
    dp: int,
    tp: int,
    fix: dict[str, Any],
    refusal: str,
) -> None:
    reference = same_mesh["reference"]
    root = tmp_path / "root"
    shutil.copytree(crashed, root)
    args = (str(root), dp, tp, fix)
    for r in assert_all_ok(run_ranks(_refuse_then_fix, world_size=world, args=args, timeout=90)):
        assert refusal in r["refusal"]
        assert f"checkpoint.{next(iter(fix))}" in r["refusal"]  # the refusal names the fix
        assert r["loaded"] == (4, fix.get("resume_level", "strict"))
        assert sorted(r["losses"]) == list(range(5, STEPS + 1))
        for step, loss in r["losses"].items():
            assert loss == pytest.approx(reference[step], rel=RESHARD_RTOL, abs=0), step
    ts.verify(str(root))


def _no_unpickling(*_args: Any, **_kwargs: Any) -> Any:
    raise AssertionError("a DCP checkpoint was unpickled")


def test_a_dcp_checkpoint_of_torchtitans_own_backend_is_an_initial_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Moving a run over: torchtitan's DCP checkpointer saved it; ``initial_load_path`` starts
    the trainsnap one from it (model, optimizer, schedule, data, train state), reading its
    ``.metadata`` and items without unpickling them (pickle's loader raises here)."""
    from torchtitan.components.checkpointer import CheckpointManager

    dcp_root = tmp_path / "dcp"
    first = _build(0, str(tmp_path / "unused"), 1, 1)
    first["checkpointer"].close()
    first["checkpointer"] = CheckpointManager.Config(
        enable=True, folder=str(dcp_root), interval=1, keep_latest_k=0
    ).build(
        dataloader=first["loader"],
        model_parts=[first["model"]],
        optimizers=first["optimizers"],
        lr_schedulers=first["schedulers"],
        states={"train_state": first["progress"]},
        sd_adapter=None,
    )
    batches = iter(first["loader"])
    for step in (1, 2):
        inputs, _ = next(batches)
        first["model"](inputs).sum().backward()
        first["optimizers"].step()
        first["schedulers"].step()
        first["optimizers"].zero_grad()
        first["progress"].step = step
    first["checkpointer"].save(2)
    first["checkpointer"].close()

    config = {"initial_load_path": str(dcp_root / "step-2"), "initial_load_model_only": False}
    second = _build(0, str(tmp_path / "snapshots"), 1, 1, **config)
    # DCP's reader unpickles .metadata with pickle.load, its planner its items with torch.load
    # (weights_only=False: pickle.Unpickler). (torchtitan's dataloader pickle.loads the blob it
    # wrote itself, from a trainsnap snapshot as from a DCP one: that is its own format.)
    monkeypatch.setattr(pickle, "load", _no_unpickling)
    monkeypatch.setattr(pickle, "Unpickler", _no_unpickling)
    assert second["checkpointer"].load(step=-1)
    monkeypatch.undo()
    second["checkpointer"].close()
    assert second["progress"].step == 2
    for got, expected in zip(next(iter(second["loader"])), next(batches), strict=True):
        assert torch.equal(got, expected)  # the data continues where it was
    assert second["schedulers"].state_dict() == first["schedulers"].state_dict()
    for name, tensor in first["model"].state_dict().items():
        assert torch.equal(second["model"].state_dict()[name], tensor), name
    moments = second["optimizers"].state_dict()
    for key, value in first["optimizers"].state_dict().items():
        assert torch.equal(moments[key], value) if torch.is_tensor(value) else moments[key] == value


def test_the_config_refuses_what_trainsnap_does_not_do() -> None:
    with pytest.raises(ValueError, match="trainsnap export"):
        TrainsnapCheckpointManager.Config(last_save_in_hf=True)
    with pytest.raises(ValueError, match="compression"):
        TrainsnapCheckpointManager.Config(compression="gzip")
    config = TrainsnapCheckpointManager.Config(compression="zstd", resume_level="training")
    assert config.async_mode == "async" and not config.enable


def _local(root: str) -> dict[str, Any]:
    """A local tier saved every step in front of durable saves every 4 steps."""
    return {"local_folder": str(Path(root).parent / "local"), "local_interval": 1, "interval": 4}


def _resume_local_then_reference(rank: int, world: int, root: str, fresh: str) -> dict[str, Any]:
    return {
        "resumed": _train(rank, world, root, 2, 1, _local(root)),
        "reference": _train(rank, world, fresh, 2, 1, _local(fresh)),
    }


def test_a_local_tier_takes_the_frequent_saves_and_the_resume_starts_from_it(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "run" / "durable")
    killed = run_ranks(_train, world_size=2, args=(root, 2, 1, _local(root), 7), timeout=90)
    assert killed[1].killed, killed[1].describe()
    assert [s.step for s in ts.list_snapshots(root)] == [4]  # durable: every 4 steps
    assert [s.step for s in ts.list_snapshots(tmp_path / "run" / "local")][-1] == 6
    fresh = str(tmp_path / "fresh" / "durable")
    args = (root, fresh)
    for r in assert_all_ok(run_ranks(_resume_local_then_reference, world_size=2, args=args)):
        assert r["resumed"]["loaded"] == (6, "strict")  # the local tier's newer snapshot
        reference = r["reference"]["losses"]
        assert r["resumed"]["losses"] == {s: reference[s] for s in (7, 8)}  # bitwise
    with pytest.raises(ValueError, match="go together"):
        TrainsnapCheckpointManager.Config(local_folder="local")
