"""The state real training stacks hand over, saved and read back exactly: the checkpoint dict of
a real ``lightning.Trainer.fit`` (captured with Lightning's own CheckpointIO hook) and
torchtitan-shaped state (flat optimizer keys, per-dp-rank dataloader bytes, train_state)."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Mapping
from typing import Any

import torch

import trainsnap as ts
from test_integration_lightning import quiet_cpu
from test_tree import same


def _plain(obj: Any) -> Any:
    """Mapping subclasses (Lightning's AttributeDict) as the dicts they are: trainsnap never
    builds a class it does not know, so they read back as dict."""
    if isinstance(obj, Mapping) and type(obj) not in (dict,) and not hasattr(obj, "move_to_end"):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, dict):
        return type(obj)((k, _plain(v)) for k, v in obj.items())
    if isinstance(obj, list | tuple):
        return type(obj)(_plain(v) for v in obj)
    return obj


def _lightning_checkpoint(tmp_path) -> dict[str, Any]:
    import lightning
    from lightning.pytorch.plugins.io import CheckpointIO

    captured: list[dict[str, Any]] = []

    class Capture(CheckpointIO):  # Lightning's own hook: what Trainer hands a checkpoint backend
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            captured.append(copy.deepcopy(checkpoint))

        def load_checkpoint(self, path, map_location=None):
            raise NotImplementedError

        def remove_checkpoint(self, path):
            pass

    class Module(lightning.LightningModule):
        def __init__(self, lr: float = 0.05, width: int = 4):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 1))

        def training_step(self, batch, _idx):
            (x,) = batch
            loss = self.net(x).pow(2).mean()
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
            return [opt], [sched]

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=4
    )
    trainer = lightning.Trainer(max_steps=6, **quiet_cpu(tmp_path), plugins=[Capture()])
    trainer.fit(Module(), data)
    assert captured, "Lightning saved no checkpoint"
    return captured[-1]


def test_a_lightning_checkpoint_dict_round_trips_exactly(tmp_path):
    ckpt = _lightning_checkpoint(tmp_path / "fit")
    assert {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks"} <= set(ckpt)
    root = tmp_path / "snap"
    ts.save(ckpt, root, step=int(ckpt["global_step"]))
    expected = _plain(ckpt)
    assert same(ts.read(root), expected)
    fresh: dict[str, Any] = {k: None for k in ckpt}  # no template at all
    ts.load(fresh, root)
    assert same(fresh, expected)
    # into fresh objects: a module and an optimizer built from scratch
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    net.load_state_dict({k.removeprefix("net."): v for k, v in fresh["state_dict"].items()})
    opt = torch.optim.AdamW(net.parameters(), lr=1.0)
    opt.load_state_dict(fresh["optimizer_states"][0])
    assert same(opt.state_dict()["state"], ckpt["optimizer_states"][0]["state"])


def test_torchtitan_shaped_state_round_trips_exactly(tmp_path):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"tok": torch.nn.Embedding(8, 4), "out": torch.nn.Linear(4, 8)})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model["out"](model["tok"](torch.arange(4))).sum().backward()
    opt.step()
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    state = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(
            model, opt, options=flat
        ),  # "state.out.weight.exp_avg"
        "lr_scheduler": {"last_epoch": 7, "_step_count": 8, "base_lrs": [3e-4]},
        "dataloader": {"dp_rank_0": pickle.dumps({"sampler_iter_yielded": 12}), "world_size": 1},
        "train_state": {"step": 7, "ntokens_seen": 4096, "log_steps": [1, 5]},
    }
    assert "state.out.weight.exp_avg" in state["optimizer"]
    ts.save(state, tmp_path, step=7)
    assert same(ts.read(tmp_path), state)
    fresh: dict[str, Any] = {k: None for k in state}
    ts.load(fresh, tmp_path)
    assert same(fresh, state)
