"""Which tiers save a step: the policies of every tier and the shared decisions, made into one
named :class:`SaveDecision`.

The rule, for a manager whose tiers are, fastest first, any of memory, local and durable:

* A step that any tier's interval wants (a preemption wants the durable tier) is captured and
  staged **once** and saved by the fastest tier of the manager, its *front* (the memory tier
  when there is one, else the local tier, else the durable root); every other tier that wants
  the step gets it by promotion from the front (:func:`trainsnap.manager.promotion.promote`),
  in the background, never by a second capture. So with ``MemoryTier(Every(steps=1))``,
  ``LocalTier(Every(steps=2))`` and a durable ``Every(steps=5)``, every step is a memory
  snapshot, every even step is promoted to the local tier too, and every fifth to the durable
  root.
* A step only the weights-only policy wants saves the model alone, to the fastest disk tier
  (a memory snapshot is always whole), promoted to the durable root when that tier is local.
* A memory snapshot that only the memory tier wants is skipped while the previous save is in
  flight (counted, logged), unless ``MemoryTier(wait_if_busy=True)``; one another tier wants
  waits and saves. Every rank takes the coordinator's answer (:meth:`Decisions.agree`).

Policies every rank evaluates alike are evaluated locally; the others at decision steps only
(:mod:`trainsnap.manager.decisions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trainsnap.manager.decisions import Decisions
from trainsnap.manager.policies import SavePolicy, StepInfo
from trainsnap.manager.tiers import Tier


@dataclass(frozen=True, slots=True)
class SaveDecision:
    """One step's saves: the tier that saves it and the tiers it is promoted to."""

    front: Tier
    """The tier the state is saved to (one capture, one staging)."""
    promote_to: tuple[Tier, ...] = ()
    """Slower tiers that want this step, fastest first: promoted from ``front``."""
    weights_only: bool = False
    """The model alone (a ``weights``-level snapshot)."""
    preempt: bool = False
    """A preemption save: the caller waits until it is durable."""

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """Every tier that holds the step once its promotions are done."""
        return (self.front, *self.promote_to)

    @property
    def skippable(self) -> bool:
        """Only the front wants it: it may be skipped while the saver is busy."""
        return not self.promote_to and not self.preempt


class Schedule:
    """The save decision of each step (module docstring). ``tiers``: fastest first, the
    durable root last."""

    def __init__(
        self, tiers: Sequence[Tier], weights: Sequence[SavePolicy], decisions: Decisions
    ) -> None:
        self.tiers = list(tiers)
        self.weights = list(weights)
        self.decisions = decisions

    def _kinds(self) -> list[tuple[str, Sequence[SavePolicy]]]:
        kinds: list[tuple[str, Sequence[SavePolicy]]]
        kinds = [(t.name, t.policies) for t in self.tiers]
        return [*kinds, ("weights", self.weights)]

    def decide(self, info: StepInfo, signalled: bool, window: int) -> SaveDecision | None:
        """The saves of this step (None: none). No control-plane operation except at a
        decision step (see :meth:`Decisions.take`)."""
        kinds = self._kinds()
        local = {k for k, ps in kinds if any(p.should_save(info) for p in ps if not p.shared)}

        def shared() -> set[str]:
            return {k for k, ps in kinds if any(p.should_save(info) for p in ps if p.shared)}

        return self.decision(local | self.decisions.take(shared, signalled, window))

    def decision(self, wanted: set[str]) -> SaveDecision | None:
        """The rule (module docstring) for the kinds of save ``wanted``: tier names,
        ``"weights"``, ``"preempt"``."""
        preempt = "preempt" in wanted
        names = wanted | ({"durable"} if preempt else set())
        full = [t for t in self.tiers if t.name in names]
        if full:
            front = self.tiers[0]
            rest = tuple(t for t in full if t is not front)
            return SaveDecision(front, rest, preempt=preempt)
        if "weights" in wanted:
            return self.explicit("durable", weights_only=True)
        return None

    def explicit(self, tier: str, *, weights_only: bool = False) -> SaveDecision:
        """A save asked for by name (``CheckpointManager.save``): ``"local"`` to the local tier
        alone; ``"durable"`` to the fastest disk tier, promoted to the durable root from a
        local one."""
        disk = [t for t in self.tiers if t.name != "memory"]
        if tier == "local":
            return SaveDecision(disk[0], weights_only=weights_only)
        durable = disk[-1]
        rest = (durable,) if disk[0] is not durable else ()
        return SaveDecision(disk[0], rest, weights_only=weights_only)

    def skip(self, busy: bool) -> bool:
        """(all ranks, at a skippable memory snapshot) Whether it is skipped: the
        coordinator's saver being ``busy`` decides, the same on every rank."""
        return not self.decisions.agree(not busy)
