"""What a CheckpointManager costs the training loop, step by step.

One process, CPU. A state of ``--mib`` MiB (fp32 and bf16 tensors of mixed sizes, from
``benchmarks._framework.state.make_state``) is trained by a stand-in step (one tensor changed in
place) that takes ``--step-ms`` (a sleep: the background drain has the cores to itself, as it
would beside an accelerator's compute) under::

    ts.CheckpointManager(remote, interval=Every(steps=2 * every), retention=KeepLast(2),
                         local=LocalTier(root=local, interval=Every(steps=every),
                                         retention=KeepLast(2)),
                         async_save=True)

Every call of ``mgr.step`` is timed:

- **idle step**: a step the policies do not save at. Its time is the manager's overhead on most
  steps of a run (no store operation: see ``tests/test_after_commit.py`` for the count on several
  processes).
- **pause**: a step that saves (local tier, or both tiers). Its time is what training waits for:
  the capture and the staging copy; the writes drain in the background. Beside it, ``memcpy``:
  one copy (``benchmarks._framework.state.OneCopy``, as every benchmark measures it: ``copy_``
  of every tensor into preallocated tensors whose pages were touched before), the floor of any
  staging copy, measured one step after each save (the same moment's machine).

The first ``2 * --every`` steps warm the pools and are not counted. Each of ``--reps``
repetitions runs ``--steps`` steps in a fresh pair of roots; reported are the medians over all
counted steps of all repetitions, and the pause against the copy.

    python -m benchmarks.manager_step                    # 256 MiB, 40 steps of 50 ms, save every 4
    python -m benchmarks.manager_step --mib 64 --reps 3 --json out.json
    python -m benchmarks.manager_step --smoke

To compare two commits on this benchmark, alternating: ``python -m benchmarks.compare``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

import trainsnap as ts
from benchmarks._framework import cli
from benchmarks._framework.method import median
from benchmarks._framework.report import emit, facts
from benchmarks._framework.state import (
    ONE_COPY,
    MiB,
    OneCopy,
    Tensors,
    make_state,
    state_nbytes,
)
from benchmarks._framework.system import fresh_dir, load_average, machine_info, scratch_root


def _run(
    state: Tensors, copies: OneCopy, directory: Path, steps: int, every: int, step_s: float
) -> dict[str, list[float]]:
    """Seconds of each counted ``mgr.step`` call, by kind (``idle``, ``pause``), and of a
    memory copy of the state taken at each step after a save (``copy``: the same moment's
    machine)."""
    times: dict[str, list[float]] = {"idle": [], "pause": [], "copy": []}
    moving = max(state, key=lambda key: state[key].numel())
    mgr = ts.CheckpointManager(
        directory / "remote",
        interval=ts.Every(steps=2 * every),
        retention=ts.KeepLast(2),
        local=ts.LocalTier(
            root=directory / "local", interval=ts.Every(steps=every), retention=ts.KeepLast(2)
        ),
        async_save=True,
    )
    try:
        for step in range(steps + 2 * every):
            state[moving].add_(1)
            time.sleep(step_s)
            start = time.perf_counter()
            saved = mgr.step(step, state)
            seconds = time.perf_counter() - start
            if step >= 2 * every:
                times["pause" if saved else "idle"].append(seconds)
                if saved:
                    time.sleep(step_s)
                    times["copy"].append(copies.seconds(state))
    finally:
        mgr.close()
    return times


def measure(args: Any) -> dict[str, Any]:
    state = make_state(args.mib * MiB / (1 << 30), small_tensors=200, seed=args.seed)
    copies = OneCopy(state)
    idle: list[float] = []
    pause: list[float] = []
    copy: list[float] = []
    with scratch_root(args.dir, 8 * state_nbytes(state), "manager-step-") as scratch:
        for _ in range(args.reps):
            with fresh_dir(scratch) as directory:
                times = _run(state, copies, directory, args.steps, args.every, args.step_ms / 1e3)
            idle += times["idle"]
            pause += times["pause"]
            copy += times["copy"]
    return {
        "state_bytes": state_nbytes(state),
        "idle_steps": len(idle),
        "saving_steps": len(pause),
        "idle_step_s": median(idle),
        "pause_s": median(pause),
        "memcpy_s": median(copy),
        "pause_over_memcpy": median(pause) / median(copy),
    }


def main(argv: list[str] | None = None) -> int:
    arguments = cli.parser(__doc__, reps=3)
    arguments.add_argument("--mib", type=int, default=256, help="state size in MiB (default 256)")
    arguments.add_argument("--steps", type=int, default=40, help="counted steps per repetition")
    arguments.add_argument("--step-ms", type=float, default=50.0, help="a step's time (ms)")
    arguments.add_argument("--every", type=int, default=4, help="local save every N steps")
    args = cli.parse(arguments, argv, {"mib": 4, "steps": 8, "every": 2, "reps": 1, "step_ms": 5.0})
    torch.manual_seed(args.seed)
    result = measure(args)
    text = "\n".join(
        [
            facts("machine", machine_info()),
            facts("load", {"average": load_average()}),
            facts(
                "manager step",
                {
                    "state": f"{result['state_bytes'] / MiB:.0f} MiB",
                    "idle step": f"{result['idle_step_s'] * 1e6:.0f} us "
                    f"(median of {result['idle_steps']})",
                    "pause": f"{result['pause_s'] * 1e3:.1f} ms "
                    f"(median of {result['saving_steps']})",
                    "memcpy": f"{result['memcpy_s'] * 1e3:.1f} ms",
                    "pause / memcpy": f"{result['pause_over_memcpy']:.2f}",
                },
            ),
            f"memcpy, {ONE_COPY}",
        ]
    )
    emit(result, text, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
