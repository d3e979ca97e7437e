"""A :class:`~trainsnap.TrainState`'s load: what a snapshot gives it, component by component.

Each component the state holds -- model, optimizer, scheduler, scaler, extra, pending
gradients, the data cursor and each random generator (``rng.python``, ``rng.numpy``,
``rng.torch``, ``rng.cuda``) -- is restored when the snapshot holds it and it still means the
same here, and is otherwise left as it is, with the reason. A per-rank part (saved by each rank
for itself) means the same only on as many ranks as saved it; a global one (stored once: an
:class:`~trainsnap.ElasticSampler`'s position, a generator every rank had alike) on any number.
The level reached is the highest whose every component was restored, on versions that agree,
from optimizer state at full precision.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from trainsnap.errors import IncompatibleError
from trainsnap.format.manifest import LEVELS, Manifest, check_level, level_rank
from trainsnap.state import rng as rng_mod
from trainsnap.state.capture import Exact
from trainsnap.state.load_target import Component, LoadPlan, Wanted
from trainsnap.state.model_parts import ModelParts

log = logging.getLogger(__name__)

LEVEL_OF_PART = {
    "model": "weights",
    "optim": "training",
    "scheduler": "training",
    "scaler": "training",
    "extra": "training",
    "grads": "training",
    "rng": "strict",
    "data": "strict",
}
"""The lowest level that restores each part of a TrainState."""
COMPONENT_NAMES = {"optim": "optimizer"}
"""A part's name as a restore reports it, where it differs."""
VERSION_KEYS_CHECKED = ("model", "tokenizer", "data")
STATELESS_KEY = "optim_meta.stateless"


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


class SnapshotParts:
    """What a snapshot holds, by top-level part and by generator, from its manifest's keys;
    which of them are per rank. O(keys)."""

    def __init__(self, manifest: Manifest, values: Mapping[str, Any]) -> None:
        keys: Sequence[tuple[str, int]] = [
            *zip(manifest.tensor_keys, manifest.tensor_ranks.tolist(), strict=True),
            *zip(manifest.value_keys, manifest.value_ranks.tolist(), strict=True),
        ]
        self.parts: set[str] = set()
        self.per_rank: set[str] = set()
        """Parts and generators (``rng.numpy``) with a key saved per rank."""
        self.grad_names: set[str] = set()
        for key, rank in keys:
            part, _, rest = key.partition(".")
            name = part
            if part == "rng":
                name = "rng." + rest.split(".", 1)[0]
                self.parts.add(name)
            if part == "grads":
                self.grad_names.add(rest)
            self.parts.add(part)
            if rank >= 0:
                self.per_rank.update((part, name))
        self.stateless: list[str] = list(values.get(STATELESS_KEY, ()))


class LoadableState(Protocol):
    """What a load needs of a :class:`trainsnap.TrainState` (declared here, so that this
    module does not import the one that builds on it)."""

    versions: dict[str, Any]

    @property
    def PARTS(self) -> Sequence[Any]: ...  # the TrainState class attribute

    def parts(self) -> list[str]: ...

    def load_keys(self) -> list[str]: ...

    def load_trees(self) -> LoadTrees | None: ...

    def level_cap(self) -> str: ...

    def level_cap_reasons(self) -> list[str]: ...

    def model_parts(self) -> ModelParts: ...

    def check_loaded(self, tree: dict[str, Any]) -> None: ...

    def apply(self, tree: dict[str, Any]) -> None: ...


@dataclass(slots=True)
class TrainLoad:
    """One load into a :class:`TrainState` (a :class:`~trainsnap.state.load_target.LoadTarget`):
    the trees it takes once, the components its plan restores."""

    state: LoadableState
    trees: LoadTrees | None = None
    """The model's and optimizers' trees, taken once by :meth:`wants`."""
    generators: list[str] = field(default_factory=list)

    def wants(self) -> Wanted:
        self.trees = self.state.load_trees()
        return Wanted({} if self.trees is None else self.trees.as_tree(), self.state.load_keys())

    def needs(self, manifest: Manifest) -> list[str]:
        """The saved parameters with no optimizer state, and the plain parts of the RNG state
        (checked before any tensor is filled in place)."""
        parts = self.state.parts()
        keys = [STATELESS_KEY] if "optim" in parts else []
        return [*keys, *rng_mod.PLAIN_KEYS] if "rng" in parts else keys

    def plan(
        self,
        manifest: Manifest,
        level: str,
        values: Mapping[str, Any],
        *,
        world_size: int,
        allow_downgrade: bool,
    ) -> LoadPlan:
        """The components this snapshot restores up to ``level``, the level that gives, and
        the tree to fill; raise when ``level`` is not reached and no downgrade is allowed."""
        check_level(level)
        snap = SnapshotParts(manifest, values)
        components = self._components(manifest, snap, level, world_size)
        reached, reasons = self._reached(manifest, components, level)
        sid = manifest.snapshot_id
        if reached is None:
            raise IncompatibleError(
                f"snapshot {sid} cannot restore even the weights of this state",
                snapshot_id=sid,
                problems=reasons,
            )
        if reached != level:
            if not allow_downgrade:
                raise IncompatibleError(
                    f"snapshot {sid} cannot give a {level!r} resume of this state (it can give "
                    f"{reached!r}). Pass allow_downgrade=True to continue at {reached!r}, or "
                    f"level={reached!r}.",
                    snapshot_id=sid,
                    problems=reasons,
                )
            log.warning(
                "snapshot %s: resuming at level %r instead of %r: %s",
                sid,
                reached,
                level,
                "; ".join(reasons),
            )
        if reached != "strict":
            for why in self._version_changes(manifest):
                log.warning("snapshot %s: %s", sid, why)
        restored = {c.name for c in components if c.restored}
        tree = self._template(restored, snap)
        if "rng" in tree:  # before any tensor is filled in place
            rng_mod.check_plain(values, tree["rng"])
        cap = self.state.level_cap()
        if level_rank(reached) > level_rank(cap):
            reached = cap
            reasons += self.state.level_cap_reasons()
        skipped = tuple(c.name for c in components if not c.restored and "." in c.name)
        return LoadPlan(tree, reached, reasons, components, skipped)

    def check(self, tree: Any) -> None:
        self.state.check_loaded(tree)

    def apply(self, tree: Any) -> None:
        self.state.apply(tree)

    # -- the plan's parts ---------------------------------------------------------------------

    def _components(
        self, manifest: Manifest, snap: SnapshotParts, asked: str, world: int
    ) -> list[Component]:
        """Each component the state holds, restored or not and why. O(components)."""
        out = []
        moved = (
            f"the topology changed from {manifest.world_size} to {world} ranks"
            if manifest.world_size != world
            else ""
        )
        data_version = [w for w in self._version_changes(manifest) if "data version" in w]
        for part in self.state.parts():
            if part == "rng":
                out += self._generators(snap, asked, moved)
                continue
            name = COMPONENT_NAMES.get(part, part)
            why = ""
            if level_rank(LEVEL_OF_PART[part]) > level_rank(asked):
                why = f"level {asked!r} was asked"
            elif part not in snap.parts:
                why = f"the snapshot has no {part} state, which this state asks for"
            elif part == "data" and moved and part in snap.per_rank:
                why = f"the data state is per rank and {moved}"
            elif part == "data" and data_version:
                why = data_version[0]
            out.append(Component(name, not why, why))
        return out

    def _generators(self, snap: SnapshotParts, asked: str, moved: str) -> list[Component]:
        here = list(rng_mod.template())
        saved = [g.removeprefix("rng.") for g in sorted(snap.parts) if g.startswith("rng.")]
        out = []
        for gen in [*here, *(g for g in saved if g not in here)]:
            name = f"rng.{gen}"
            why = ""
            if level_rank(asked) < level_rank("strict"):
                why = f"level {asked!r} was asked"
            elif "rng" not in snap.parts:
                why = "the snapshot has no rng state, which this state asks for"
            elif gen not in here:
                why = f"the snapshot holds {gen} RNG state and this process has no such device"
            elif name not in snap.parts:
                why = f"the snapshot has no {gen} RNG state, which this process has"
            elif moved and name in snap.per_rank:
                why = f"the {gen} RNG state is per rank and {moved}"
            out.append(Component(name, not why, why))
        return out

    def _reached(
        self, manifest: Manifest, components: list[Component], asked: str
    ) -> tuple[str | None, list[str]]:
        """The highest level up to ``asked`` whose every component was restored, and why it
        is not ``asked`` (each reason once)."""
        conditions = self._strict_conditions(manifest)
        reached = None
        reasons: list[str] = []
        for lvl in LEVELS[: level_rank(asked) + 1]:
            missing = [
                c.why
                for c in components
                if not c.restored and level_rank(_level_of(c.name)) <= level_rank(lvl)
            ]
            blockers = [*missing, *(conditions if lvl == "strict" else [])]
            if blockers:
                reasons = list(dict.fromkeys(blockers))
                break
            reached = lvl
        return reached, reasons

    def _strict_conditions(self, manifest: Manifest) -> list[str]:
        """Why no snapshot component makes this restore strict: versions, precision."""
        out = self._version_changes(manifest)
        approx = manifest.meta.get("approximate")
        if approx and "optim" in self.state.parts():
            precision = approx.get("precision", "?") if isinstance(approx, dict) else "?"
            out.append(
                f"the optimizer state was stored at reduced precision (retained history, "
                f"{precision})"
            )
        return out

    def _version_changes(self, manifest: Manifest) -> list[str]:
        saved = manifest.versions.get("user", {})
        mine = self.state.versions
        return [
            f"the {k} version changed from {saved[k]!r} to {mine[k]!r}"
            for k in VERSION_KEYS_CHECKED
            if k in saved and k in mine and saved[k] != mine[k]
        ]

    def _template(self, restored: set[str], snap: SnapshotParts) -> dict[str, Any]:
        """The tree to fill: each restored component's destination."""
        state = self.state
        tree: dict[str, Any] = {}
        if "model" in restored:
            tree.update(self._model_template("optimizer" in restored, snap))
        for part in state.PARTS:
            if part.name in restored or any(n.startswith(f"{part.name}.") for n in restored):
                tree[part.name] = part.template(state, snap, restored)
        return tree

    def _model_template(self, with_optim: bool, snap: SnapshotParts) -> dict[str, Any]:
        parts = self.state.model_parts()
        trees = self.trees
        # A load template lets torch initialise a fresh optimizer's state: its moments are the
        # destinations of the saved ones, in the parameters' own layouts (DTensor shards); the
        # load then replaces the whole state with the saved one.
        if trees is None:
            templates = (
                parts.model_tree(),
                parts.optim_tree(initialise=True) if with_optim else None,
            )
        elif not with_optim:
            templates = trees.model, None
        elif trees.ready and trees.optim is not None:
            templates = trees.model, trees.optim
        else:  # a fresh optimizer: its state is made now, to be loaded into
            templates = trees.model, parts.optim_tree(initialise=True)
        msd, osd = parts.exact(*templates)
        tree: dict[str, Any] = {}
        if osd is not None:
            stateless = set(snap.stateless)
            for sd in parts.plain_optim_trees(osd):
                for name in list(sd["state"]):
                    if name in stateless:
                        del sd["state"][name]  # had no state when saved: must have none now
            tree["optim"] = osd
        tree["model"] = msd
        return tree


def _level_of(component: str) -> str:
    """The lowest level that restores a component (by its reported name)."""
    part = {"optimizer": "optim"}.get(component, component.partition(".")[0])
    return LEVEL_OF_PART[part]


def grads_template(state: LoadableState, snap: SnapshotParts) -> Exact:
    """Zeroed destinations of the saved gradients the state's parameters have."""
    return Exact(
        (n, torch.zeros_like(p))
        for n, p in state.model_parts().named_parameters()
        if n in snap.grad_names
    )


__all__ = ["LoadTrees", "SnapshotParts", "TrainLoad"]
