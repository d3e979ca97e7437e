""":func:`~trainsnap.testing.check_resume` with a real crash: the saving run trains in a fresh
process (``multiprocessing``'s spawn) that is SIGKILLed once its snapshot is committed, while it
trains on; the resumed run trains in another fresh process and hands back what it observed.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainsnap.errors import TrainsnapError

_WAIT_SECONDS = 600.0
"""Longest wait for a child's save or its resumed steps (a loop that hangs fails the check)."""


def crash_and_resume(
    make: Callable[[], Any],
    step: Callable[[Any, int], Any],
    state_of: Callable[[Any], Any],
    steps: int,
    restore_after: int,
    level: str,
    root: str,
) -> tuple[str, list[dict[str, Any]]]:
    """(level the restore reached, the observations of steps ``restore_after + 1 ..``)."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    crashed = context.Process(
        target=_train_then_wait_for_kill,
        args=(make, step, state_of, steps, restore_after, root, sender),
        name="trainsnap-resume-check-crashed",
    )
    crashed.start()
    sender.close()
    try:
        if not receiver.poll(_WAIT_SECONDS):
            raise TrainsnapError("check_resume: the crashed run's process never saved")
        said = receiver.recv()
    except EOFError:
        said = "the process exited before saving"
    finally:
        if crashed.pid is not None and crashed.exitcode is None:
            os.kill(crashed.pid, signal.SIGKILL)
        crashed.join()
        receiver.close()
    if said != "saved":
        raise TrainsnapError(f"check_resume: the run to crash failed before its save: {said}")
    out = Path(root) / "resumed.pt"
    resumed = context.Process(
        target=_restore_and_train,
        args=(make, step, state_of, steps, restore_after, level, root, str(out)),
        name="trainsnap-resume-check-resumed",
    )
    resumed.start()
    resumed.join(_WAIT_SECONDS)
    if resumed.exitcode is None:
        resumed.kill()
        resumed.join()
    import torch

    result: tuple[Any, Any] = ("error", "no result")
    if out.exists():  # written by our own child into our own temporary directory
        result = torch.load(out, weights_only=False)
    if result[0] == "error" or resumed.exitcode != 0:
        raise TrainsnapError(
            f"check_resume: the resumed run's process failed (exit {resumed.exitcode}): {result[1]}"
        )
    return str(result[0]), list(result[1])


def _train_then_wait_for_kill(
    make: Callable[[], Any],
    step: Callable[[Any, int], Any],
    state_of: Callable[[Any], Any],
    steps: int,
    restore_after: int,
    root: str,
    sender: Any,
) -> None:
    """(child) Train to ``restore_after``, save, say so, and train on until killed."""
    from trainsnap.api.snapshots import save

    try:
        run = make()
        for i in range(restore_after + 1):
            step(run, i)
        save(state_of(run), root, step=restore_after, no_dist=True)
    except BaseException:
        sender.send(traceback.format_exc(limit=20))
        raise
    sender.send("saved")
    for i in range(restore_after + 1, steps):
        step(run, i)  # the kill lands somewhere in here, or in the wait below
    signal.pause()


def _restore_and_train(
    make: Callable[[], Any],
    step: Callable[[Any, int], Any],
    state_of: Callable[[Any], Any],
    steps: int,
    restore_after: int,
    level: str,
    root: str,
    out: str,
) -> None:
    """(child) Restore into fresh objects, train the remaining steps, save the observations."""
    import torch

    from trainsnap.api.snapshots import load
    from trainsnap.testing._observation import observe

    try:
        run = make()
        info = load(state_of(run), root, level=level, allow_downgrade=True)
        observed = [observe(step(run, i), state_of(run)) for i in range(restore_after + 1, steps)]
        torch.save((info.level, observed), out)
    except BaseException:
        torch.save(("error", traceback.format_exc(limit=20)), out)
        raise
