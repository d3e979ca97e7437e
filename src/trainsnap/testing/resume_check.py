"""Is my resume exact? :func:`check_resume` runs a user's training loop twice -- straight
through, and with a save, a crash and a restore in the middle -- and names the first step and
tensor where the two runs part and the likely cause, or says they are bitwise equal (NaN and
infinities included: the bits are compared). The crash is simulated in this process (fresh
objects), or, with ``crash="process"``, real: the loop runs in a fresh process that is SIGKILLed
after its save, and resumes in another fresh one, so that nothing of the first run's process
(a global, a cache, a generator's position) can leak into the resumed run.

The three causes of drift it finds most often:

* randomness drawn outside the state: a generator the loop owns (``np.random.default_rng``, a
  ``torch.Generator``) that no ``TrainState`` part saves;
* a data order that does not resume: a loader whose position or shuffle is kept nowhere;
* state kept outside the ``TrainState``: a step counter, an EMA, a loss scale, a schedule that
  reads a global.
"""

from __future__ import annotations

import math
import struct
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from trainsnap.testing._observation import observe

Run = TypeVar("Run")


@dataclass(frozen=True, slots=True)
class ResumeReport:
    """What :func:`check_resume` found.

    ``equal`` is True when every step after the restore gave the uninterrupted run's loss and
    state bitwise. Otherwise ``step`` is the first step that differs and ``where`` what differs
    first there: ``"loss"`` or the dotted key of a tensor or value of the saved state
    (``model.0.weight``, ``optim.state.0.weight.exp_avg``, ``rng.torch``, ``data.consumed``),
    and ``cause`` the likely cause (:func:`likely_cause`). ``level`` is the level the restore
    reached."""

    equal: bool
    level: str
    step: int | None = None
    where: str | None = None
    detail: str = ""
    cause: str = ""

    def __str__(self) -> str:
        if self.equal:
            return f"resume is exact (bitwise; restored at level {self.level!r})"
        return (
            f"resume drifts: first at step {self.step}, in {self.where} ({self.detail}); "
            f"restored at level {self.level!r}; likely cause: {self.cause}"
        )

    def assert_exact(self) -> None:
        """Raise ``AssertionError`` with the report unless the resume was exact."""
        if not self.equal:
            raise AssertionError(str(self))


CRASHES = ("simulated", "process")
"""How :func:`check_resume` crashes the run: fresh objects in this process, or a real SIGKILL."""


def check_resume(
    make: Callable[[], Run],
    step: Callable[[Run, int], Any],
    *,
    steps: int,
    restore_after: int,
    state: Callable[[Run], Any] | None = None,
    level: str = "strict",
    crash: str = "simulated",
) -> ResumeReport:
    """Run ``steps`` steps straight, and again with a save after step ``restore_after``, a
    crash and a restore; compare every later step's loss and whole state, bitwise.

    Args:
        make: builds everything one run needs (model, optimizer, loader, the iterator it
            reads...) and seeds the generators as the training script does; called three times.
        step: ``step(run, i)`` trains step ``i`` and returns its loss (a number, a tensor, or
            None when there is none to compare).
        steps, restore_after: the run's length, and the step after which it is saved and
            restored (``0 <= restore_after < steps - 1``).
        state: ``state(run)`` gives what is saved and restored (a :class:`~trainsnap.TrainState`
            or a mapping); by default ``run`` itself when it is one, else ``run.state``.
        level: the level to restore at.
        crash: ``"simulated"`` (fresh objects in this process) or ``"process"``: the saving
            run goes on training in a fresh process (``multiprocessing``'s spawn) until it is
            SIGKILLed, and the resumed run runs in another; ``make``, ``step`` and ``state``
            must then be picklable (functions or classes defined at a module's top level).

    The state is compared after each step through what a save would store: parameters,
    optimizer state, schedulers, RNG streams, data cursor, extra. O(steps x state size) time;
    memory for two copies of the state. ``InvalidArgumentError`` for bad arguments; otherwise
    raises what the loop or the save/restore raises (with ``crash="process"``, a
    ``TrainsnapError`` naming the child's failure).
    """
    _check_arguments(steps, restore_after, level, crash)
    state_of = state or _default_state
    straight = make()
    expected = [observe(step(straight, i), state_of(straight)) for i in range(steps)]
    del straight
    with tempfile.TemporaryDirectory(prefix="trainsnap-resume-check-") as root:
        if crash == "process":
            from trainsnap.testing import _resume_process

            level_reached, observed = _resume_process.crash_and_resume(
                make, step, state_of, steps, restore_after, level, root
            )
        else:
            level_reached, observed = _simulated(
                make, step, state_of, steps, restore_after, level, root
            )
    for i, got in enumerate(observed, start=restore_after + 1):
        found = _first_difference(expected[i], got)
        if found is not None:
            where, detail = found
            return ResumeReport(False, level_reached, i, where, detail, likely_cause(where))
    return ResumeReport(True, level_reached)


def _check_arguments(steps: int, restore_after: int, level: str, crash: str) -> None:
    from trainsnap.errors import InvalidArgumentError
    from trainsnap.format.manifest import LEVELS

    for name, value in (("steps", steps), ("restore_after", restore_after)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgumentError(f"check_resume({name}=) must be an int, got {value!r}")
    if not 0 <= restore_after < steps - 1:
        raise InvalidArgumentError(
            f"check_resume(restore_after={restore_after}) must be in [0, {steps - 1}) for "
            f"steps={steps}: at least one step must run after the restore"
        )
    if level not in LEVELS:
        raise InvalidArgumentError(f"check_resume(level={level!r}): one of {list(LEVELS)}")
    if crash not in CRASHES:
        raise InvalidArgumentError(f"check_resume(crash={crash!r}): one of {list(CRASHES)}")


def _simulated(
    make: Callable[[], Run],
    step: Callable[[Run, int], Any],
    state_of: Callable[[Run], Any],
    steps: int,
    restore_after: int,
    level: str,
    root: str,
) -> tuple[str, list[dict[str, Any]]]:
    """The crash in this process: train, save, drop every object, make fresh ones, restore."""
    from trainsnap.api.snapshots import load, save

    crashed = make()
    for i in range(restore_after + 1):
        step(crashed, i)
    save(state_of(crashed), root, step=restore_after, no_dist=True)
    del crashed
    resumed = make()
    info = load(state_of(resumed), root, level=level, allow_downgrade=True)
    observed = [
        observe(step(resumed, i), state_of(resumed)) for i in range(restore_after + 1, steps)
    ]
    return info.level, observed


def likely_cause(where: str) -> str:
    """The likely cause of a drift first seen in ``where`` (a key of :class:`ResumeReport`)."""
    top = where.split(".", 1)[0]
    if top == "rng":
        return (
            "an RNG stream drawn differently after the restore: a draw the loop makes outside "
            "the step, or a generator shared with something the state does not hold"
        )
    if top in ("data", "dataloader", "sampler") or "sampler" in where:
        return (
            "the data order: the loader's position or shuffle does not resume (give the "
            "TrainState the loader, or a ts.ElasticSampler)"
        )
    if where == "loss":
        return (
            "the inputs of the step: the data order, or an RNG the state does not hold (a "
            "generator the loop owns, np.random.default_rng, a torch.Generator, dropout "
            "drawn from one)"
        )
    if top in ("scheduler", "extra") or "step" in where.rsplit(".", 1)[-1]:
        return (
            "a loop-owned counter or value: a step count, a schedule reading a global, "
            "something the loop keeps outside the TrainState"
        )
    return (
        "state kept outside the TrainState (a step counter, an EMA, a loss scale, a buffer "
        "the loop writes), or an RNG the state does not hold"
    )


def _default_state(run: Any) -> Any:
    from trainsnap.state.train_state import TrainState

    return run if isinstance(run, TrainState | Mapping) else run.state


def _first_difference(want: dict[str, Any], got: dict[str, Any]) -> tuple[str, str] | None:
    for key in [*want, *(k for k in got if k not in want)]:
        if key not in want or key not in got:
            return key, "present in only one of the runs"
        a, b = want[key], got[key]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.dtype != b.dtype or a.shape != b.shape:
                return key, f"{a.dtype}{tuple(a.shape)} against {b.dtype}{tuple(b.shape)}"
            if not _same_bits(a, b):
                diff = (a.double() - b.double()).abs().nan_to_num(nan=math.inf).max().item()
                if a.is_floating_point() or a.is_complex():
                    return key, f"max abs difference {diff:.3g}"
                return key, "the values differ"
        elif not _same_value(a, b):
            return key, f"{a!r} against {b!r}"
    return None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: a NaN equals a NaN of the same bits, -0.0 differs from 0.0."""
    if a.numel() == 0:
        return True
    left = a.contiguous().reshape(-1).view(torch.uint8)
    right = b.contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(left, right))


def _same_value(a: Any, b: Any) -> bool:
    """Equality of plain values, NaN equal to NaN (a loss that is NaN in both runs agrees)."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        both = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return both and a.dtype == b.dtype and a.shape == b.shape and _same_bits(a, b)
    return bool(a == b) or (a is None and b is None)
