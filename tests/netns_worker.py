"""A rank of a namespace drill (tests/test_netns.py), run as a script inside a node:
``train`` saves a memory snapshot every step (durable every 4) and records each committed step,
then waits to be killed; ``restore`` restarts and prints what it restored, as JSON."""

from __future__ import annotations

import faulthandler
import json
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import trainsnap as ts

ROWS, COLS = 16, 64


def part(step: int, rank: int, world: int) -> dict[str, object]:
    """This rank's rows of a global tensor that is a pure function of the step."""
    full = torch.randn(ROWS * world, COLS, generator=torch.Generator().manual_seed(step))
    local = full[rank * ROWS : (rank + 1) * ROWS].clone()
    return {"w": ts.Sharded(local, global_shape=(ROWS * world, COLS), offsets=(rank * ROWS, 0))}


def manager(durable: str, shm: str, node: int) -> ts.CheckpointManager:
    tier = ts.MemoryTier(root=shm, node=node, replicas=1, wait_if_busy=True)
    options = ts.ManagerOptions(timeout=8, preemption_signals=())
    return ts.CheckpointManager(
        durable, interval=ts.Every(steps=4), memory=tier, async_save=False, options=options
    )


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung rank's stacks, on demand
    mode, rank, world, node = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    durable, shm, progress = sys.argv[5], sys.argv[6], Path(sys.argv[7])
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    mgr = manager(durable, shm, node)
    if mode == "train":
        try:
            for step in range(1, 1000):
                mgr.step(step, part(step, rank, world))
                mgr.wait()
                progress.write_text(str(step))
                time.sleep(0.2)
        except ts.TrainsnapError as e:  # a partition: the save fails within the bound
            print(json.dumps({"error": str(e)[:500], "at": time.time()}), flush=True)
            sys.exit(3)
    start = time.monotonic()
    dest = {
        "w": ts.Sharded(
            torch.zeros(ROWS, COLS), global_shape=(ROWS * world, COLS), offsets=(rank * ROWS, 0)
        )
    }
    info = mgr.restore(dest)
    seconds = time.monotonic() - start
    mgr.close()
    same = info is not None and torch.equal(
        dest["w"].local,
        part(info.step, rank, world)["w"].local,  # type: ignore[attr-defined]
    )
    print(
        json.dumps(
            {"step": None if info is None else info.step, "bitwise": same, "seconds": seconds}
        ),
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
