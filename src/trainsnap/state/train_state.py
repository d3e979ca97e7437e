"""The whole training state, and resume levels.

A :class:`TrainState` holds what a training run needs to continue the same trajectory: model,
optimizer(s), scheduler(s), gradient scaler, data cursor, RNG, extra plain data and, when asked,
the gradients of an unfinished accumulation. Model and optimizers go through
``torch.distributed.checkpoint.state_dict`` so that DDP, FSDP2/DTensor and compiled models give
FQN-keyed, reshardable state and optimizer state keyed by parameter name.

Resume levels say how much of it a restore gives back:

* ``weights``: the model only -- a warm start;
* ``training``: + optimizer, scheduler, scaler, extra (and pending gradients);
* ``strict``: + data cursor and RNG, on a topology and versions that let them mean the same.

Strict is refused when the snapshot lacks something the state asks for, when the topology
changed under per-rank (rank-bound) RNG or data state, or when the model, tokenizer or data
versions differ; ``allow_downgrade`` restores every component still valid and reports the
highest level whose every component was restored (:mod:`trainsnap.state.train_load`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from trainsnap.errors import IncompatibleError, InvalidArgumentError
from trainsnap.state import rng as rng_mod
from trainsnap.state.capture import Exact
from trainsnap.state.data_cursor import cursor_of
from trainsnap.state.load_target import LoadTarget, PlainState
from trainsnap.state.model_parts import ModelParts
from trainsnap.state.train_load import LoadTrees, SnapshotParts, TrainLoad, grads_template

log = logging.getLogger(__name__)

PARTS_BY_LEVEL: dict[str, tuple[str, ...]] = {
    "weights": ("model",),
    "training": ("model", "optim", "scheduler", "scaler", "extra", "grads"),
    "strict": ("model", "optim", "scheduler", "scaler", "extra", "grads", "rng", "data"),
}


def _as_list(x: Any) -> list[Any]:
    if x is None:
        return []
    return list(x) if isinstance(x, list | tuple) else [x]


@dataclass(frozen=True, slots=True)
class Part:
    """One part of a :class:`TrainState` besides its model and optimizers (which
    :class:`~trainsnap.state.model_parts.ModelParts` takes and gives back together): how a
    save captures it, what a load fills for it, and how the filled state is given back."""

    name: str
    capture: Callable[[TrainState], Any]
    template: Callable[[TrainState, SnapshotParts, Collection[str]], Any]
    """(state, what the snapshot holds, the components restored) -> the tree to fill."""
    apply: Callable[[TrainState, Any], None]
    after: Callable[[TrainState], None] | None = None
    """Run once every part is applied, the RNG included."""


def _schedulers(state: TrainState) -> Any:
    sds = [s.state_dict() for s in state.schedulers]
    return sds if state.scheduler_is_list else sds[0]


def _apply_schedulers(state: TrainState, tree: Any) -> None:
    sds = tree if state.scheduler_is_list else [tree]
    for scheduler, sd in zip(state.schedulers, sds, strict=True):
        scheduler.load_state_dict(sd)


def _scaler(state: TrainState) -> Any:
    return state.scaler.state_dict()


def _apply_scaler(state: TrainState, tree: Any) -> None:
    state.scaler.load_state_dict(tree)


def _cursor_state(state: TrainState) -> Any:
    assert state._cursor is not None
    return state._cursor.state_dict()


def _apply_cursor(state: TrainState, tree: Any) -> None:
    assert state._cursor is not None
    state._cursor.load_state_dict(tree)


def _after_cursor(state: TrainState) -> None:
    assert state._cursor is not None
    state._cursor.after_restore()


def _apply_grads(state: TrainState, tree: Any) -> None:
    params = dict(state.model_parts().named_parameters())
    for name, grad in tree.items():
        params[name].grad = grad


def _rng_template(state: TrainState, snap: SnapshotParts, restored: Collection[str]) -> Any:
    """The generators restored, and only they: the others' saved keys are left out (a
    per-rank stream on another number of ranks is not read)."""
    return Exact((g, s) for g, s in rng_mod.template().items() if f"rng.{g}" in restored)


def _same(capture: Callable[[TrainState], Any]) -> Any:
    """A part whose load template is what a save captures."""
    return lambda state, _snap, _restored: capture(state)


def _extra(state: TrainState) -> Any:
    return state.extra


def _grads(state: TrainState) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in state.model_parts().named_parameters() if p.grad is not None}


def _nothing(state: TrainState, tree: Any) -> None:
    """Filled in place by the load."""


PARTS: tuple[Part, ...] = (
    Part("scheduler", _schedulers, _same(_schedulers), _apply_schedulers),
    Part("scaler", _scaler, _same(_scaler), _apply_scaler),
    Part("data", _cursor_state, _same(_cursor_state), _apply_cursor, after=_after_cursor),
    Part("extra", _extra, _same(_extra), _nothing),
    Part("grads", _grads, lambda state, snap, _restored: grads_template(state, snap), _apply_grads),
    # Last: nothing applied before it may draw from the generators it puts back.
    Part("rng", lambda _state: rng_mod.capture(), _rng_template, lambda _s, t: rng_mod.restore(t)),
)
"""Every part besides model and optimizers, in the order a load applies them."""


class TrainState:
    """A training run's whole state, saved and restored as one.

    Args:
        model: the model: an ``nn.Module`` (DDP, FSDP2 and compiled modules included), a list
            of modules (model parts, e.g. pipeline stages: their FQNs are kept, merged), a dict
            of modules (each under its name: a GAN's pair, a model and its EMA) or a Stateful
            (``state_dict``/``load_state_dict``, e.g. torchtitan's ``ModelWrapper``).
        optimizer: one torch optimizer or a list (over a single module; parameters disjoint);
            one per model part (a list in order, or a dict by name); or a Stateful optimizer
            container (e.g. torchtitan's ``OptimizersContainer``).
        scheduler: one LR scheduler or a list.
        scaler: a ``torch.amp.GradScaler``.
        dataloader: the data cursor: a torchdata ``StatefulDataLoader``, a ``DataLoader`` over
            a :class:`trainsnap.ElasticSampler` (or the sampler itself), or anything with
            ``state_dict``/``load_state_dict``. Resuming it leaves every global RNG stream where
            the uninterrupted run had it (see :mod:`trainsnap.state.data_cursor`). A plain
            ``DataLoader`` over a ``RandomSampler`` / ``SequentialSampler`` is refused
            (:class:`~trainsnap.InvalidArgumentError`): it keeps its position nowhere.
        extra: a dict of plain data and tensors (``tokens_seen``, ``samples_seen``, ...); loads
            fill it in place with everything saved under it (an empty dict is filled too).
        rng: capture the RNG of Python, NumPy, torch CPU and CUDA (per rank).
        versions: model, tokenizer, code, data, container versions; a change refuses ``strict``.
        grads: also save the parameters' ``.grad`` (a save in the middle of gradient
            accumulation; keep the micro-batch index in ``extra``).
        no_data_order: declare that the loop has no data order to restore (it draws no data,
            or its data does not depend on the step). Without a ``dataloader`` a restore
            reaches ``training`` at most, since the data would not continue where it stopped;
            with ``no_data_order=True`` it reaches ``strict``.

    A load gives back each part the snapshot holds that still means the same here (see
    :mod:`trainsnap.state.train_load`); the returned ``SnapshotInfo`` lists every component,
    restored or not and why.
    """

    PARTS: ClassVar[tuple[Part, ...]] = PARTS
    """Every part besides model and optimizers (see :class:`Part`)."""

    # One keyword per part of the run (DESIGN.md section 6); grouping them would hide the parts.
    def __init__(  # noqa: PLR0913
        self,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        scaler: Any = None,
        dataloader: Any = None,
        extra: dict[str, Any] | None = None,
        *,
        rng: bool = True,
        versions: Mapping[str, Any] | None = None,
        grads: bool = False,
        no_data_order: bool = False,
    ) -> None:
        self.model = model
        if optimizer is not None and model is None:
            raise InvalidArgumentError("TrainState: an optimizer needs its model")
        self._parts = ModelParts(model, optimizer) if model is not None else None
        self.optimizers = (
            [o for opts in self._parts.optimizers.values() for o in opts] if (self._parts) else []
        )
        self.schedulers = _as_list(scheduler)
        self.scheduler_is_list = isinstance(scheduler, list | tuple)
        self.scaler = scaler
        self.dataloader = dataloader
        self._cursor = cursor_of(dataloader) if dataloader is not None else None
        if no_data_order and dataloader is not None:
            raise InvalidArgumentError(
                "TrainState: no_data_order=True declares there is no data order to restore, "
                "but a dataloader= was given; pass one or the other"
            )
        self.no_data_order = no_data_order
        self.extra = extra if extra is not None else {}
        self.extra_given = extra is not None
        self.rng = rng
        self.versions = dict(versions or {})
        self.grads = grads
        if grads and (self._parts is None or self._parts.kind == "stateful"):
            raise InvalidArgumentError("TrainState: grads=True needs the model's modules")
        if not isinstance(self.extra, dict):
            raise InvalidArgumentError("TrainState: extra must be a dict")

    # -- what it holds ----------------------------------------------------------------------

    def parts(self) -> list[str]:
        """The parts this state asks for."""
        have = {
            "model": self.model is not None,
            "optim": self._parts is not None and self._parts.has_optimizer,
            "scheduler": bool(self.schedulers),
            "scaler": self.scaler is not None,
            "extra": self.extra_given or bool(self.extra),
            "grads": self.grads,
            "rng": self.rng,
            "data": self.dataloader is not None,
        }
        return [p for p in PARTS_BY_LEVEL["strict"] if have[p]]

    def kinds(self, parts: Collection[str] | None = None) -> dict[str, bool]:
        p = set(self.parts()) if parts is None else set(parts) & set(self.parts())
        return {
            "model": "model" in p,
            "optimizer": "optim" in p,
            "scheduler": "scheduler" in p,
            "scaler": "scaler" in p,
            "rng": "rng" in p,
            "data": "data" in p,
            "extra": "extra" in p,
        }

    def offered_level(self, parts: Collection[str] | None = None) -> str:
        """The highest level a snapshot of these parts (default: all) can give: a snapshot
        states honestly what it can restore to."""
        mine = set(self.parts())
        saved = mine if parts is None else set(parts) & mine
        training = {p for p in PARTS_BY_LEVEL["training"] if p in mine}
        # Strict needs the RNG, which a TrainState restoring strictly always asks for.
        strict_parts = {p for p in PARTS_BY_LEVEL["strict"] if p in mine}
        if "rng" in saved and strict_parts <= saved and not self.level_cap_reasons():
            return "strict"
        if training - {"model"} and training <= saved:
            return "training"
        return "weights"

    def level_cap_reasons(self) -> list[str]:
        """Why this state cannot restore at ``strict`` whatever the snapshot (empty if it can):
        it has no data cursor and does not declare ``no_data_order``, or captures no RNG."""
        out = []
        if self._cursor is None and not self.no_data_order:
            out.append(
                "this TrainState has no data cursor, so the data would not continue where it "
                "stopped: pass dataloader= (a StatefulDataLoader, or a DataLoader over a "
                "ts.ElasticSampler), or no_data_order=True if the loop has no data order"
            )
        if not self.rng:
            out.append("this TrainState captures no RNG (rng=False)")
        return out

    def level_cap(self) -> str:
        """The highest level a restore into this state can reach (``training`` or ``strict``)."""
        return "training" if self.level_cap_reasons() else "strict"

    def data_cursor(self) -> Any:
        sampler = self._cursor.elastic() if self._cursor is not None else None
        return sampler.state_dict() if sampler is not None else None

    def counters(self) -> tuple[int | None, int | None]:
        """(tokens seen, samples seen), from ``extra`` or the elastic sampler."""
        tokens = self.extra.get("tokens_seen")
        samples = self.extra.get("samples_seen")
        sampler = self._cursor.elastic() if self._cursor is not None else None
        if samples is None and sampler is not None:
            samples = sampler.consumed
        return (
            tokens if isinstance(tokens, int) else None,
            samples if isinstance(samples, int) else None,
        )

    # -- saving -----------------------------------------------------------------------------

    def _model_and_optim(self, with_optim: bool, *, initialise: bool = False) -> tuple[Any, Any]:
        assert self._parts is not None
        msd = self._parts.model_tree()
        return msd, self._parts.optim_tree(initialise=initialise) if with_optim else None

    def save_tree(self, parts: Collection[str] | None = None) -> dict[str, Any]:
        """What a save stores, as a tree of tensors and plain data: every part, or only
        ``parts`` (e.g. ``{"model"}`` for a weights-only snapshot between full ones)."""
        want = set(self.parts()) if parts is None else set(parts) & set(self.parts())
        tree: dict[str, Any] = {}
        if "model" in want:
            msd, osd = self._model_and_optim("optim" in want)
            if osd is not None:
                tree["optim"] = osd
                tree["optim_meta"] = {"stateless": self._stateless(osd)}
            tree["model"] = msd
        for part in PARTS:
            if part.name in want:
                tree[part.name] = part.capture(self)
        return tree

    def load_keys(self) -> list[str]:
        """The top-level keys a load of this state may read, known before the manifest."""
        parts = self.parts()
        return [*parts, "optim_meta"] if "optim" in parts else list(parts)

    def load_trees(self) -> LoadTrees | None:
        """The model's and optimizers' trees as they are now (no optimizer initialised), taken
        once for a load: what it says it wants before the manifest, and the template
        :meth:`plan_load` builds when given them. None without a model."""
        parts = self.parts()
        if "model" not in parts:
            return None
        msd, osd = self._model_and_optim("optim" in parts)
        return LoadTrees(msd, osd, ready=osd is None or self._optimizers_ready())

    def _optimizers_ready(self) -> bool:
        """Whether taking the optimizers' trees with ``initialise`` would give what they give
        now: a container's tree, or torch optimizers that all have their state."""
        assert self._parts is not None
        if self._parts.container is not None:
            return True
        return all(o.state for opts in self._parts.optimizers.values() for o in opts)

    def _stateless(self, osd: Any) -> list[str]:
        """Parameters with no optimizer state (they never got a gradient)."""
        assert self._parts is not None
        out: list[str] = []
        for sd in self._parts.plain_optim_trees(osd):
            named = [n for g in sd["param_groups"] for n in g["params"]]
            out += [n for n in named if n not in sd["state"]]
        return sorted(out)

    def model_parts(self) -> ModelParts:
        """The model's and optimizers' parts (:class:`InvalidArgumentError` without a model)."""
        if self._parts is None:
            raise InvalidArgumentError("TrainState: this state has no model")
        return self._parts

    # -- loading ----------------------------------------------------------------------------

    def load_target(self) -> TrainLoad:
        """A load of this state, as the load protocol drives it
        (:class:`~trainsnap.state.load_target.LoadTarget`)."""
        return TrainLoad(self)

    def check_loaded(self, tree: dict[str, Any]) -> None:
        """Raise unless every part of a loaded ``tree`` that can be checked without applying it
        will apply (the RNG state is tried on fresh generators): a load refuses on every rank
        before any object is changed."""
        if "rng" in tree:
            rng_mod.check(tree["rng"])
        if "optim" in tree and self._parts is not None:
            self._check_optimizer_kind(tree["optim"])

    def _check_optimizer_kind(self, osd: Any) -> None:
        """Refuse saved optimizer hyper-parameters that the live optimizers do not have (an
        AdamW's ``betas`` for an SGD): torch would take them silently and fail at the next
        step, or step with the wrong rule. Keys only the live optimizer has are accepted (a
        newer torch adds defaults). O(parameter groups)."""
        assert self._parts is not None
        skip = {"params", "param_names"}
        for part, sd in self._parts.optim_trees_by_part(osd):
            groups = sd.get("param_groups") if isinstance(sd, Mapping) else None
            if not isinstance(groups, list):
                continue
            saved = {k for g in groups if isinstance(g, Mapping) for k in g} - skip
            live = self._parts.optimizers.get(part, [])
            known = {k for o in live for g in o.param_groups for k in g} - skip
            unknown = sorted(saved - known)
            if live and unknown:
                kinds = ", ".join(sorted({type(o).__name__ for o in live}))
                where = f"the optimizer of model part {part!r}" if part else "the optimizer"
                raise IncompatibleError(
                    f"{where} ({kinds}) has no hyper-parameter {', '.join(map(repr, unknown))} "
                    "that the snapshot's optimizer had: the optimizer changed since the save. "
                    "Build the optimizer the snapshot was saved with, or load level='weights'.",
                    key="optim",
                )

    def apply(self, tree: dict[str, Any]) -> None:
        """Give every object its loaded state back (after a load filled ``tree`` and
        :meth:`check_loaded` accepted it on every rank)."""
        if "model" in tree:
            self.model_parts().apply(tree["model"], tree.get("optim"))
        for part in PARTS:
            if part.name in tree:
                part.apply(self, tree[part.name])
        for part in PARTS:
            if part.after is not None and part.name in tree:
                part.after(self)

    # -- a Stateful for anyone else -------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return self.save_tree()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.apply(state_dict)


def target_of(state: Any) -> LoadTarget:
    """The load target of what a load is given: a :class:`TrainState`'s own, or the
    :class:`~trainsnap.state.load_target.PlainState` of any other state."""
    return state.load_target() if isinstance(state, TrainState) else PlainState(state)
