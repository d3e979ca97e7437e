"""Lightning through its own extension point: a real ``Trainer`` with 2 DDP processes on CPU,
``ModelCheckpoint(save_top_k=2, save_last=True)`` writing through ``TrainsnapCheckpointIO``,
killed after a save and resumed with ``fit(ckpt_path="last")``: bitwise the uninterrupted run."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import trainsnap as ts
from trainsnap.testing import assert_all_ok, run_ranks

pytest.importorskip("lightning")
from trainsnap.integrations.lightning import read_pointer

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
    _, last = read_pointer(tmp_path / "resumed" / "ckpt" / "last.ckpt")
    assert ts.list_snapshots(tmp_path / "resumed" / "snapshots")[-1].id == last
    assert last.startswith("step-000000000008-")  # 2 epochs of 4 steps
    resumed = _run(tmp_path / "resumed", resume=True)
    for rank in resumed:
        assert rank["global_step"] == straight["global_step"] == EPOCHS * 4
        assert _same(rank["weights"], straight["weights"])
        assert _same(rank["moments"], straight["moments"])
    # Top-2 + last: every pointer names a committed snapshot and no removed one left a snapshot.
    root = tmp_path / "resumed" / "snapshots"
    live = {read_pointer(p)[1] for p in (tmp_path / "resumed" / "ckpt").glob("*.ckpt")}
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


# -- the defects Lightning's own checkpoint tests found, each in its scenario -------------------

import lightning  # noqa: E402

from trainsnap.integrations.lightning import (  # noqa: E402
    CheckpointNotFoundError,
    TrainsnapCheckpointIO,
    load_from_checkpoint,
)


class Spawned(lightning.LightningModule):
    """A module ``ddp_spawn`` can pickle into its processes (defined at module level)."""

    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(width, 1)

    def training_step(self, batch, _idx):
        loss = self.net(batch[0]).pow(2).mean()
        self.log("loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(3)
        data = torch.utils.data.TensorDataset(torch.randn(16, self.hparams.width, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=4)


def _fit_tiny(workdir: Any, io: TrainsnapCheckpointIO, epochs: int = 2, **trainer: Any) -> Any:
    torch.manual_seed(0)
    module = Spawned()
    options = {**quiet_cpu(workdir), "max_epochs": epochs, "plugins": [io], **trainer}
    fit = lightning.Trainer(**options)
    fit.fit(module)
    return module, fit


def test_the_plugin_pickles_so_ddp_spawn_saves_and_resumes_and_torch_save_of_a_trainer_works(
    tmp_path,
):
    import pickle

    io = TrainsnapCheckpointIO(tmp_path / "root", allow_pickle=("hyper_parameters",))
    back = pickle.loads(pickle.dumps(io))
    assert (back.root, back.allow_pickle) == (io.root, io.allow_pickle)
    ckpt = tmp_path / "ckpt"
    spawn = {"devices": 2, "strategy": "ddp_spawn"}
    callbacks = [lightning.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt, save_last=True)]
    before = set(threading.enumerate())
    module, trainer = _fit_tiny(tmp_path, io, callbacks=callbacks, **spawn)
    # The main process read the weights back and removed their checkpoint after the run's
    # teardown: the threads that took are gone too.
    assert not _trainsnap_threads(set(threading.enumerate()) - before)
    torch.save(trainer, tmp_path / "trainer.pt")  # pickles the plug-in with the strategy
    _, last = read_pointer(ckpt / "last.ckpt")
    assert last.startswith("step-000000000004-")  # 2 epochs of 2 steps per process
    # Resumed in 2 fresh processes from the pointer: at max_epochs already, it trains no more,
    # and what the spawned processes hand back is the saved weights.
    callbacks = [lightning.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt, save_last=True)]
    torch.manual_seed(1)
    again = Spawned()
    options = {**quiet_cpu(tmp_path), "max_epochs": 2, "plugins": [io], **spawn}
    lightning.Trainer(**options, callbacks=callbacks).fit(again, ckpt_path=ckpt / "last.ckpt")
    assert all(
        torch.equal(a, b) for a, b in zip(again.parameters(), module.parameters(), strict=True)
    )
    assert ts.read(io.root, last, keys="state_dict")["state_dict"].keys() == {
        "net.weight",
        "net.bias",
    }


@pytest.mark.parametrize("store", ["memory", "s3"])
def test_a_url_default_root_dir_puts_every_checkpoint_in_that_store_and_nothing_on_disk(
    store, tmp_path, monkeypatch, request
):
    import uuid

    import fsspec

    monkeypatch.chdir(tmp_path)  # where ./memory:/... or ./s3:/... would land
    if store == "memory":
        url = f"memory://run-{uuid.uuid4().hex[:8]}"
        options: dict[str, Any] = {}
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)  # Lightning's own fsspec calls too
        url = f"s3://trainsnap-test/run-{uuid.uuid4().hex[:8]}"
        options = {"endpoint_url": endpoint}
    fs, base = fsspec.core.url_to_fs(url, **options)
    _module, trainer = _fit_tiny(
        url, TrainsnapCheckpointIO(storage_options=options), enable_checkpointing=True
    )
    assert list(tmp_path.iterdir()) == []
    (pointer,) = fs.glob(f"{base}/checkpoints/*.ckpt")
    pointer = f"{url}/checkpoints/{pointer.rsplit('/', 1)[-1]}"
    root, snapshot = read_pointer(pointer, options)
    assert root.rstrip("/") == f"{url}/checkpoints/trainsnap"
    assert [s.id for s in ts.list_snapshots(root, storage_options=options)] == [snapshot]
    assert fs.ls(f"{base}/checkpoints/trainsnap/snapshots")  # the snapshot is in the store
    # Resumed from the store; an explicit trainer.save_checkpoint goes there too.
    io = TrainsnapCheckpointIO(storage_options=options)
    _again, trainer = _fit_tiny(url, io, epochs=3, enable_checkpointing=False)
    trainer.save_checkpoint(f"{url}/extra.ckpt")
    assert read_pointer(f"{url}/extra.ckpt", options)[0].rstrip("/") == f"{url}/trainsnap"
    assert trainer.global_step == 3 * 4
    assert list(tmp_path.iterdir()) == []


def test_per_call_storage_options_of_save_checkpoint_are_used(tmp_path, monkeypatch, s3_endpoint):
    import uuid

    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)  # only the call's options know it
    _module, trainer = _fit_tiny(tmp_path, TrainsnapCheckpointIO(), epochs=1)
    url = f"s3://trainsnap-test/call-{uuid.uuid4().hex[:8]}/a.ckpt"
    io = TrainsnapCheckpointIO(f"s3://trainsnap-test/call-{uuid.uuid4().hex[:8]}/root")
    io.save_checkpoint(
        trainer._checkpoint_connector.dump_checkpoint(), url, {"endpoint_url": s3_endpoint}
    )
    root, snapshot = read_pointer(url, {"endpoint_url": s3_endpoint})
    assert root == io.root
    assert (
        ts.read(root, snapshot, storage_options={"endpoint_url": s3_endpoint})["global_step"] == 4
    )
    with pytest.raises(ts.InvalidArgumentError, match="storage_options must be a dict"):
        io.save_checkpoint({}, url, storage_options="endpoint")


def _trainsnap_threads(threads: set[threading.Thread]) -> list[str]:
    return [t.name for t in threads if t.is_alive() and t.name.startswith("trainsnap")]


def test_no_trainsnap_thread_outlives_a_fit_a_save_or_a_load(tmp_path):
    """Lightning's test suite fails a test that leaves a thread it started alive: every
    operation of the plug-in (saves with top-k rotation during fit, a save after it, a resume)
    ends with no trainsnap thread left, while its I/O did run on the pool."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from trainsnap.engine import pool

    used: list[str] = []
    runner_init = pool.TaskRunner.__init__

    def noting(self: Any, threads: int) -> None:
        runner_init(self, threads)
        if self._executor is not None:
            used.append("pool")

    io = TrainsnapCheckpointIO(tmp_path / "root")
    ckpt = tmp_path / "ckpt"
    before = set(threading.enumerate())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pool.TaskRunner, "__init__", noting)
        top1 = [ModelCheckpoint(dirpath=ckpt, monitor="loss", save_top_k=1, save_last=True)]
        _, trainer = _fit_tiny(tmp_path, io, epochs=3, callbacks=top1)
        assert used and not _trainsnap_threads(set(threading.enumerate()) - before)
        used.clear()
        trainer.save_checkpoint(tmp_path / "after.ckpt")  # outside fit: no teardown follows
        assert used and not _trainsnap_threads(set(threading.enumerate()) - before)
        used.clear()
        io.load_checkpoint(tmp_path / "after.ckpt")
        assert used and not _trainsnap_threads(set(threading.enumerate()) - before)


def test_a_missing_checkpoint_is_the_file_not_found_error_lightning_expects(tmp_path):
    io = TrainsnapCheckpointIO(tmp_path / "root")
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found") as raised:
        io.load_checkpoint(tmp_path / "nothing.ckpt")
    assert isinstance(raised.value, ts.NotFoundError)
    assert isinstance(raised.value, CheckpointNotFoundError)
    trainer = lightning.Trainer(max_epochs=1, **quiet_cpu(tmp_path), plugins=[io])
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
        trainer.fit(Spawned(), ckpt_path=tmp_path / "nothing.ckpt")


class WithLoss(Spawned):
    def __init__(self, loss: torch.nn.Module | None = None, width: int = 3) -> None:
        super().__init__(width)
        self.save_hyperparameters()


def test_a_module_hyper_parameter_is_refused_naming_it_or_pickled_on_opt_in(tmp_path):
    trainer = lightning.Trainer(
        max_epochs=1, **quiet_cpu(tmp_path), plugins=[TrainsnapCheckpointIO(tmp_path / "a")]
    )
    with pytest.raises(ts.InvalidArgumentError, match=r"'hyper_parameters\.loss'.*allow_pickle"):
        trainer.fit(WithLoss(loss=torch.nn.SmoothL1Loss(beta=0.5)))
    io = TrainsnapCheckpointIO(tmp_path / "b", allow_pickle=("hyper_parameters",))
    trainer = lightning.Trainer(max_epochs=1, **quiet_cpu(tmp_path), plugins=[io])
    trainer.fit(WithLoss(loss=torch.nn.SmoothL1Loss(beta=0.5)))
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    back = load_from_checkpoint(WithLoss, tmp_path / "m.ckpt", allow_pickle=("hyper_parameters",))
    assert isinstance(back.hparams.loss, torch.nn.SmoothL1Loss) and back.hparams.loss.beta == 0.5
    with pytest.raises(ts.IncompatibleError, match="saved with pickle"):
        load_from_checkpoint(WithLoss, tmp_path / "m.ckpt")


def test_map_location_is_taken_as_torch_load_takes_it(tmp_path):
    from lightning.pytorch.core.saving import _default_map_location

    module, trainer = _fit_tiny(tmp_path, TrainsnapCheckpointIO(tmp_path / "root"), epochs=1)
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    io = TrainsnapCheckpointIO()
    want = module.state_dict()
    for where in (
        _default_map_location,  # None: keep
        lambda storage, loc: storage,
        lambda storage, loc: storage.cpu(),
        "cpu",
        torch.device("cpu"),
        {"cpu": "cpu"},
        {"cuda:0": "cpu"},
    ):
        got = io.load_checkpoint(tmp_path / "m.ckpt", map_location=where)["state_dict"]
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    back = load_from_checkpoint(Spawned, tmp_path / "m.ckpt", map_location=_default_map_location)
    assert torch.equal(back.net.weight, module.net.weight)


def test_removing_a_checkpoint_that_is_not_a_pointer_removes_the_file_and_rotation_goes_on(
    tmp_path,
):
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    torch.save({"state_dict": {}}, ckpt / "epoch=0-step=0.ckpt")
    io = TrainsnapCheckpointIO(tmp_path / "root")
    io.remove_checkpoint(ckpt / "epoch=0-step=0.ckpt")
    assert not (ckpt / "epoch=0-step=0.ckpt").exists()
    io.remove_checkpoint(ckpt / "epoch=0-step=0.ckpt")  # already gone: nothing to do
    # A run that inherits a torch.save checkpoint in its top-k rotates it out
    torch.save({"state_dict": {}}, ckpt / "old.ckpt")
    checkpoints = ModelCheckpoint(dirpath=ckpt, monitor="loss", save_top_k=1)
    checkpoints.best_k_models = {str(ckpt / "old.ckpt"): torch.tensor(1e9)}
    checkpoints.kth_best_model_path = str(ckpt / "old.ckpt")
    checkpoints.best_model_path = str(ckpt / "old.ckpt")
    _fit_tiny(tmp_path, io, epochs=2, callbacks=[checkpoints], enable_checkpointing=True)
    (left,) = ckpt.glob("*.ckpt")
    assert left.name.startswith("epoch=1") and len(ts.list_snapshots(io.root)) == 1


def test_a_pointer_cannot_redirect_a_delete_or_a_collection_outside_the_plugins_root(tmp_path):
    import json as json_

    victim = tmp_path / "victim"
    info = ts.save({"w": torch.ones(3)}, victim, step=1)
    _module, trainer = _fit_tiny(tmp_path, TrainsnapCheckpointIO(tmp_path / "root"), epochs=1)
    hostile = {"format": "trainsnap.pointer", "root": str(victim), "snapshot": info.id}
    for name in ("removed.ckpt", "overwritten.ckpt"):
        (tmp_path / name).write_text(json_.dumps(hostile))
    io = TrainsnapCheckpointIO(tmp_path / "root")
    io.remove_checkpoint(tmp_path / "removed.ckpt")
    trainer.strategy.checkpoint_io = io
    trainer.save_checkpoint(tmp_path / "overwritten.ckpt")
    assert not (tmp_path / "removed.ckpt").exists()
    assert read_pointer(tmp_path / "overwritten.ckpt")[0] == str(tmp_path / "root")
    assert [s.id for s in ts.list_snapshots(victim)] == [info.id] and ts.verify(victim).ok


def test_pointer_files_are_read_bounded_a_fifo_or_a_huge_file_is_refused_without_waiting(
    tmp_path,
):
    import threading

    io = TrainsnapCheckpointIO(tmp_path / "root")
    os.mkfifo(tmp_path / "fifo.ckpt")
    with open(tmp_path / "huge.ckpt", "wb") as f:
        f.truncate(5 << 30)  # sparse: 5 GiB that would be read whole
    outcome: dict[str, BaseException] = {}

    def attempt() -> None:
        for name in ("fifo.ckpt", "huge.ckpt"):
            try:
                io.load_checkpoint(tmp_path / name)
            except ts.IncompatibleError as e:
                outcome[name] = e

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "reading a FIFO pointer blocked"
    assert "not a regular file" in str(outcome["fifo.ckpt"])
    assert "5368709120 bytes" in str(outcome["huge.ckpt"])
    io.remove_checkpoint(tmp_path / "fifo.ckpt")  # not a pointer: only the file goes
    assert not (tmp_path / "fifo.ckpt").exists()


def test_torch_load_of_a_pointer_says_what_it_is_and_earlier_json_pointers_still_load(tmp_path):
    import json as json_

    module, trainer = _fit_tiny(tmp_path, TrainsnapCheckpointIO(tmp_path / "root"), epochs=1)
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    with pytest.raises(Exception, match="TrainsnapPointerFile"):
        torch.load(tmp_path / "m.ckpt")
    with pytest.raises(Exception, match="TrainsnapPointerFile"):
        Spawned.load_from_checkpoint(tmp_path / "m.ckpt")
    with pytest.raises(ts.IncompatibleError, match="is a trainsnap pointer to snapshot step-"):
        torch.load(tmp_path / "m.ckpt", weights_only=False)
    _root, snapshot = read_pointer(tmp_path / "m.ckpt")
    (tmp_path / "old.ckpt").write_text(
        json_.dumps({"format": "trainsnap.pointer", "root": "root", "snapshot": snapshot})
    )
    back = load_from_checkpoint(Spawned, tmp_path / "old.ckpt")
    assert torch.equal(back.net.weight, module.net.weight)


def test_a_directory_as_ckpt_path_is_refused_without_leaking_its_descriptor(tmp_path):
    """Why: a directory given as ``ckpt_path`` raised a bare ``IsADirectoryError`` naming a
    file-descriptor number, and the descriptor leaked (5 attempts: 6 -> 11 open fds)."""
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    io = TrainsnapCheckpointIO(root=str(tmp_path / "snapshots"))
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with pytest.raises(ts.TrainsnapError, match="a directory") as caught:
            io.load_checkpoint(directory)
        assert str(directory) in str(caught.value)
    assert len(os.listdir("/proc/self/fd")) == before
