"""What a load fills, as the load protocol sees it: the role of DCP's ``LoadPlanner``.

:func:`trainsnap.protocol.load_protocol.run_load` drives any state through one
:class:`LoadTarget`, in order:

1. :meth:`~LoadTarget.wants` -- before the manifest: the tree whose tensors say which regions
   this rank reads, and the top-level keys it may read;
2. :meth:`~LoadTarget.needs` -- the plain values of the snapshot its plan must see first;
3. :meth:`~LoadTarget.plan` -- given the manifest, the level asked and those values (already
   read): the tree to fill, the level it gives and, per component, whether it is restored and
   why not;
4. :meth:`~LoadTarget.check` -- the filled tree, before anything is applied on any rank;
5. :meth:`~LoadTarget.apply` -- once every rank read and checked its part.

A :class:`~trainsnap.TrainState` is one (:class:`~trainsnap.state.train_load.TrainLoad`); any
other state -- a mapping of tensors, plain data and stateful objects -- is a
:class:`PlainState`. The protocol never asks which kind it holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from trainsnap.format import tree as tree_format
from trainsnap.format.manifest import Manifest


@dataclass(frozen=True, slots=True)
class Component:
    """One component of a restore (``model``, ``optimizer``, ``data``, ``rng.python``...):
    restored or not, and why not."""

    name: str
    restored: bool
    why: str = ""
    """Why it was not restored (empty when it was)."""

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "restored": self.restored}
        if not self.restored:
            out["why"] = self.why
        return out


def describe(components: Sequence[Component]) -> str:
    """One line for a log: ``restored=a,b not_restored='c: why; d: why'``."""
    done = ",".join(c.name for c in components if c.restored) or "-"
    left = "; ".join(f"{c.name}: {c.why}" for c in components if not c.restored)
    return f"restored={done}" + (f" not_restored={left!r}" if left else "")


@dataclass(slots=True)
class LoadPlan:
    """What a target's plan gives a load."""

    tree: Any
    """The tree to fill (tensors in place, placeholders replaced)."""
    level: str
    """The resume level it gives."""
    reasons: list[str] = field(default_factory=list)
    """Why a higher level could not be reached (empty when the asked level was, or strict)."""
    components: list[Component] = field(default_factory=list)
    left_out: tuple[str, ...] = ()
    """Saved keys (dotted prefixes) the tree leaves out on purpose under an exact mapping: a
    generator not restored. No rank loading them is then no error."""


@dataclass(frozen=True, slots=True)
class Wanted:
    """What a state says of its load before the manifest is read."""

    tree: Any
    """The tree to walk for the regions this rank's tensors take (the model's and
    optimizers' trees of a TrainState; the state itself otherwise)."""
    tops: Sequence[str] | None = None
    """The top-level keys it may read (None: those of ``tree``)."""


class LoadTarget(Protocol):
    """The steps of a load that belong to the state (module docstring)."""

    def wants(self) -> Wanted: ...

    def needs(self, manifest: Manifest) -> list[str]:
        """Keys of plain values :meth:`plan` must be given (each present in ``manifest``)."""
        ...

    def plan(
        self,
        manifest: Manifest,
        level: str,
        values: Mapping[str, Any],
        *,
        world_size: int,
        allow_downgrade: bool,
    ) -> LoadPlan: ...

    def check(self, tree: Any) -> None: ...

    def apply(self, tree: Any) -> None: ...


@dataclass(slots=True)
class PlainState:
    """A mapping (or stateful root) as a load target: everything it holds is filled at the
    level asked; the fill itself gives stateful objects their ``load_state_dict``."""

    state: Any

    def wants(self) -> Wanted:
        return Wanted(self.state)

    def needs(self, manifest: Manifest) -> list[str]:
        return []

    def plan(
        self,
        manifest: Manifest,
        level: str,
        values: Mapping[str, Any],
        *,
        world_size: int,
        allow_downgrade: bool,
    ) -> LoadPlan:
        tops = self.state.keys() if isinstance(self.state, Mapping) else ()
        named = [tree_format.join("", k) for k in tops if tree_format.is_key(k)]
        return LoadPlan(self.state, level, [], [Component(k, True) for k in named])

    def check(self, tree: Any) -> None:
        """Nothing to check: the fill verified every block and refused what does not fit."""

    def apply(self, tree: Any) -> None:
        """Nothing left to apply: the fill put every value in place."""


__all__ = ["Component", "LoadPlan", "LoadTarget", "PlainState", "Wanted", "describe"]
