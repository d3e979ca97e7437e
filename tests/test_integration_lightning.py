"""Lightning through its own extension point: a real ``Trainer`` with 2 DDP processes on CPU,
``ModelCheckpoint(save_top_k=2, save_last=True)`` writing through ``TrainsnapCheckpointIO``,
killed after a save and resumed with ``fit(ckpt_path="last")``: bitwise the uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

import trainsnap as ts
from trainsnap.testing import assert_all_ok, run_ranks

EPOCHS = 4


def _fit(rank: int, world: int, workdir: str, kill_at_epoch: int | None, resume: bool) -> Any:
    import lightning
    from lightning.pytorch.callbacks import ModelCheckpoint

    from trainsnap.integrations.lightning import TrainsnapCheckpointIO

    class Module(lightning.LightningModule):
        def __init__(self, lr: float = 0.05):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
            )

        def training_step(self, batch, _idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)]

    class Kill(lightning.Callback):
        def on_train_epoch_start(self, trainer, module):
            if trainer.current_epoch == kill_at_epoch:  # after the previous epoch's checkpoint
                os.kill(os.getpid(), signal.SIGKILL)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    torch.manual_seed(0)
    module = Module()
    checkpoints = ModelCheckpoint(
        dirpath=os.path.join(workdir, "ckpt"), monitor="loss", save_top_k=2, save_last=True
    )
    trainer = lightning.Trainer(
        max_epochs=EPOCHS,
        accelerator="cpu",
        devices=world,
        strategy="ddp",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=workdir,
        plugins=[TrainsnapCheckpointIO(os.path.join(workdir, "snapshots"))],
        callbacks=[checkpoints, Kill()],
    )
    trainer.fit(module, loader, ckpt_path="last" if resume else None)
    opt = trainer.optimizers[0]
    moments = {f"{i}.{k}": v.clone() for i, s in opt.state.items() for k, v in s.items()}
    return {
        "weights": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "moments": moments,
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
    }


def _run(workdir: Path, kill_at_epoch: int | None = None, resume: bool = False) -> list[Any]:
    results = run_ranks(_fit, 2, args=(str(workdir), kill_at_epoch, resume), timeout=150)
    if kill_at_epoch is not None:
        assert all(r.killed for r in results), results
        return []
    return assert_all_ok(results)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ddp_killed_after_a_save_resumes_bitwise_and_removed_checkpoints_leave_nothing(tmp_path):
    (straight, _) = _run(tmp_path / "straight")
    _run(tmp_path / "resumed", kill_at_epoch=2)
    pointers = sorted(p.name for p in (tmp_path / "resumed" / "ckpt").glob("*.ckpt"))
    assert "last.ckpt" in pointers, pointers
    last = json.loads((tmp_path / "resumed" / "ckpt" / "last.ckpt").read_text())
    assert last["format"] == "trainsnap.pointer" and last["step"] == 8  # 2 epochs of 4 steps
    resumed = _run(tmp_path / "resumed", resume=True)
    for rank in resumed:
        assert rank["global_step"] == straight["global_step"] == EPOCHS * 4
        assert _same(rank["weights"], straight["weights"])
        assert _same(rank["moments"], straight["moments"])
    # Top-2 + last: every pointer names a committed snapshot and no removed one left a snapshot.
    root = tmp_path / "resumed" / "snapshots"
    live = {
        json.loads(p.read_text())["snapshot"]
        for p in (tmp_path / "resumed" / "ckpt").glob("*.ckpt")
    }
    assert len(live) == 3
    assert {s.id for s in ts.list_snapshots(root)} == live
    assert ts.verify(root).ok


def test_async_saves_point_after_their_commit_and_load_from_checkpoint_rebuilds_the_module(
    tmp_path,
):
    import lightning
    from lightning.pytorch.callbacks import ModelCheckpoint

    from trainsnap.integrations.lightning import TrainsnapCheckpointIO, load_from_checkpoint

    torch.manual_seed(0)
    module = Tiny(width=3)
    io = TrainsnapCheckpointIO(tmp_path / "root", async_save=True)
    trainer = lightning.Trainer(
        max_epochs=3,
        **quiet_cpu(tmp_path),
        plugins=[io],
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=1, monitor="loss")],
    )
    data = torch.utils.data.TensorDataset(torch.randn(8, 3))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    (best,) = (tmp_path / "ckpt").glob("*.ckpt")  # top-1: the others were removed
    assert len(ts.list_snapshots(tmp_path / "root")) == 1
    back = load_from_checkpoint(Tiny, best)
    assert back.hparams.width == 3
    assert all(
        torch.equal(a, b) for a, b in zip(back.parameters(), module.parameters(), strict=True)
    )
    (tmp_path / "torch.ckpt").write_bytes(b"PK\x03\x04 not a pointer")
    with pytest.raises(ts.IncompatibleError, match="not a trainsnap checkpoint pointer"):
        io.load_checkpoint(tmp_path / "torch.ckpt")


def quiet_cpu(workdir: Any) -> dict[str, Any]:
    """Trainer options of a quiet one-process CPU run in ``workdir``."""
    return {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(workdir),
    }


def _tiny_class() -> Any:
    import lightning

    class Tiny(lightning.LightningModule):
        def __init__(self, width: int = 2):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Linear(width, 1)

        def training_step(self, batch, _idx):
            loss = self.net(batch[0]).pow(2).mean()
            self.log("loss", loss, on_step=False, on_epoch=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Tiny


Tiny = _tiny_class()


def _fit_sharded(
    rank: int, world: int, workdir: str, kill_at_epoch: int | None, resume: bool
) -> Any:
    import lightning
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.distributed.fsdp import fully_shard

    from trainsnap.integrations.lightning import TrainsnapModelParallelStrategy

    class Sharded(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
            )

        def configure_model(self) -> None:
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, _idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):  # the schedule moves the optimizer's lr: it is state
            opt = torch.optim.AdamW(self.parameters(), lr=0.05)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

    class Kill(lightning.Callback):
        def on_train_epoch_start(self, trainer, module):
            if trainer.current_epoch == kill_at_epoch:
                os.kill(os.getpid(), signal.SIGKILL)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=g)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4
    )
    torch.manual_seed(0)
    module = Sharded()
    trainer = lightning.Trainer(
        max_epochs=EPOCHS,
        **{**quiet_cpu(workdir), "devices": world},
        strategy=TrainsnapModelParallelStrategy(
            os.path.join(workdir, "snapshots"), data_parallel_size=world, tensor_parallel_size=1
        ),
        callbacks=[ModelCheckpoint(dirpath=os.path.join(workdir, "ckpt"), save_last=True), Kill()],
    )
    trainer.fit(module, loader, ckpt_path="last" if resume else None)
    full = {k: v.full_tensor() for k, v in module.net.state_dict().items()}
    opt = trainer.optimizers[0]
    moments = {
        f"{i}.{k}": v.full_tensor()
        for i, (_, s) in enumerate(opt.state.items())
        for k, v in s.items()
        if k != "step"
    }
    lr = opt.param_groups[0]["lr"]
    return {"weights": full, "moments": moments, "global_step": trainer.global_step, "lr": lr}


def test_model_parallel_saves_shards_without_a_gather_and_resumes_bitwise(tmp_path):
    straight = assert_all_ok(
        run_ranks(_fit_sharded, 2, args=(str(tmp_path / "a"), None, False), timeout=150)
    )
    killed = run_ranks(_fit_sharded, 2, args=(str(tmp_path / "b"), 2, False), timeout=150)
    assert all(r.killed for r in killed), killed
    root = tmp_path / "b" / "snapshots"
    (last,) = ts.list_snapshots(root)[-1:]
    from trainsnap.protocol import commit

    m = commit.open_snapshot(ts.open_storage(root), last.id)
    t = m.tensor_keys.index("state_dict.net.0.weight")
    assert m.world_size == 2 and int(m.tensor_nshards[t]) == 2  # each rank wrote its shard
    resumed = assert_all_ok(
        run_ranks(_fit_sharded, 2, args=(str(tmp_path / "b"), None, True), timeout=150)
    )
    for got, want in zip(resumed, straight, strict=True):
        assert got["global_step"] == want["global_step"] == EPOCHS * 4
        assert _same(got["weights"], want["weights"]) and _same(got["moments"], want["moments"])
        assert got["lr"] == want["lr"] == 0.05 * 0.5**EPOCHS
