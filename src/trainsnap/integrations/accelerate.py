"""Snapshots of a run trained with Hugging Face accelerate: one :class:`~trainsnap.TrainState`
from what the accelerator has prepared. Call it after ``accelerator.prepare``, then use the
manager as usual::

    state = train_state(accelerator)
    restored = mgr.restore(state)  # mgr = ts.CheckpointManager(root, interval=ts.Every(steps=100))
    ... mgr.step(step, state) after each optimizer step ...

It reads what accelerate's own ``save_state`` saves and puts each piece where a TrainState keeps
it: the prepared models and optimizers (unwrapped from ``AcceleratedOptimizer``, so they go
through torch's state-dict machinery: FQN-keyed, reshardable), the schedulers (unwrapped from
``AcceleratedScheduler``), the ``GradScaler``, the dataloaders as the data cursor, and, in
``extra["accelerate"]``, the accelerator's step counter and every object registered with
``accelerator.register_for_checkpointing``. What it cannot capture exactly it refuses, naming
the fix: plain dataloaders (accelerate does not track their position), shuffling without
accelerate's seedable sampler (nothing keeps the epoch's order), several models without one
optimizer each, DeepSpeed and Megatron-LM (their engines keep the state).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from trainsnap.errors import IncompatibleError, InvalidArgumentError
from trainsnap.state.train_state import TrainState

__all__ = ["train_state"]

EXTRA_KEY = "accelerate"
"""The entry of ``extra`` that holds the accelerator's step counter and registered objects."""


def train_state(
    accelerator: Any,
    *,
    extra: dict[str, Any] | None = None,
    rng: bool = True,
    versions: Mapping[str, Any] | None = None,
    grads: bool = False,
) -> TrainState:
    """The whole training state of ``accelerator`` (an ``accelerate.Accelerator``) as a
    :class:`~trainsnap.TrainState`, to save and restore with :class:`~trainsnap.CheckpointManager`.

    Build it once after ``accelerator.prepare(...)`` (and after ``register_for_checkpointing``):
    it holds the objects, not copies, so each save takes their state at that moment and a restore
    puts it back into them.

    Args:
        accelerator: the accelerator whose prepared objects to capture.
        extra: your own plain data (``tokens_seen``...), filled in place on restore; it gets one
            more entry, ``"accelerate"`` (the step counter and the registered objects).
        rng: capture the RNG of Python, NumPy, torch CPU and CUDA on each process.
        versions: model, tokenizer, code, data versions; a change refuses a strict resume.
        grads: also save the parameters' ``.grad`` (a save in the middle of accumulation).
    """
    from accelerate.utils import DistributedType

    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise InvalidArgumentError(
            f"trainsnap.integrations.accelerate: with {accelerator.distributed_type.value} the "
            "model and optimizer state live in its engine, not in torch modules; use "
            "accelerator.save_state()/load_state() for this run"
        )
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise InvalidArgumentError("train_state: extra must be a dict")
    if EXTRA_KEY in extra:
        raise InvalidArgumentError(
            f"train_state: extra already has the key {EXTRA_KEY!r}, which holds the "
            "accelerator's step counter and registered objects; rename your entry"
        )
    model, optimizer = _models_and_optimizers(accelerator)
    schedulers = [getattr(s, "scheduler", s) for s in accelerator._schedulers]
    loaders = list(accelerator._dataloaders)
    extra[EXTRA_KEY] = _Registered(accelerator)
    return TrainState(
        model=model,
        optimizer=optimizer,
        scheduler=schedulers or None,
        scaler=accelerator.scaler,
        dataloader=_Dataloaders(loaders, accelerator) if loaders else None,
        extra=extra,
        rng=rng,
        versions=versions,
        grads=grads,
    )


def _models_and_optimizers(accelerator: Any) -> tuple[Any, Any]:
    """The prepared models and their torch optimizers, paired by the parameters they update:
    one model with any number of optimizers, or several models with one optimizer each."""
    models: list[torch.nn.Module] = list(accelerator._models)
    optimizers = [getattr(o, "optimizer", o) for o in accelerator._optimizers]
    if not models:
        if optimizers:
            raise InvalidArgumentError(
                "train_state: the accelerator prepared optimizers but no model; prepare the "
                "model too (accelerator.prepare(model, optimizer, ...))"
            )
        return None, None
    owners = [_owner(models, opt, i) for i, opt in enumerate(optimizers)]
    if len(models) == 1:
        return models[0], optimizers or None
    paired = {
        str(m): [i for i, owner in enumerate(owners) if owner == m] for m in range(len(models))
    }
    wrong = {m: opts for m, opts in paired.items() if len(opts) != 1}
    if wrong:
        m, opts = next(iter(wrong.items()))
        raise InvalidArgumentError(
            f"train_state: the accelerator prepared {len(models)} models and model {m} has "
            f"{len(opts)} optimizers; with several models each needs exactly one optimizer "
            "over its parameters. Prepare one optimizer per model (a frozen model needs none: "
            "leave it out of accelerator.prepare)"
        )
    model = {m: models[int(m)] for m in paired}
    return model, {m: optimizers[opts[0]] for m, opts in paired.items()}


def _owner(models: Sequence[torch.nn.Module], optimizer: torch.optim.Optimizer, index: int) -> int:
    """The index of the one model whose parameters ``optimizer`` updates."""
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    owners = [m for m, model in enumerate(models) if wanted <= {id(p) for p in model.parameters()}]
    if len(owners) != 1:
        raise InvalidArgumentError(
            f"train_state: optimizer {index} updates parameters that "
            f"{'no single prepared model holds' if not owners else 'several prepared models hold'}"
            ", so its state cannot be keyed by parameter name; give each optimizer the "
            "parameters of one model and prepare that model with it"
        )
    return owners[0]


class _Dataloaders:
    """The prepared dataloaders' cursors, each as exact as a resume needs it to be.

    An entry holds the loader's own state (torchdata's ``StatefulDataLoader``: position and
    workers), its epoch counter and the seed of accelerate's seedable sampler (together they fix
    the epoch's order) and the process it belongs to: a shard's position means the same only on
    the same process of as many, so the entry is per process."""

    def __init__(self, loaders: list[Any], accelerator: Any) -> None:
        for i, dl in enumerate(loaders):
            _check_resumable(i, dl)
        self.loaders = loaders
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        return {str(i): self._cursor(dl) for i, dl in enumerate(self.loaders)}

    def _cursor(self, dl: Any) -> dict[str, Any]:
        state = dl.state_dict()
        # accelerate counts the epoch up only once its loop has asked past the last batch. A
        # cursor taken at the last batch, the loop still running, resumes in the next epoch,
        # whose order that count seeds; one taken after the loop exited (the loader is then no
        # longer among the active ones) has been counted already.
        finished = bool(state.get("_iterator_finished"))
        epoch = getattr(dl, "iteration", 0) + (finished and _iterating(dl))
        return {
            "process": self.accelerator.process_index,
            "processes": self.accelerator.num_processes,
            "epoch": epoch,
            "seed": getattr(_sampler(dl), "initial_seed", None),
            "state": state,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        _same_keys("dataloaders", state_dict, len(self.loaders))
        for i, dl in enumerate(self.loaders):
            saved = state_dict[str(i)]
            if saved["processes"] != self.accelerator.num_processes:
                raise IncompatibleError(
                    f"dataloader {i} was saved on {saved['processes']} processes and this run "
                    f"has {self.accelerator.num_processes}: its shard's position means nothing "
                    "here. Resume on as many processes, or restore with level='training'"
                )
            if not _already_there(dl, saved):
                dl.load_state_dict(saved["state"])
                # Start the resumed iterator now, while the RNG is not yet restored (a
                # TrainState restores it last): starting one draws from torch's generator,
                # which the uninterrupted run did at the start of the epoch, not at this step.
                dl.base_dataloader.state_dict()
            if hasattr(dl, "iteration"):
                dl.iteration = saved["epoch"]
            if saved["seed"] is not None:
                _sampler(dl).initial_seed = saved["seed"]


def _already_there(dl: Any, saved: Mapping[str, Any]) -> bool:
    """Whether ``dl`` is a fresh loader and ``saved`` the state of one that had yielded nothing
    in the same epoch: loading it would change nothing but the order, so ``dl`` is left as it
    is. O(1): no worker is asked anything.

    accelerate starts a prepared loader's iterator when it creates the loader (for its state),
    with workers drawing the first batches' indices from the sampler it was given, before it
    puts its seedable sampler in; the uninterrupted run's first epoch is that order. A restored
    iterator draws from the seedable sampler: another order, which no saved state can bring
    back. The fresh loader's own iterator draws what the uninterrupted one drew when the resumed
    run prepares its loaders as the first run did (the same seed set before ``prepare``: that
    first order is drawn from torch's generator then, and recorded nowhere), and it was started
    before the RNG is restored, so the loop's ``iter()`` draws nothing."""
    base = dl.base_dataloader
    fresh = base._iterator is not None and bool(base._initial_iter_for_state_dict)
    return fresh and _unstarted(saved["state"]) and saved["epoch"] == getattr(dl, "iteration", 0)


def _unstarted(state: Mapping[str, Any]) -> bool:
    """Whether a torchdata loader state is that of an iterator that has yielded nothing."""
    if state.get("_iterator_finished"):
        return False
    if "_snapshot" in state:  # with workers
        snapshot = state["_snapshot"]
        return bool(snapshot.get("_snapshot_step") == 0 and state["_steps_since_snapshot"] == 0)
    return bool(state.get("_num_yielded") == 0)


def _iterating(dl: Any) -> bool:
    """Whether a loop over ``dl`` is running: accelerate registers a loader with its gradient
    state when its iteration begins and removes it when the iteration ends."""
    gradient_state = getattr(dl, "gradient_state", None)
    if gradient_state is None:
        return True  # cannot tell: keep the count of a cursor taken inside the loop
    return any(ref is dl for ref in gradient_state.dataloader_references)


def _check_resumable(index: int, dl: Any) -> None:
    """Refuse a loader whose position, or whose order, a cursor cannot bring back."""
    from accelerate.data_loader import SeedableRandomSampler

    if not getattr(dl, "use_stateful_dataloader", False):
        raise InvalidArgumentError(
            f"train_state: prepared dataloader {index} is a plain DataLoader, whose position "
            "accelerate does not track, so a resume could not continue its data where it "
            "stopped. Create the Accelerator with dataloader_config=DataLoaderConfiguration("
            "use_stateful_dataloader=True, use_seedable_sampler=True) (needs torchdata)"
        )
    sampler = _sampler(dl)
    if hasattr(sampler, "generator") and not isinstance(sampler, SeedableRandomSampler):
        raise InvalidArgumentError(
            f"train_state: prepared dataloader {index} shuffles with a "
            f"{type(sampler).__name__} that draws each epoch's order from a generator whose "
            "state at the start of the epoch is kept nowhere, so a resume in the middle of an "
            "epoch would see another order. Create the Accelerator with dataloader_config="
            "DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True) "
            "(it reseeds a RandomSampler, shuffle=True, from the epoch)"
        )


def _sampler(dl: Any) -> Any:
    """The sampler under accelerate's batch sampler shard (``get_sampler`` misses it there)."""
    node = dl.batch_sampler if dl.batch_sampler is not None else dl.sampler
    while hasattr(node, "batch_sampler"):
        node = node.batch_sampler
    return getattr(node, "sampler", node)


class _Registered:
    """The accelerator's gradient-accumulation step counter and the objects registered with
    ``register_for_checkpointing``, in registration order, as accelerate's ``save_state``
    saves them."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        objects = self.accelerator._custom_objects
        return {
            "step": self.accelerator.step,
            "registered": {str(i): obj.state_dict() for i, obj in enumerate(objects)},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        objects = self.accelerator._custom_objects
        _same_keys("registered objects", state_dict["registered"], len(objects))
        for i, obj in enumerate(objects):
            obj.load_state_dict(state_dict["registered"][str(i)])
        self.accelerator.step = state_dict["step"]


def _same_keys(what: str, saved: Mapping[str, Any], count: int) -> None:
    if set(saved) != {str(i) for i in range(count)}:
        raise IncompatibleError(
            f"the snapshot holds {len(saved)} {what} and the accelerator has {count}; restore "
            "into a run that prepares (or registers) the same objects in the same order"
        )
