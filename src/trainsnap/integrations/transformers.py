"""Snapshots of a Hugging Face ``transformers.Trainer`` run: the Trainer's checkpoints become
trainsnap snapshots, and ``train(resume_from_checkpoint=True)`` restores the newest committed
one. One change to a script::

    from trainsnap.integrations.transformers import TrainsnapTrainer
    trainer = TrainsnapTrainer(model=model, args=args, train_dataset=data)  # was Trainer(...)
    trainer.train(resume_from_checkpoint=True)   # after a crash: the newest committed snapshot

or, for a Trainer subclass of your own (TRL's ``SFTTrainer``, ``Seq2SeqTrainer``)::

    class MyTrainer(TrainsnapMixin, SFTTrainer): ...

The Trainer keeps deciding when to save (``save_strategy``, ``save_steps``, ``save_on_each_node``
aside, and any callback that sets ``control.should_save``); each save is one snapshot, written
asynchronously by a :class:`~trainsnap.CheckpointManager` whose retention is the Trainer's
``save_total_limit`` (``ts.KeepLast``) and, with ``metric_for_best_model``, its best checkpoint
(``ts.KeepBest``). A snapshot holds the whole state: model (plain or DDP; FSDP2's DTensors as
shards), optimizer, scheduler, gradient scaler, the Trainer's ``TrainerState`` (global step,
epoch, log history, best metric, callback states), the loss accumulated since the last log, every
process's RNG, and the data position (:mod:`._transformers_data`): a resume draws the epoch's
order again from the saved state and starts at the position, without walking the batches
before it. The RNG is put back where the Trainer's own resume puts it (after the first batches
of the resumed epoch are fetched), so the resumed run is the uninterrupted one bit for bit.

On another number of processes the RNG, which is per process, cannot follow: the restore
continues at level ``training`` (the same global samples in the same order when the global
batch is the same), and says so in the log and in :attr:`TrainsnapMixin.restored`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import Trainer

from trainsnap.api.options import SaveOptions
from trainsnap.api.snapshots import list_snapshots, load, read
from trainsnap.errors import InvalidArgumentError, NotFoundError
from trainsnap.integrations import _transformers_data as data_position
from trainsnap.manager.checkpoint_manager import CheckpointManager
from trainsnap.manager.options import ManagerOptions
from trainsnap.manager.policies import KeepBest, KeepLast
from trainsnap.protocol.snapshot_info import SnapshotInfo
from trainsnap.state import rng as rng_mod
from trainsnap.state.train_state import TrainState

__all__ = ["TrainsnapArguments", "TrainsnapMixin", "TrainsnapTrainer", "write_config"]

log = logging.getLogger(__name__)

TRAINER_KEY = "trainer"
"""The entry of ``extra`` that holds the Trainer's own state."""
_TOKEN = "trainsnap:"
"""Prefix of the value handed to the Trainer's resume branches in place of a directory."""


@dataclass(kw_only=True)
class TrainsnapArguments:
    """How a :class:`TrainsnapMixin` Trainer keeps its snapshots."""

    root: str | None = None
    """Where the snapshots live (a path or URL); default ``<output_dir>/trainsnap``."""
    interval: Any = None
    """Saves in addition to the Trainer's own schedule (``ts.Every(seconds=...)``,
    ``ts.YoungDaly(...)``); a preemption signal (SIGTERM, SIGUSR1) saves in any case."""
    retention: Any = None
    """What to keep; default: ``save_total_limit`` as ``ts.KeepLast`` (and the best checkpoint
    as ``ts.KeepBest`` when ``metric_for_best_model`` is set), everything when it is None."""
    async_save: bool = True
    """Return from a save once the state is staged; training goes on while it is written."""
    level: str = "strict"
    """The resume level asked for; a restore that cannot give it (another number of
    processes) continues at the highest level it can give, saying why."""
    options: ManagerOptions | None = None
    save_options: SaveOptions | None = None
    storage_options: Mapping[str, Any] | None = None


class _TrainerProgress:
    """The Trainer's state that no torch object holds: ``TrainerState`` (as the JSON the
    Trainer writes) and the loss accumulated since the last log. Loaded by the resume itself
    (:meth:`TrainsnapMixin._init_training_state`), so a load here changes nothing."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer
        # Before the loop starts (a restore's template) the loss counters do not exist yet.
        tr_loss = getattr(trainer, "_tr_loss", None)
        return {
            "state": _state_json(trainer.state),
            "tr_loss": torch.zeros(()) if tr_loss is None else tr_loss.detach().clone(),
            "total_loss": float(getattr(trainer, "_total_loss_scalar", 0.0)),
            "last_logged": int(getattr(trainer, "_globalstep_last_logged", 0)),
            "config": _config_json(trainer.model),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Nothing: the resume read this part before the objects it restores existed."""


_PER_PROCESS = ("is_local_process_zero", "is_world_process_zero")
"""``TrainerState`` fields that differ between processes; the Trainer sets them again on
resume (``init_training_references``), and without them the state is the same on every
process, so it is stored once and follows the run onto another number of processes."""


def _state_json(state: Any) -> str:
    fields = {k: v for k, v in dataclasses.asdict(state).items() if k not in _PER_PROCESS}
    return json.dumps(fields, sort_keys=True)


def _config_json(model: Any) -> str | None:
    config: Any = getattr(getattr(model, "module", model), "config", None)
    return str(config.to_json_string()) if hasattr(config, "to_json_string") else None


class TrainsnapMixin:
    """Put before ``Trainer`` (or a subclass of it) in the bases: its checkpoints become
    trainsnap snapshots. Takes one more keyword, ``trainsnap`` (:class:`TrainsnapArguments`).

    ``train(resume_from_checkpoint=...)`` takes True (the newest committed snapshot), a
    snapshot id, or a step (an int); a directory written by the stock Trainer is refused
    naming the fix. After a resume :attr:`restored` is the :class:`~trainsnap.SnapshotInfo`
    restored (its ``level`` says how much)."""

    # What the Trainer it is mixed into has (annotations only: looked up on the Trainer).
    args: Any
    model: Any
    optimizer: Any
    lr_scheduler: Any
    accelerator: Any
    state: Any
    control: Any
    callback_handler: Any
    hp_search_backend: Any
    _tr_loss: Any
    _total_loss_scalar: Any
    _globalstep_last_logged: Any
    _train_batch_size: Any

    def __init__(self, *args: Any, trainsnap: TrainsnapArguments | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.trainsnap = trainsnap or TrainsnapArguments()
        self.manager: CheckpointManager | None = None
        self.restored: SnapshotInfo | None = None
        self._ts_state: TrainState | None = None
        self._ts_position: data_position.DataPosition | None = None
        self._ts_resume: SnapshotInfo | None = None
        self._ts_progress: Mapping[str, Any] | None = None
        self._ts_rng: dict[str, Any] | None = None
        self._ts_stepped = -1
        self._ts_eval: tuple[int, Mapping[str, float]] | None = None
        self._ts_saves: dict[int, Any] = {}

    # -- where, and with what --------------------------------------------------------------

    @property
    def snapshot_root(self) -> str:
        """The root the snapshots of this Trainer live in."""
        root = self.trainsnap.root
        return root if root is not None else os.path.join(self.args.output_dir, "trainsnap")

    def _ts_retention(self) -> Any:
        if self.trainsnap.retention is not None:
            return self.trainsnap.retention
        limit = self.args.save_total_limit
        if limit is None or limit <= 0:
            return None
        keep: list[Any] = [KeepLast(limit)]
        metric = self.args.metric_for_best_model
        if metric is not None:
            mode = "max" if self.args.greater_is_better else "min"
            keep.append(KeepBest(_eval_name(metric), mode, 1))
        return keep

    def _ts_open(self) -> CheckpointManager:
        if self.manager is None:
            cfg = self.trainsnap
            self.manager = CheckpointManager(
                self.snapshot_root,
                interval=cfg.interval,
                retention=self._ts_retention(),
                async_save=cfg.async_save,
                save_options=cfg.save_options,
                options=cfg.options,
                storage_options=cfg.storage_options,
            )
        return self.manager

    # -- train, resume ---------------------------------------------------------------------

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``, saving snapshots; returns once every save is committed
        (the manager is closed: its lease released, its signal handlers removed)."""
        resume = self._ts_find(resume_from_checkpoint)
        if resume is not None and self.args.auto_find_batch_size:
            # As the Trainer does from trainer_state.json: the batch size the run found.
            found = json.loads(self._ts_read(resume, f"extra.{TRAINER_KEY}.state")["state"])
            if found.get("train_batch_size") is not None:
                self._train_batch_size = found["train_batch_size"]
        manager = self._ts_open()
        self._ts_resume, self.restored = resume, None
        try:
            return super().train(None, *args, **kwargs)  # type: ignore[misc]
        finally:
            self._ts_resume, self.manager = None, None
            manager.close()

    def _ts_read(self, info: SnapshotInfo, *keys: str) -> Any:
        """The entries ``keys`` of snapshot ``info``; ``extra.trainer`` entries come back as
        that dict (O(size of the entries read))."""
        saved = read(
            self.snapshot_root,
            info.id,
            keys=list(keys),
            storage_options=self.trainsnap.storage_options,
        )
        return saved["extra"][TRAINER_KEY] if all(k.startswith("extra.") for k in keys) else saved

    def _ts_find(self, wanted: Any) -> SnapshotInfo | None:
        """The committed snapshot ``resume_from_checkpoint`` names (None: no resume)."""
        if wanted is None or wanted is False:
            return None
        snapshots = list_snapshots(
            self.snapshot_root, storage_options=self.trainsnap.storage_options
        )
        if wanted is True:
            if not snapshots:
                # The Trainer's own words first: scripts (and its tests) match them.
                raise NotFoundError(
                    f"No valid checkpoint found in output directory ({self.args.output_dir}): "
                    f"resume_from_checkpoint=True found no committed snapshot in "
                    f"{self.snapshot_root}; start without resume_from_checkpoint, or set "
                    "TrainsnapArguments(root=...) to the root the run saved to",
                    path=self.snapshot_root,
                )
            return snapshots[-1]
        for info in reversed(snapshots):
            if wanted in (info.id, info.step) or (isinstance(wanted, str) and info.id == wanted):
                return info
        hint = (
            " (a directory written by the stock Trainer: resume it with transformers.Trainer)"
            if isinstance(wanted, str) and os.path.isdir(wanted)
            else ""
        )
        raise NotFoundError(
            f"Can't find a valid checkpoint at {wanted!r}: no committed snapshot of that id or "
            f"step in {self.snapshot_root}{hint}; "
            f"steps held: {[s.step for s in snapshots] or 'none'}",
            path=self.snapshot_root,
        )

    def get_train_dataloader(self) -> Any:
        loader = super().get_train_dataloader()  # type: ignore[misc]
        self._ts_position = data_position.DataPosition(data_position.install(loader))
        return loader

    def _init_training_state(
        self,
        max_steps: int,
        num_update_steps_per_epoch: int,
        num_train_epochs: int,
        resume_from_checkpoint: Any,
        trial: Any,
    ) -> tuple[int, int]:
        """The Trainer's own, then (resuming) its state read from the snapshot, as the Trainer
        does from ``trainer_state.json``: the position is its global step."""
        from transformers.trainer_callback import TrainerState
        from transformers.trainer_utils import compare_trainer_and_checkpoint_args

        out = super()._init_training_state(  # type: ignore[misc]
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        info = self._ts_resume
        if info is None:
            return out  # type: ignore[no-any-return]
        saved = self._ts_read(info, f"extra.{TRAINER_KEY}", "data")
        progress = saved["extra"][TRAINER_KEY]
        self._ts_progress = progress
        if self._ts_position is not None and "data" in saved:
            self._ts_position.load_state_dict(saved["data"])
        self.state = TrainerState(**json.loads(progress["state"]))
        best = self.state.best_model_checkpoint
        if best is not None and self._ts_best_path(self.state.best_global_step) != best:
            log.warning("the best snapshot %s is not held any more; ignoring it", best)
            self.state.best_model_checkpoint = None
        compare_trainer_and_checkpoint_args(self.args, self.state)  # type: ignore[no-untyped-call]
        self._load_callback_state()  # type: ignore[attr-defined]
        epochs = int(self.state.global_step // num_update_steps_per_epoch)
        steps = 0
        if not self.args.ignore_data_skip:
            steps = self.state.global_step % num_update_steps_per_epoch
            steps *= self.args.gradient_accumulation_steps
        self.state.init_training_references(self, max_steps, num_train_epochs, trial)
        return epochs, steps

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any
    ) -> Any:
        """The Trainer's own, then the state of what it made (resuming: restored into it)."""
        model, loader = super()._prepare_for_training(  # type: ignore[misc]
            max_steps, train_dataloader, resume_from_checkpoint
        )
        self._ts_state = self._ts_train_state()
        info = self._ts_resume
        if info is not None:
            assert self.manager is not None
            restored = self.manager.restore(
                self._ts_state, self.trainsnap.level, allow_downgrade=True, step=info.step
            )
            assert restored is not None
            self.restored = restored
            # Put back at the Trainer's own RNG point: after the resumed epoch's first fetch.
            self._ts_rng = rng_mod.capture() if restored.level == "strict" else None
            log.info("resumed from snapshot %s at level %r", restored.id, restored.level)
        return model, loader

    def _ts_train_state(self) -> TrainState:
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        scheduler = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)
        return TrainState(
            model=self.model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=getattr(self.accelerator, "scaler", None),
            dataloader=self._ts_position,
            extra={TRAINER_KEY: _TrainerProgress(self)},
        )

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        if self._ts_position is not None:
            self._ts_position.epoch = kwargs["epoch"]
        if self._ts_resume is not None:
            if self._ts_progress is not None:  # the loss since the last log, once
                progress, self._ts_progress = self._ts_progress, None
                self._tr_loss = progress["tr_loss"].to(self._tr_loss.device)
                self._total_loss_scalar = progress["total_loss"]
                self._globalstep_last_logged = progress["last_logged"]
            kwargs["resume_from_checkpoint"] = _TOKEN + self._ts_resume.id
        return super()._run_epoch(*args, **kwargs)  # type: ignore[misc]

    def get_resumed_dataloader(self, dataloader: Any, num_batches: int) -> Any:
        """The loader starting ``num_batches`` into the restored epoch, without walking them
        (see :mod:`._transformers_data`); where it cannot start there directly, accelerate's
        ``skip_first_batches`` walks their indices, over the restored order."""
        position = self._ts_position
        if self._ts_resume is None or position is None:
            return super().get_resumed_dataloader(dataloader, num_batches)  # type: ignore[misc]
        if position.resume(dataloader, num_batches):
            return dataloader
        position.rewind()
        return super().get_resumed_dataloader(dataloader, num_batches)  # type: ignore[misc]

    def _load_rng_state(self, checkpoint: Any) -> None:
        if not (isinstance(checkpoint, str) and checkpoint.startswith(_TOKEN)):
            super()._load_rng_state(checkpoint)  # type: ignore[misc]
            return
        if self._ts_rng is not None:
            rng_mod.restore(self._ts_rng)

    # -- save ------------------------------------------------------------------------------

    def _determine_best_metric(self, metrics: dict[str, float], trial: Any) -> bool:
        self._ts_eval = (self.state.global_step, dict(metrics))
        return super()._determine_best_metric(metrics, trial)  # type: ignore[misc,no-any-return]

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """A snapshot of the whole state at this step, in place of the ``checkpoint-N``
        directory; asynchronous, so training goes on while it is written."""
        from transformers.trainer_callback import ExportableState

        if self.hp_search_backend is None and trial is None:
            self.store_flos()  # type: ignore[attr-defined]
        state = self.state
        if state.best_global_step:
            state.best_model_checkpoint = self._ts_best_path(state.best_global_step)
        callbacks = [*self.callback_handler.callbacks, self.control]
        for cb in [cb for cb in callbacks if isinstance(cb, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(state.stateful_callbacks[name], list):
                state.stateful_callbacks[name].append(cb.state())
            else:
                state.stateful_callbacks[name] = cb.state()
        self._ts_save(self._ts_open().save)

    def _ts_save(self, save: Any) -> Any:
        step = self.state.global_step
        metrics = None
        if self._ts_eval is not None and self._ts_eval[0] == step:
            metrics = {k: v for k, v in self._ts_eval[1].items() if isinstance(v, int | float)}
        assert self._ts_state is not None
        handle = save(step, self._ts_state, metrics=metrics)
        if handle is not None:
            self._ts_saves[step] = handle
        self._ts_stepped = step
        return handle

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        super()._maybe_log_save_evaluate(*args, **kwargs)  # type: ignore[misc]
        step = self.state.global_step
        if self._ts_state is None or step == self._ts_stepped:
            return
        manager = self._ts_open()
        self._ts_stepped = step
        if manager.step(step, self._ts_state):
            self._ts_saves[step] = True
        if manager.preempted:
            self.control.should_training_stop = True

    # -- the best checkpoint ---------------------------------------------------------------

    def _ts_best_path(self, step: int | None) -> str | None:
        """The snapshot of ``step`` as ``<root>/snapshots/<id>``, once committed (None: not
        saved, or not yet committed)."""
        if not step:
            return None
        handle = self._ts_saves.get(step)
        if handle is not None and hasattr(handle, "done") and not handle.done():
            return None
        for info in reversed(
            list_snapshots(self.snapshot_root, storage_options=self.trainsnap.storage_options)
        ):
            if info.step == step:
                return os.path.join(self.snapshot_root, "snapshots", info.id)
        return None

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        if self.manager is not None:
            self.manager.wait()  # the best snapshot may be the one in flight
        if self.state.best_global_step:
            found = self._ts_best_path(self.state.best_global_step)
            self.state.best_model_checkpoint = found or self.state.best_model_checkpoint
        return super()._finalize_training(*args, **kwargs)  # type: ignore[misc]

    def _load_best_model(self) -> None:
        """The best snapshot's weights into the model (every process takes part)."""
        best = self.state.best_model_checkpoint
        assert best is not None
        snapshot = os.path.basename(best)
        log.info(
            "loading the best model from snapshot %s (score %s)", snapshot, self.state.best_metric
        )
        load(
            TrainState(model=self.model, rng=False),
            self.snapshot_root,
            snapshot=snapshot,
            level="weights",
            storage_options=self.trainsnap.storage_options,
        )

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        raise InvalidArgumentError(
            f"{type(self).__name__} resumes from trainsnap snapshots, not from the directory "
            f"{resume_from_checkpoint!r}: pass resume_from_checkpoint=True (the newest), a "
            "snapshot id or a step; a stock checkpoint directory resumes with transformers.Trainer"
        )


def _eval_name(metric: str) -> str:
    return metric if metric.startswith("eval_") else f"eval_{metric}"


def write_config(root: str, snapshot: str, out_dir: str | os.PathLike[str]) -> str:
    """Write the ``config.json`` that snapshot ``snapshot`` (an id or ``"latest"``) of ``root``
    recorded into ``out_dir``: next to the weights ``trainsnap export ROOT ID OUT --format
    safetensors`` writes, ``from_pretrained(out_dir)`` loads the model. Returns the file."""
    saved = read(root, snapshot, keys=f"extra.{TRAINER_KEY}.config")["extra"][TRAINER_KEY]
    if saved.get("config") is None:
        raise InvalidArgumentError(
            f"snapshot {snapshot} of {root} recorded no model config (the model has no "
            "`config`); write config.json next to the exported weights yourself",
            snapshot_id=snapshot,
        )
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(os.fspath(out_dir), "config.json")
    with open(path, "w", encoding="utf-8") as f:
        f.write(saved["config"])
    return path


class TrainsnapTrainer(TrainsnapMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints are trainsnap snapshots (see
    :class:`TrainsnapMixin`)."""
