"""A restore after any step continues bitwise: every position of an epoch, its last step and the
next epoch's first included, for each data cursor (StatefulDataLoader with 0 and 2 workers, a
DataLoader over ts.ElasticSampler) and for loops that call ``iter()`` once per epoch or once per
run (a new iterator only when one ends), on 1 and on 4 ranks.

The uninterrupted run saves after every step; then, in the same process (one launch for 4
ranks), each snapshot is restored into freshly built objects and trained to the end, and every
later step -- its samples, its loss (dropout draws from torch's generator), Python's and NumPy's
draws -- must be the uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import trainsnap as ts
from trainsnap.testing import assert_all_ok, run_ranks

GLOBAL_BATCH = 4
CURSORS = [("stateful", 0), ("stateful", 2), ("elastic", 0), ("elastic", 2)]
SHAPES = ("epochs", "run")
Row = tuple[int, list[int], str, str, str]


class Samples(torch.utils.data.Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    def __init__(self, count: int) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(count, 4, generator=g)
        self.y = torch.randn(count, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def _build(kind: str, workers: int, rank: int, world: int, per_epoch: int) -> dict[str, Any]:
    """The run's objects, seeded alike in every run (per rank: the RNG is per-rank state)."""
    samples = per_epoch * GLOBAL_BATCH
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    torch.manual_seed(0)  # the same weights on every rank (the gradients are averaged)
    for p in model.parameters():
        nn.init.normal_(p, std=0.3)
    torch.manual_seed(100 + rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = None
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        shard = torch.utils.data.Subset(Samples(samples), range(rank, samples, world))
        loader: Any = StatefulDataLoader(
            shard, batch_size=GLOBAL_BATCH // world, shuffle=True, num_workers=workers
        )
    else:
        sampler = ts.ElasticSampler(
            samples, global_batch_size=GLOBAL_BATCH, seed=7, rank=rank, world_size=world
        )
        loader = torch.utils.data.DataLoader(
            Samples(samples),
            batch_size=GLOBAL_BATCH // world,
            sampler=sampler,
            num_workers=workers,
        )
    state = ts.TrainState(model, opt, dataloader=loader)
    return {"model": model, "opt": opt, "loader": loader, "sampler": sampler, "state": state}


def _train_step(objs: dict[str, Any], batch: Any, step: int, world: int) -> Row:
    ids, x, y = batch
    loss = nn.functional.mse_loss(objs["model"](x), y)
    objs["opt"].zero_grad(set_to_none=True)
    loss.backward()
    if world > 1:  # data parallel: one all-reduce of every gradient
        import torch.distributed as dist

        grads = [p.grad for p in objs["model"].parameters()]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat)
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g) / world)
    objs["opt"].step()
    if objs["sampler"] is not None:
        objs["sampler"].step()
    return step, ids.tolist(), loss.item().hex(), random.random().hex(), np.random.rand().hex()


def _run(
    objs: dict[str, Any], shape: str, start: int, world: int, per_epoch: int, save: str | None
) -> list[Row]:
    """Steps ``start`` to the end (two epochs and two steps); saved to ``save`` after each step
    when given."""
    rows: list[Row] = []
    step, total = start, 2 * per_epoch + 2

    def after(batch: Any) -> bool:
        nonlocal step
        rows.append(_train_step(objs, batch, step, world))
        if save is not None:
            ts.save(objs["state"], save, step=step, timeout=60)
        step += 1
        return step < total

    loader = objs["loader"]
    if shape == "run":  # iter() once per run; a new iterator only when one ends
        it = iter(loader)
        while step < total:
            try:
                batch = next(it)
            except StopIteration:
                it = iter(loader)
                batch = next(it)
            after(batch)
    else:  # for epoch ...: for batch in loader
        for _epoch in range(start // per_epoch, total // per_epoch + 1):
            going = True
            for batch in loader:
                going = after(batch)
                if not going:
                    break
            if not going:
                break
    return rows


def every_restore(
    rank: int, world: int, root: str, case: tuple[str, int, str], per_epoch: int
) -> dict[int, list[str]]:
    """The uninterrupted run saving every step, then a restore of each step trained to the end:
    for each restored step, what differs from the uninterrupted run (none: bitwise)."""
    kind, workers, shape = case
    objs = _build(kind, workers, rank, world, per_epoch)
    reference = _run(objs, shape, 0, world, per_epoch, save=root)
    final = [p.detach().clone() for p in objs["model"].parameters()]
    ids = {s.step: s.id for s in ts.list_snapshots(root)}
    assert sorted(ids) == list(range(len(reference))), sorted(ids)
    diffs: dict[int, list[str]] = {}
    for saved in range(len(reference) - 1):
        objs = _build(kind, workers, rank, world, per_epoch)
        info = ts.load(objs["state"], root, snapshot=ids[saved], timeout=60)
        rows = _run(objs, shape, saved + 1, world, per_epoch, save=None)
        found = [] if info.level == "strict" else [f"level {info.level}: {info.reasons}"]
        want = reference[saved + 1 :]
        found += [f"step {a[0]}: {a} != {b}" for a, b in zip(rows, want, strict=False) if a != b]
        if len(rows) != len(want):
            found.append(f"{len(rows)} steps after the restore, the run had {len(want)}")
        params = list(objs["model"].parameters())
        if not all(torch.equal(p, q) for p, q in zip(params, final, strict=True)):
            found.append("the final weights differ")
        diffs[saved] = found[:2]
    return {s: d for s, d in diffs.items() if d}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("kind", "workers"), CURSORS)
def test_a_restore_after_every_step_continues_bitwise(tmp_path, kind, workers, shape) -> None:
    """6 steps an epoch: 13 restores, the epochs' last steps (5, 11) and first (6, 12) among
    them."""
    assert every_restore(0, 1, str(tmp_path), (kind, workers, shape), per_epoch=6) == {}


FOUR_RANK_CASES = [
    ("elastic", 0, "run"),
    ("stateful", 0, "epochs"),
    *(
        [("elastic", 0, "epochs"), ("stateful", 2, "run")]
        if os.environ.get("TRAINSNAP_EVERY_STEP_FULL")
        else []
    ),
]
"""Cursors and loop shapes on 4 ranks (every shape of each is covered on one rank). The bounded
CI form runs two; ``TRAINSNAP_EVERY_STEP_FULL=1`` adds ElasticSampler's epoch loop and
StatefulDataLoader with 2 workers."""


def _four_ranks(rank: int, world: int, root: str) -> dict[str, dict[int, list[str]]]:
    out = {}
    for case in FOUR_RANK_CASES:
        name = "-".join(map(str, case))
        out[name] = every_restore(rank, world, f"{root}/{name}", case, per_epoch=3)
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_four_ranks_restore_after_every_step_bitwise(tmp_path) -> None:
    """One launch: each cursor on 4 ranks, 3 steps an epoch (each rank a batch of one), each
    restored at every one of its 8 steps but the last."""
    out = assert_all_ok(run_ranks(_four_ranks, 4, args=(str(tmp_path),), timeout=900))
    for rank, cases in enumerate(out):
        assert all(diffs == {} for diffs in cases.values()), (rank, cases)
