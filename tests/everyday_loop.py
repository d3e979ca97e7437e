"""The everyday training loop, as a new user writes it: an MLP with dropout, AdamW, a cosine
schedule, a shuffled dataset, ``ts.CheckpointManager(async_save=True)``.

``run(...)`` trains (resuming from ``root`` when it holds a snapshot) and returns one
``(step, sample ids, loss.hex())`` per step. As a script it runs every case of :data:`CASES`
in one process (a process start costs more than the training), each under ``DIR/<case>/``:
``crash`` trains each case past a save and leaves it there unclosed, as a crash would, and on
the last one waits for its save to commit, writes ``DIR/<case>/crash.jsonl.ready`` and sleeps,
to be SIGKILLed from outside; ``resume`` restores each case and trains it to the end.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import trainsnap as ts

SAMPLES, BATCH, DIM = 56, 4, 8  # 14 batches an epoch
PER_EPOCH = SAMPLES // BATCH
KINDS = ("stateful", "elastic", "plain")
SHAPES = ("steps", "epochs")
CASES = [(k, w, s) for k in ("stateful", "elastic") for w in (0, 2) for s in SHAPES]
TOTAL, SAVED, STOPPED = 20, 8, 10
"""Steps of a run; the step whose save the crash follows; the step a crashed case stopped at
(the saves are every 4 steps: none between the two)."""


def case_name(kind: str, workers: int, shape: str) -> str:
    return f"{kind}-w{workers}-{shape}"


class Samples(torch.utils.data.Dataset):
    """Sample ``i``: its id, an input and a target (no randomness of its own)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(SAMPLES, DIM, generator=g)
        self.y = torch.randn(SAMPLES, 1, generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def make_loader(kind: str, workers: int) -> tuple[Any, Any]:
    """(the loader, the ElasticSampler under it or None)."""
    data = Samples()
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(data, batch_size=BATCH, shuffle=True, num_workers=workers), None
    if kind == "elastic":
        sampler = ts.ElasticSampler(SAMPLES, global_batch_size=BATCH, seed=11, rank=0, world_size=1)
        loader = torch.utils.data.DataLoader(
            data, batch_size=BATCH, sampler=sampler, num_workers=workers
        )
        return loader, sampler
    return torch.utils.data.DataLoader(
        data, batch_size=BATCH, shuffle=True, num_workers=workers
    ), None


def make_state(kind: str, workers: int, total: int) -> dict[str, Any]:
    """Seeded alike in every run: the model, optimizer, schedule, loader and their TrainState."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total)
    loader, sampler = make_loader(kind, workers)
    state = ts.TrainState(model, opt, sched, dataloader=loader)
    return {
        "model": model,
        "opt": opt,
        "sched": sched,
        "loader": loader,
        "sampler": sampler,
        "state": state,
    }


def train_step(objs: dict[str, Any], batch: Any) -> tuple[list[int], str]:
    ids, x, y = batch
    loss = nn.functional.mse_loss(objs["model"](x), y)
    objs["opt"].zero_grad(set_to_none=True)
    loss.backward()
    objs["opt"].step()
    objs["sched"].step()
    if objs["sampler"] is not None:
        objs["sampler"].step()
    return ids.tolist(), loss.item().hex()


def run(
    kind: str,
    workers: int,
    shape: str,
    root: str,
    total: int,
    *,
    every: int = 4,
    stop_after: int | None = None,
    hold: bool = False,
    out: Path | None = None,
) -> list[tuple[int, list[int], str]]:
    objs = make_state(kind, workers, total)
    mgr = ts.CheckpointManager(root, interval=ts.Every(steps=every), async_save=True)
    restored = mgr.restore(objs["state"])
    step = 0 if restored is None else restored.step + 1
    if restored is not None and out is not None:
        Path(f"{out}.restored").write_text(json.dumps([restored.level, list(restored.reasons)]))
    rows: list[tuple[int, list[int], str]] = []

    def after(batch: Any) -> bool:
        nonlocal step
        ids, loss = train_step(objs, batch)
        rows.append((step, ids, loss))
        if out is not None:
            with open(out, "a") as f:
                f.write(json.dumps([step, ids, loss]) + "\n")
        mgr.step(step, objs["state"], metrics={"loss": float.fromhex(loss)})
        if step == stop_after and hold:
            mgr.wait()  # the last save is committed
            Path(f"{out}.ready").write_text(str(step))
            time.sleep(600)  # SIGKILLed from outside here
        step += 1
        return step < total and step - 1 != stop_after

    loader = objs["loader"]
    if shape == "steps":  # a step-based loop that starts a new iterator when an epoch ends
        it = iter(loader)
        while step < total:
            try:
                batch = next(it)
            except StopIteration:
                it = iter(loader)
                batch = next(it)
            if not after(batch):
                break
    else:  # for epoch ...: for batch in loader
        going = True
        for _epoch in range(step // PER_EPOCH, total // PER_EPOCH + 1):
            for batch in loader:
                going = after(batch)
                if not going:
                    break
            if not going:
                break
    if stop_after is None:
        mgr.close()
    else:
        mgr.wait()  # crashed after its last save: left unclosed
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("crash", "resume"))
    p.add_argument("dir")
    a = p.parse_args()
    for i, (kind, workers, shape) in enumerate(CASES):
        case = Path(a.dir) / case_name(kind, workers, shape)
        case.mkdir(parents=True, exist_ok=True)
        last = i == len(CASES) - 1
        stop = (SAVED if last else STOPPED) if a.mode == "crash" else None
        run(
            kind,
            workers,
            shape,
            str(case / "root"),
            TOTAL,
            stop_after=stop,
            hold=last and a.mode == "crash",
            out=case / f"{a.mode}.jsonl",
        )


if __name__ == "__main__":
    main()


# -- data parallel: the same loop on gloo ranks, over an ElasticSampler -----------------------


class DerivedDropoutMLP(nn.Module):
    """The MLP with its dropout masks drawn from (seed, step, sample id), not from the global
    RNG: the same masks for a sample whatever the number of ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out = nn.Linear(DIM, 32), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, ids: list[int], step: int) -> torch.Tensor:
        h = torch.relu(self.hidden(x))
        keep = [torch.rand(h.shape[1:], generator=ts.rng.generator(99, step, i)) > 0.2 for i in ids]
        return self.out(h * torch.stack(keep) / 0.8)


def ranks_run(
    rank: int, world: int, root: str, total: int, stop_after: int | None
) -> list[tuple[int, list[int], str]]:
    """The loop on ``world`` data-parallel ranks with a global batch of ``BATCH``; returns
    (step, global sample ids, mean loss.hex()) per step on every rank. Resumes from ``root``
    when it holds a snapshot; after step ``stop_after`` it waits for its save and returns
    without closing the manager, as a crash would leave it."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)  # alike on every rank: the RNG state is stored once, valid on any world
    model = DerivedDropoutMLP()
    ddp = DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total)
    sampler = ts.ElasticSampler(
        SAMPLES, global_batch_size=BATCH, seed=11, rank=rank, world_size=world
    )
    loader = torch.utils.data.DataLoader(Samples(), batch_size=BATCH // world, sampler=sampler)
    state = ts.TrainState(ddp, opt, sched, dataloader=loader)
    mgr = ts.CheckpointManager(root, interval=ts.Every(steps=4), async_save=True)
    restored = mgr.restore(state)
    step = 0 if restored is None else restored.step + 1
    rows = []
    it = iter(loader)
    while step < total:
        try:
            ids, x, y = next(it)
        except StopIteration:
            it = iter(loader)
            ids, x, y = next(it)
        loss = nn.functional.mse_loss(ddp(x, ids.tolist(), step), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        sampler.step()
        mean, every_id = loss.detach().clone(), [ids.tolist()]
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
            every_id = [None] * world
            dist.all_gather_object(every_id, ids.tolist())
        rows.append((step, [i for part in every_id for i in part], mean.item().hex()))
        mgr.step(step, state)
        if step == stop_after:
            mgr.wait()
            return rows
        step += 1
    mgr.close()
    return rows
