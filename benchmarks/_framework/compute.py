"""How much a save that drains in the background slows training: a compute-bound step, timed
step by step before, during and after any method's asynchronous save.

Each save's slowdown is taken against the steps just around it (so that a slow drift of the
machine's load cancels), then summarized over the saves by medians.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks._framework.method import Method, Pending, State, median


class Compute:
    """A compute-bound training step: ``count`` matmuls of ``size`` x ``size`` fp32, ``count``
    chosen for a step of about ``target_s`` (at least one matmul)."""

    def __init__(self, size: int = 1024, target_s: float = 0.03) -> None:
        generator = torch.Generator().manual_seed(1)
        self.a = torch.randn(size, size, generator=generator)
        self.b = torch.randn(size, size, generator=generator)
        self.c = torch.empty(size, size)
        self.size = size
        self.count = 1
        for _ in range(3):
            self.step()
        one = median([self.timed_step() for _ in range(7)])
        self.count = max(1, round(target_s / one))

    def step(self) -> None:
        for _ in range(self.count):
            torch.mm(self.a, self.b, out=self.c)

    def timed_step(self) -> float:
        start = time.perf_counter()
        self.step()
        return time.perf_counter() - start

    def describe(self) -> dict[str, Any]:
        threads = torch.get_num_threads()
        return {"matmul_n": self.size, "matmuls_per_step": self.count, "torch_threads": threads}


@dataclass
class Drain:
    """The steps around and during one asynchronous save."""

    pause: float
    drain: float
    before: list[float]  # steps with no save, just before it
    steps: list[float]  # steps that started before the save was committed
    after: list[float]  # steps with no save, just after it

    @property
    def base(self) -> float:
        """The step time with no save around this one (median of the steps before and after)."""
        return median(self.before + self.after)

    @property
    def lost(self) -> float:
        """Compute seconds lost to this save while it drained."""
        return sum(self.steps) - len(self.steps) * self.base


def steps_until_committed(compute: Compute, pending: Pending) -> tuple[list[float], float]:
    """Compute steps until ``pending`` is committed; (their times, the drain's seconds). A
    failed save raises here."""
    returned = time.perf_counter()
    done: list[float] = []
    errors: list[BaseException] = []

    def watch() -> None:
        try:
            pending.wait()
        except BaseException as error:
            errors.append(error)
        finally:
            done.append(time.perf_counter())

    watcher = threading.Thread(target=watch, name="drain-watch", daemon=True)
    watcher.start()
    steps: list[float] = []
    while not done:
        steps.append(compute.timed_step())
    watcher.join()
    if errors:
        raise errors[0]
    return steps, done[0] - returned


def save_while_computing(
    compute: Compute, method: Method, state: State, directory: Path, around: int
) -> Drain:
    """``around`` steps, then a save by ``method`` and steps until it is committed, then
    ``around`` steps."""
    before = [compute.timed_step() for _ in range(around)]
    pending = method.save(state, directory)
    if pending is None:
        raise ValueError(f"{method.name} saves synchronously: there is no drain to measure")
    steps, drain_s = steps_until_committed(compute, pending)
    after = [compute.timed_step() for _ in range(around)]
    return Drain(pending.pause, drain_s, before, steps, after)


def summarize(drains: list[Drain]) -> dict[str, Any]:
    """Medians over the saves: per save against the steps just around it, then over saves."""
    steps = [x for drain in drains for x in drain.steps]
    return {
        "pause_s": [drain.pause for drain in drains],
        "drain_s": [drain.drain for drain in drains],
        "drain_median_s": median([drain.drain for drain in drains]),
        "steps_during_drain": [len(drain.steps) for drain in drains],
        "no_save_step_median_s": [drain.base for drain in drains],
        "step_median_s": median(steps),
        "step_mean_s": sum(steps) / len(steps),
        "step_median_per_save_s": [median(drain.steps) for drain in drains],
        "slowdown_median": median([median(drain.steps) / drain.base for drain in drains]),
        "slowdown_mean": median([sum(d.steps) / len(d.steps) / d.base for d in drains]),
        "lost_compute_s": [drain.lost for drain in drains],
        "lost_fraction_of_drain": median([d.lost / d.drain for d in drains if d.drain > 0]),
    }
