"""Is my resume exact? :func:`check_resume` runs a user's training loop twice -- straight
through, and with a save, a simulated crash and a restore in the middle -- and names the first
step and tensor where the two runs part, or says they are bitwise equal.

The three causes of drift it finds most often:

* randomness drawn outside the state: a generator the loop owns (``np.random.default_rng``, a
  ``torch.Generator``) that no ``TrainState`` part saves;
* a data order that does not resume: a loader whose position or shuffle is kept nowhere;
* state kept outside the ``TrainState``: a step counter, an EMA, a loss scale, a schedule that
  reads a global.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

Run = TypeVar("Run")


@dataclass(frozen=True, slots=True)
class ResumeReport:
    """What :func:`check_resume` found.

    ``equal`` is True when every step after the restore gave the uninterrupted run's loss and
    state bitwise. Otherwise ``step`` is the first step that differs and ``where`` what differs
    first there: ``"loss"`` or the dotted key of a tensor or value of the saved state
    (``model.0.weight``, ``optim.state.0.weight.exp_avg``, ``rng.torch``, ``data.consumed``).
    ``level`` is the level the restore reached."""

    equal: bool
    level: str
    step: int | None = None
    where: str | None = None
    detail: str = ""

    def __str__(self) -> str:
        if self.equal:
            return f"resume is exact (bitwise; restored at level {self.level!r})"
        return (
            f"resume drifts: first at step {self.step}, in {self.where} ({self.detail}); "
            f"restored at level {self.level!r}"
        )

    def assert_exact(self) -> None:
        """Raise ``AssertionError`` with the report unless the resume was exact."""
        if not self.equal:
            raise AssertionError(str(self))


def check_resume(
    make: Callable[[], Run],
    step: Callable[[Run, int], Any],
    *,
    steps: int,
    restore_after: int,
    state: Callable[[Run], Any] | None = None,
    level: str = "strict",
) -> ResumeReport:
    """Run ``steps`` steps straight, and again with a save after step ``restore_after``, fresh
    objects (a crash) and a restore; compare every later step's loss and whole state.

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

    The state is compared after each step through what a save would store: parameters,
    optimizer state, schedulers, RNG streams, data cursor, extra. O(steps x state size) time;
    memory for two copies of the state. Raises what the loop or the save/restore raises.
    """
    if not 0 <= restore_after < steps - 1:
        raise ValueError(f"restore_after must be in [0, {steps - 1}), got {restore_after}")
    state_of = state or _default_state
    straight = make()
    expected = [_observe(step(straight, i), state_of(straight)) for i in range(steps)]
    del straight
    from trainsnap.api.snapshots import load, save

    with tempfile.TemporaryDirectory(prefix="trainsnap-resume-check-") as root:
        crashed = make()
        for i in range(restore_after + 1):
            step(crashed, i)
        save(state_of(crashed), root, step=restore_after, no_dist=True)
        del crashed
        resumed = make()
        info = load(state_of(resumed), root, level=level, allow_downgrade=True)
        for i in range(restore_after + 1, steps):
            got = _observe(step(resumed, i), state_of(resumed))
            found = _first_difference(expected[i], got)
            if found is not None:
                where, detail = found
                return ResumeReport(False, info.level, i, where, detail)
    return ResumeReport(True, info.level)


def _default_state(run: Any) -> Any:
    from trainsnap.state.train_state import TrainState

    return run if isinstance(run, TrainState | Mapping) else run.state


def _observe(loss: Any, state: Any) -> dict[str, Any]:
    """The loss and every leaf of what a save of ``state`` stores, copied, by dotted key."""
    from trainsnap.state.train_state import TrainState

    tree = state.save_tree() if isinstance(state, TrainState) else state
    out: dict[str, Any] = {"loss": _copy(loss)}
    out.update(_leaves("", tree))
    return out


def _leaves(prefix: str, node: Any) -> Iterator[tuple[str, Any]]:
    if hasattr(node, "state_dict") and not isinstance(node, torch.Tensor):
        node = node.state_dict()
    if isinstance(node, Mapping):
        for k, v in node.items():
            yield from _leaves(f"{prefix}{k}.", v)
    elif isinstance(node, list | tuple) and any(isinstance(v, torch.Tensor) for v in node):
        for k, v in enumerate(node):
            yield from _leaves(f"{prefix}{k}.", v)
    else:
        yield prefix.rstrip("."), _copy(node)


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return value


def _first_difference(want: dict[str, Any], got: dict[str, Any]) -> tuple[str, str] | None:
    for key in [*want, *(k for k in got if k not in want)]:
        if key not in want or key not in got:
            return key, "present in only one of the runs"
        a, b = want[key], got[key]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.dtype != b.dtype or a.shape != b.shape:
                return key, f"{a.dtype}{tuple(a.shape)} against {b.dtype}{tuple(b.shape)}"
            if not torch.equal(a, b):
                diff = (a.double() - b.double()).abs().max().item() if a.is_floating_point() else 0
                return key, f"max abs difference {diff:.3g}"
        elif a != b and not (a is None and b is None):
            return key, f"{a!r} against {b!r}"
    return None
