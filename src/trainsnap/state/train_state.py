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
versions differ; ``allow_downgrade`` continues at the highest level that can be given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trainsnap.errors import IncompatibleError, InvalidArgumentError
from trainsnap.format.manifest import LEVELS, Manifest, check_level, level_rank
from trainsnap.state import rng as rng_mod
from trainsnap.state.capture import Exact
from trainsnap.state.data_cursor import cursor_of
from trainsnap.state.model_parts import ModelParts

log = logging.getLogger(__name__)

PARTS_BY_LEVEL: dict[str, tuple[str, ...]] = {
    "weights": ("model",),
    "training": ("model", "optim", "scheduler", "scaler", "extra", "grads"),
    "strict": ("model", "optim", "scheduler", "scaler", "extra", "grads", "rng", "data"),
}
RANK_BOUND_PARTS = ("rng", "data")
"""Parts whose per-rank content only means the same on the same ranks."""
VERSION_KEYS_CHECKED = ("model", "tokenizer", "data")


def _as_list(x: Any) -> list[Any]:
    if x is None:
        return []
    return list(x) if isinstance(x, list | tuple) else [x]


@dataclass(slots=True)
class LoadTrees:
    """A :class:`TrainState`'s model and optimizer trees, taken once for a load."""

    model: Any
    optim: Any
    """None when the state has no optimizer part."""
    ready: bool
    """The optimizer tree is a load template as it is (no optimizer needs initialising)."""

    def as_tree(self) -> dict[str, Any]:
        return (
            {"model": self.model}
            if self.optim is None
            else {"model": self.model, "optim": self.optim}
        )


@dataclass(slots=True)
class LoadPlan:
    tree: dict[str, Any]
    level: str
    reasons: list[str] = field(default_factory=list)
    """Why a higher level could not be reached (empty when the asked level was, or strict)."""


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

    After a restore, :attr:`restore_reasons` says why the level reached is not higher.
    """

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
        self.restore_reasons: list[str] = []
        """Why the last restore into this state reached no higher level (empty at strict)."""
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
        if "scheduler" in want:
            sds = [s.state_dict() for s in self.schedulers]
            tree["scheduler"] = sds if self.scheduler_is_list else sds[0]
        if "scaler" in want:
            tree["scaler"] = self.scaler.state_dict()
        if "data" in want:
            assert self._cursor is not None
            tree["data"] = self._cursor.state_dict()
        if "rng" in want:
            tree["rng"] = rng_mod.capture()
        if "extra" in want:
            tree["extra"] = self.extra
        if "grads" in want:
            tree["grads"] = self._grads()
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

    def _grads(self) -> dict[str, torch.Tensor]:
        assert self._parts is not None
        return {n: p.grad for n, p in self._parts.named_parameters() if p.grad is not None}

    # -- loading ----------------------------------------------------------------------------

    def plan_load(
        self,
        manifest: Manifest,
        asked: str,
        *,
        world_size: int,
        allow_downgrade: bool,
        read_value: Callable[[str], Any],
        trees: LoadTrees | None = None,
    ) -> LoadPlan:
        """The highest level up to ``asked`` this snapshot gives this state, and the tree to
        load for it; raise when ``asked`` cannot be reached and no downgrade is allowed.
        ``trees``: this load's :meth:`load_trees`, reused rather than taken again."""
        check_level(asked)
        snap = _SnapshotParts(manifest)
        if "optim" in snap.parts and manifest.find_value("optim_meta.stateless", -1) is not None:
            snap.stateless = list(read_value("optim_meta.stateless"))
        problems = {lvl: self._problems(lvl, snap, manifest, world_size) for lvl in LEVELS}
        reached = None
        for lvl in LEVELS[: level_rank(asked) + 1]:
            if problems[lvl]:
                break
            reached = lvl
        if reached is None:
            raise IncompatibleError(
                f"snapshot {manifest.snapshot_id} cannot restore even the weights of this state",
                snapshot_id=manifest.snapshot_id,
                problems=problems["weights"],
            )
        if reached != asked:
            if not allow_downgrade:
                raise IncompatibleError(
                    f"snapshot {manifest.snapshot_id} cannot give a {asked!r} resume of this state "
                    f"(it can give {reached!r}). Pass allow_downgrade=True to continue at "
                    f"{reached!r}, or level={reached!r}.",
                    snapshot_id=manifest.snapshot_id,
                    problems=problems[asked],
                )
            log.warning(
                "snapshot %s: resuming at level %r instead of %r: %s",
                manifest.snapshot_id,
                reached,
                asked,
                "; ".join(problems[asked]),
            )
        if reached != "strict":
            for why in self._version_changes(manifest):
                log.warning("snapshot %s: %s", manifest.snapshot_id, why)
        tree = self._template(reached, snap, trees)
        if "rng" in tree:  # before any tensor is filled in place
            rng_mod.check_plain(read_value)
        # Everything asked for is restored; the level said is what that gives this state.
        reasons = list(problems[asked])
        if level_rank(reached) > level_rank(self.level_cap()):
            reached = self.level_cap()
            reasons += self.level_cap_reasons()
        self.restore_reasons = reasons
        return LoadPlan(tree, reached, reasons)

    def _problems(
        self, level: str, snap: _SnapshotParts, manifest: Manifest, world: int
    ) -> list[str]:
        wanted = [p for p in PARTS_BY_LEVEL[level] if p in self.parts()]
        out = [
            f"the snapshot has no {p} state, which this state asks for"
            for p in wanted
            if p not in snap.parts
        ]
        if level == "strict":
            saved_world = manifest.world_size
            if saved_world != world:
                for p in RANK_BOUND_PARTS:
                    if p in wanted and snap.rank_bound(p):
                        out.append(
                            f"the {p} state is per rank and the topology changed from "
                            f"{saved_world} to {world} ranks"
                        )
            out += self._version_changes(manifest)
            approx = manifest.meta.get("approximate")
            if approx and "optim" in wanted:
                out.append(
                    "the optimizer state was stored at reduced precision (retained history, "
                    f"{approx.get('precision', '?') if isinstance(approx, dict) else '?'})"
                )
            if "rng" in wanted and ("cuda" in snap.rng_devices) != torch.cuda.is_available():
                out.append(
                    "the snapshot's CUDA RNG state does not match this process's CUDA devices"
                )
        return out

    def _version_changes(self, manifest: Manifest) -> list[str]:
        saved = manifest.versions.get("user", {})
        out = []
        for k in VERSION_KEYS_CHECKED:
            if k in saved and k in self.versions and saved[k] != self.versions[k]:
                out.append(f"the {k} version changed from {saved[k]!r} to {self.versions[k]!r}")
        return out

    def _template(
        self, level: str, snap: _SnapshotParts, trees: LoadTrees | None
    ) -> dict[str, Any]:
        parts = [p for p in PARTS_BY_LEVEL[level] if p in self.parts()]
        tree: dict[str, Any] = {}
        if "model" in parts:
            assert self._parts is not None
            # A load template lets torch initialise a fresh optimizer's state: its moments are
            # the destinations of the saved ones, in the parameters' own layouts (DTensor
            # shards); the load then replaces the whole state with the saved one.
            with_optim = "optim" in parts
            if trees is None:
                templates = self._model_and_optim(with_optim, initialise=True)
            elif not with_optim:
                templates = trees.model, None
            elif trees.ready and trees.optim is not None:
                templates = trees.model, trees.optim
            else:  # a fresh optimizer: its state is made now, to be loaded into
                templates = trees.model, self._parts.optim_tree(initialise=True)
            msd, osd = self._parts.exact(*templates)
            if osd is not None:
                stateless = set(snap.stateless)
                for sd in self._parts.plain_optim_trees(osd):
                    for name in list(sd["state"]):
                        if name in stateless:
                            del sd["state"][name]  # had no state when saved: must have none now
                tree["optim"] = osd
            tree["model"] = msd
        if "scheduler" in parts:
            sds = [s.state_dict() for s in self.schedulers]
            tree["scheduler"] = sds if self.scheduler_is_list else sds[0]
        if "scaler" in parts:
            tree["scaler"] = self.scaler.state_dict()
        if "data" in parts:
            assert self._cursor is not None
            tree["data"] = self._cursor.state_dict()
        if "rng" in parts:
            tree["rng"] = rng_mod.template()
        if "extra" in parts:
            tree["extra"] = self.extra
        if "grads" in parts:
            assert self._parts is not None
            names = snap.grad_names
            tree["grads"] = Exact(
                (n, torch.zeros_like(p)) for n, p in self._parts.named_parameters() if n in names
            )
        return tree

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
            assert self._parts is not None
            self._parts.apply(tree["model"], tree.get("optim"))
        if "scheduler" in tree:
            sds = tree["scheduler"] if self.scheduler_is_list else [tree["scheduler"]]
            for s, sd in zip(self.schedulers, sds, strict=True):
                s.load_state_dict(sd)
        if "scaler" in tree:
            self.scaler.load_state_dict(tree["scaler"])
        if "data" in tree:
            assert self._cursor is not None
            self._cursor.load_state_dict(tree["data"])
        if "grads" in tree:
            assert self._parts is not None
            params = dict(self._parts.named_parameters())
            for n, g in tree["grads"].items():
                params[n].grad = g
        if "rng" in tree:
            rng_mod.restore(tree["rng"])  # last: nothing above may draw from it afterwards
        if "data" in tree:
            assert self._cursor is not None
            self._cursor.after_restore()

    # -- a Stateful for anyone else -------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return self.save_tree()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.apply(state_dict)


class _SnapshotParts:
    """What a snapshot holds, by top-level part, from its manifest's keys."""

    def __init__(self, manifest: Manifest) -> None:
        self.m = manifest
        keys: Sequence[tuple[str, int]] = [
            *zip(manifest.tensor_keys, manifest.tensor_ranks.tolist(), strict=True),
            *zip(manifest.value_keys, manifest.value_ranks.tolist(), strict=True),
        ]
        self.parts: set[str] = set()
        self.per_rank: set[str] = set()
        self.rng_devices: set[str] = set()
        self.grad_names: set[str] = set()
        for key, rank in keys:
            part, _, rest = key.partition(".")
            self.parts.add(part)
            if rank >= 0:
                self.per_rank.add(part)
            if part == "rng":
                self.rng_devices.add(rest.split(".", 1)[0])
            if part == "grads":
                self.grad_names.add(rest)
        self.stateless: list[str] = []

    def rank_bound(self, part: str) -> bool:
        return part in self.per_rank
