# torchtitan ships no type information (no py.typed): its classes are Any to mypy.
# mypy: disallow_subclassing_any=False
"""torchtitan's checkpointer, backed by trainsnap: :class:`TrainsnapCheckpointManager`.

torchtitan (0.3) builds its checkpointer from the trainer config's ``checkpoint`` field: whatever
``BaseCheckpointManager.Config`` subclass is there builds its owner class. Enable trainsnap in a
config function (a ``config_registry`` entry returning ``Trainer.Config``) with one line::

    from trainsnap.integrations.torchtitan import TrainsnapCheckpointManager

    checkpoint=TrainsnapCheckpointManager.Config(enable=True, folder="s3://bucket/run"),

``folder`` is any trainsnap root (a path relative to the dump folder, an absolute path,
``file://``, ``s3://``, ``memory://``). The other fields keep torchtitan's meaning (the
Hugging Face ones are refused, naming ``trainsnap export``); ``async_mode`` (default
``"async"``), ``compression`` and ``resume_level`` are this backend's.

What a snapshot holds, as a :class:`~trainsnap.TrainState`: the model through torchtitan's
``ModelWrapper`` (FQN-keyed DTensors, reshardable), the ``OptimizersContainer``'s flat
``state.{fqn}.{name}`` dict, the ``LRSchedulersContainer``, the dataloader's state, the
trainer's ``states`` (``train_state``: step and tokens seen) and the RNG of every rank, which
torchtitan's own backends do not save. A resume on the mesh that saved is ``strict``: the same
trajectory, bitwise. (The RNG continues exactly where it was saved only if nothing draws from
it between the load and the first step: torch's ``DataLoader`` draws each new iterator's base
seed from it, and the trainer makes its data iterator after the load; give the dataloader its
own ``generator=torch.Generator()`` when the step uses randomness, e.g. dropout.)

On another mesh the model, optimizer, schedule and train state reshard, but two things are per
rank and cannot: the RNG (a rank restores its own; trainsnap refuses it on another world size)
and torchtitan's dataloader state, saved per data-parallel rank (``dp_rank_N``) and only
meaningful on the same data-parallel degree. Such a resume is refused with the fix named:
``resume_level="training"`` (everything else, resharded; RNG and data start afresh) or
``exclude_from_loading=["dataloader"]`` (the rest strictly; position the data yourself).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools import filesystem

import trainsnap as ts
from trainsnap.errors import IncompatibleError, InvalidArgumentError, NotFoundError
from trainsnap.format.manifest import check_level, level_rank
from trainsnap.state.capture import is_stateful

__all__ = ["TrainsnapCheckpointManager"]

log = logging.getLogger(__name__)

COMPRESSIONS = ("zstd", "bytegroup+zstd")
_DATA_KEY = "data.world_size"
"""The key an error about the dataloader's data-parallel degree names."""


class TrainsnapCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager contract, saving and restoring through trainsnap.

    Saves every ``interval`` steps (and the first or last step, as configured) through a
    :class:`~trainsnap.CheckpointManager`: asynchronously by default (``save`` returns once the
    state is staged, so ``maybe_wait_for_staging`` has nothing to wait for), keeping the
    ``keep_latest_k`` newest snapshots and collecting the objects no snapshot references.
    ``load`` restores the newest committed snapshot that loads (falling back past damaged
    ones), the one of ``step``, or else ``initial_load_path``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """torchtitan's checkpoint fields (``folder`` is any trainsnap root), and trainsnap's."""

        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "async"
        """``"async"``: a save returns once staged into reused host buffers and commits in the
        background (``"async_with_pinned_mem"`` is the same: trainsnap's staging pool keeps its
        buffers); ``"disabled"``: a save returns once committed."""

        compression: str | None = None
        """Lossless compression of tensor data: ``"zstd"`` or ``"bytegroup+zstd"``."""

        local_folder: str = ""
        """A fast local tier (node NVMe, a RAM disk; relative to the dump folder like
        ``folder``): every ``local_interval`` steps a snapshot goes there only, and each
        durable save is promoted from it in the background. Empty: no local tier."""

        local_interval: int = 0
        """Steps between local-tier saves (with ``local_folder``)."""

        resume_level: Literal["strict", "training", "weights"] = "strict"
        """What a resume must restore. ``"strict"``: everything, the same trajectory; refused,
        naming the change, on a mesh where per-rank RNG or dataloader state cannot mean the
        same. ``"training"``: model, optimizer, LR schedule and train state, resharded onto any
        mesh; RNG and dataloader start afresh. ``"weights"``: the model only."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            if self.async_mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise InvalidArgumentError(f"Invalid async_mode: {self.async_mode!r}")
            if self.compression is not None and self.compression not in COMPRESSIONS:
                raise InvalidArgumentError(
                    f"compression must be one of {COMPRESSIONS} or None, got {self.compression!r}"
                )
            if bool(self.local_folder) != (self.local_interval > 0):
                raise InvalidArgumentError(
                    "local_folder and local_interval go together: a local tier needs both (got "
                    f"local_folder={self.local_folder!r}, local_interval={self.local_interval})"
                )
            check_level(self.resume_level, "resume_level")
            if self.initial_load_in_hf or self.last_save_in_hf:
                raise InvalidArgumentError(
                    "TrainsnapCheckpointManager stores trainsnap snapshots, not Hugging Face "
                    "safetensors: export a snapshot's model with `trainsnap export ROOT ID OUT "
                    "--format safetensors`; to start from HF weights, make the first run's "
                    "initial_load_path a DCP checkpoint (or use torchtitan's DCP backend for it)"
                )

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future: Future[ts.SnapshotInfo] | None = None
        self.config = config
        self.root = filesystem.join(base_folder, config.folder)
        self.model = ModelWrapper(model_parts)
        self.optimizers = optimizers
        self.lr_schedulers = lr_schedulers
        self.dataloader = dataloader
        self.states = states
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.loaded: ts.SnapshotInfo | None = None
        """The snapshot the last ``load`` restored (its ``level`` is the level reached)."""
        self.manager: ts.CheckpointManager | None = None
        if not config.load_only:  # a load-only job must not take the root's writer lease
            self.manager = ts.CheckpointManager(
                self.root,
                retention=ts.KeepLast(config.keep_latest_k) if config.keep_latest_k else None,
                async_save=config.async_mode != "disabled",
                save_options=ts.SaveOptions(compression=config.compression),
                local=(
                    ts.LocalTier(root=filesystem.join(base_folder, config.local_folder))
                    if config.local_folder
                    else None
                ),
                # torchtitan's loop never asks whether a signal asked it to stop
                options=ts.ManagerOptions(preemption_signals=()),
            )
        log.info(
            "trainsnap checkpointing active: snapshots are saved to and loaded from %s", self.root
        )

    # -- what a snapshot holds ----------------------------------------------------------------

    def _train_state(self) -> ts.TrainState:
        """The whole state, as saved."""
        extra = {k: v.state_dict() if is_stateful(v) else v for k, v in self.states.items()}
        tokens = extra.get("train_state", {}).get("ntokens_seen")
        if isinstance(tokens, int):
            extra["tokens_seen"] = tokens  # recorded in the manifest and listings
        return ts.TrainState(
            model=self.model,
            optimizer=self.optimizers,
            scheduler=self.lr_schedulers,
            dataloader=self.dataloader,
            extra=extra or None,
        )

    def _load_state(self) -> _LoadState:
        """What a load restores: all but ``exclude_from_loading``; the trainer's states come
        back into ``extra`` and are given to their objects once every rank has loaded."""
        excluded = set(self.config.exclude_from_loading)
        unknown = excluded - {OPTIMIZER, LR_SCHEDULER, DATALOADER, *self.states}
        if unknown:
            raise InvalidArgumentError(f"{sorted(unknown)} not found in state_dict.")
        kept = [k for k in self.states if k not in excluded]
        data = None
        if self.dataloader is not None and DATALOADER not in excluded:
            data = _DataLoaderState(self.dataloader)
        return _LoadState(
            model=self.model,
            optimizer=None if OPTIMIZER in excluded else self.optimizers,
            scheduler=None if LR_SCHEDULER in excluded else self.lr_schedulers,
            dataloader=data,
            extra={} if kept else None,
            data=data,
            # Excluding the dataloader means the user positions the data: no order to restore.
            no_data_order=data is None,
        )

    def _model_only(self) -> ts.TrainState:
        """The model alone, in ``export_dtype``: the final (``last_save_model_only``) or seed
        snapshot, a ``weights``-level one."""
        return ts.TrainState(model=_ExportedModel(self.model, self.export_dtype), rng=False)

    # -- saving -------------------------------------------------------------------------------

    def _tier_due(self, curr_step: int, last_step: bool) -> str | None:
        """``"durable"``, ``"local"`` (the local tier only) or None: whether to save now."""
        if self.manager is None:
            return None
        if curr_step == 1 and self.config.enable_first_step_checkpoint:
            return "durable"
        if last_step or curr_step % self.config.interval == 0:
            return "durable"
        local = self.config.local_interval
        return "local" if local and curr_step % local == 0 else None

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        tier = self._tier_due(curr_step, last_step)
        if tier is None:
            return False
        assert self.manager is not None
        begin = time.monotonic()
        if last_step and self.config.last_save_model_only:
            result = self.manager.save(curr_step, self._model_only())
        else:
            result = self.manager.save(curr_step, self._train_state(), tier=tier)
        if isinstance(result, ts.SaveHandle):
            self.save_future = _future_of(result)
        if last_step:  # the trainer exits next: the last save must be committed first
            self.manager.wait()
        log.info(
            "step %d: %s the trainsnap snapshot (%s) in %.2f s",
            curr_step,
            "staged" if isinstance(result, ts.SaveHandle) and not last_step else "saved",
            tier,
            time.monotonic() - begin,
        )
        return True

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: an asynchronous save returns only once its state is staged."""

    def _wait_for_saving(self) -> None:
        assert self.manager is not None
        self.manager.wait()
        self.save_future = None

    def _close(self) -> None:
        if self.manager is not None:
            self.manager.close()

    # -- loading ------------------------------------------------------------------------------

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        begin = time.monotonic()
        state = self._load_state()
        wanted = None if step == -1 else step
        info = self._restore(state, self.config.resume_level, wanted)
        if info is None:  # only model-only snapshots (a seed checkpoint, a final export)
            info = self._restore(ts.TrainState(model=self.model, rng=False), "weights", wanted)
        if info is None:
            if wanted is not None:
                raise NotFoundError(
                    f"checkpoint.load_step={step}: {self.root} holds no committed snapshot of "
                    "that step; `trainsnap ls` lists the steps it holds",
                    path=self.root,
                )
            return self._initial_load()
        self._give_back(state)
        self.loaded = info
        if info.level != "strict":
            log.warning(
                "resumed snapshot %s at level %r: the RNG%s start afresh",
                info.id,
                info.level,
                " and the dataloader" if self.dataloader is not None else "",
            )
        log.info(
            "loaded snapshot %s (step %d, level %s) in %.2f s",
            info.id,
            info.step,
            info.level,
            time.monotonic() - begin,
        )
        return True

    def _give_back(self, state: ts.TrainState) -> None:
        """The trainer's states, loaded into ``extra``, to their objects (after every rank
        loaded: a refused load leaves them as they were)."""
        for key, value in state.extra.items():
            if key not in self.states or key in self.config.exclude_from_loading:
                continue  # e.g. tokens_seen, recorded for the manifest
            if is_stateful(self.states[key]):
                self.states[key].load_state_dict(value)
            else:
                self.states[key] = value

    def _restore(
        self, state: ts.TrainState, level: str, step: int | None
    ) -> ts.SnapshotInfo | None:
        """The newest snapshot (of ``step``) that gives ``level``, restored; None when none
        does. A refusal names the torchtitan fields that fix it."""
        try:
            if self.manager is not None:
                return self.manager.restore(state, level, step=step)
            return self._load_read_only(state, level, step)
        except NotFoundError:
            if step is None:
                raise
            return None  # none of that step gives this level; the caller tries the next
        except IncompatibleError as e:
            if e.key == _DATA_KEY:
                raise
            raise IncompatibleError(
                f"{e.message} In torchtitan: resume on the mesh that saved it, or set "
                "checkpoint.resume_level='training' to reshard the model, optimizer, LR schedule "
                "and train state onto this one (RNG and dataloader then start afresh); "
                "checkpoint.exclude_from_loading leaves states out.",
                snapshot_id=e.snapshot_id,
                key=e.key,
                problems=e.problems,
            ) from e

    def _load_read_only(
        self, state: ts.TrainState, level: str, step: int | None
    ) -> ts.SnapshotInfo | None:
        """A ``load_only`` job's restore: no manager (it would take the writer lease)."""
        found = [
            s
            for s in ts.list_snapshots(self.root)
            if level_rank(s.level) >= level_rank(level) and step in (None, s.step)
        ]
        if not found:
            return None
        return ts.load(state, self.root, snapshot=found[-1].id, level=level)

    def _initial_load(self) -> bool:
        """With no snapshot in ``folder``: ``initial_load_path``, a trainsnap root or a DCP
        checkpoint directory (as torchtitan's DCP backend writes one), or a fresh start."""
        path = self.config.initial_load_path
        if not path:
            log.info("no snapshot in %s and no initial_load_path: a fresh start", self.root)
            return False
        model_only = self.config.initial_load_model_only
        if ts.list_snapshots(path):
            state = ts.TrainState(model=self.model, rng=False) if model_only else self._load_state()
            info = ts.load(state, path, level="weights" if model_only else "training")
            self._give_back(state)
            log.info("initial load: snapshot %s of %s at level %s", info.id, path, info.level)
            return True
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        from trainsnap.integrations.dcp_metadata import safe_planner, safe_reader

        if not filesystem.isdir(path):
            raise InvalidArgumentError(f"Checkpoint.initial_load_path is invalid: {path}")
        # torchtitan's DCP layout: model FQNs at the top, every other state under its name.
        sd = dict(self.model.state_dict())
        if not model_only:
            others = {
                OPTIMIZER: self.optimizers,
                LR_SCHEDULER: self.lr_schedulers,
                DATALOADER: self.dataloader,
                **self.states,
            }
            sd.update(
                (k, v)
                for k, v in others.items()
                if v is not None and k not in self.config.exclude_from_loading
            )
        dcp_load(sd, checkpoint_id=path, storage_reader=safe_reader(path), planner=safe_planner())
        self.model.load_state_dict(sd)
        log.info("initial load: DCP checkpoint %s (model only: %s)", path, model_only)
        return True


class _LoadState(ts.TrainState):
    """The state a load fills, refusing before anything is applied, on every rank, a
    dataloader state saved on another data-parallel degree."""

    def __init__(self, *, data: _DataLoaderState | None, **parts: Any) -> None:
        super().__init__(**parts)
        self.data = data

    def check_loaded(self, tree: dict[str, Any]) -> None:
        super().check_loaded(tree)
        if self.data is not None and "data" in tree:
            self.data.check(tree["data"])


class _DataLoaderState:
    """torchtitan's dataloader as a load sees it.

    Its state dict is ``{"dp_rank_N": bytes, "world_size": dp}``: each data-parallel rank saves
    its own key (tensor-parallel peers hold the same bytes, stored once), so the snapshot holds
    every dp rank's state. The load template is empty, so the whole saved subtree comes back,
    and the loader picks its own key -- only on the data-parallel degree that saved it: its
    cursors cannot be resharded."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        return {}

    def check(self, saved: Any) -> None:
        degree = getattr(self.loader, "dp_world_size", None)
        rank = getattr(self.loader, "dp_rank", None)
        if degree is None or not isinstance(saved, Mapping) or not saved:
            return  # not torchtitan's per-dp-rank layout: the loader decides
        was = saved.get("world_size")
        if was != degree or f"dp_rank_{rank}" not in saved:
            raise IncompatibleError(
                f"the dataloader state was saved per data-parallel rank on {was} dp rank(s); "
                f"this job has {degree}, and torchtitan's dataloader cannot be resharded. Resume "
                f"with a data-parallel degree of {was}; or set "
                "checkpoint.exclude_from_loading=['dataloader'] to restore everything else "
                "strictly and position the data yourself; or "
                "checkpoint.resume_level='training' (RNG and data start afresh).",
                key=_DATA_KEY,
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict)


class _ExportedModel:
    """The model's state dict with its floating tensors in ``dtype`` (a model-only export)."""

    def __init__(self, model: ModelWrapper, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype

    def state_dict(self) -> dict[str, Any]:
        return {
            k: v.to(self.dtype)
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != self.dtype
            else v
            for k, v in self.model.state_dict().items()
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.model.load_state_dict(state_dict)


def _future_of(handle: ts.SaveHandle) -> Future[ts.SnapshotInfo]:
    """A ``concurrent.futures.Future`` of an asynchronous save (torchtitan's ``save_future``)."""
    future: Future[ts.SnapshotInfo] = Future()

    def settle(done: ts.SaveHandle) -> None:
        try:
            future.set_result(done.wait())
        except BaseException as e:  # the save's own error, kept for whoever waits
            future.set_exception(e)

    handle.add_done_callback(settle)
    return future
