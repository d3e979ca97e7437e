"""A tiny but complete training run for resume tests: a transformer with dropout, AdamW, a
warmup-cosine schedule, an enabled GradScaler whose scale changes, and a shuffled data loader.

Rank functions for :func:`harness.run_ranks` live here so that tests and benchmarks share them.
"""

from __future__ import annotations

import math
import os
import random
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import trainsnap as ts

VOCAB, DIM, SEQ = 61, 32, 12


class TinyLM(nn.Module):
    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = nn.TransformerEncoderLayer(
            DIM, nhead=4, dim_feedforward=64, dropout=dropout, batch_first=True
        )
        self.head = nn.Linear(DIM, VOCAB)
        self.unused = nn.Linear(4, 4)  # never gets a gradient: AdamW keeps no state for it

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(tokens)))


def dataset(n: int = 512, seed: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (SEQ + 1,), generator=g) for _ in range(n)]


def warmup_cosine(opt: torch.optim.Optimizer, warmup: int, total: int) -> Any:
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return torch.optim.lr_scheduler.LambdaLR(opt, f)


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def single_process_run(
    rank: int, world: int, root: str, out: str, total: int, save_every: int, kill_after: int | None
) -> None:
    """Train ``total`` steps (resuming from ``root`` if it holds a snapshot), saving every
    ``save_every`` steps; SIGKILL itself right after step ``kill_after``. Appends
    ``step loss.hex() scale`` lines to ``out/losses.txt``; at the end writes final params."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = warmup_cosine(opt, warmup=5, total=total)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    # The loader draws its shuffling and worker seeds from its own generator, not from the
    # global RNG: creating its iterator after a restore must not move the dropout stream.
    loader = StatefulDataLoader(
        dataset(),
        batch_size=8,
        shuffle=True,
        num_workers=2,
        generator=torch.Generator().manual_seed(1),
    )
    state = ts.TrainState(model, opt, sched, scaler, loader, extra={"tokens_seen": 0})
    start = 0
    if ts.list_snapshots(root):
        info = ts.load(state, root)
        assert info.level == "strict", info
        start = info.step + 1
    it = iter(loader)
    log = Path(out) / "losses.txt"
    for step in range(start, total):
        batch = next(it)
        loss = lm_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        state.extra["tokens_seen"] += batch.numel()
        with log.open("a") as f:
            f.write(f"{step} {loss.item().hex()} {scaler.get_scale()}\n")
        if step % save_every == 0:
            ts.save(state, root, step=step)
        if step == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, Path(out) / "final.pt")
    with (Path(out) / "scale.txt").open("w") as f:
        f.write(str(scaler.get_scale()))


# -- data parallel with the elastic sampler and derived randomness ------------------------------


class DerivedDropoutLM(TinyLM):
    """Dropout masks from (seed, step, global sample id): the same on any rank layout."""

    def __init__(self) -> None:
        super().__init__(dropout=0.0)
        self.step = 0

    def forward_ids(self, tokens: torch.Tensor, ids: list[int]) -> torch.Tensor:
        x = self.embed(tokens)
        masks = [
            torch.rand(x.shape[1:], generator=ts.rng.generator(1234, self.step, i)) > 0.1
            for i in ids
        ]
        x = x * torch.stack(masks) / 0.9
        return self.head(self.block(x))


def elastic_run(
    rank: int, world: int, root: str, out: str, start_total: tuple[int, int], save_at: int
) -> list[tuple[int, list[int], str]]:
    """Data-parallel training with ElasticSampler; returns (step, global sample ids, loss.hex())
    per step, as rank 0 sees them. Resumes from ``root`` when it holds a snapshot."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    _, total = start_total
    # Every rank seeds every generator alike; randomness that must differ per sample comes from
    # ts.rng (seed, step, sample id). The global RNG state is then the same on every rank, stored
    # once, and valid on any number of ranks: strict resume survives the topology change.
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = DerivedDropoutLM()
    ddp = DDP(model, find_unused_parameters=True) if dist.is_initialized() else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = dataset()
    sampler = ts.ElasticSampler(len(data), global_batch_size=8, seed=5, rank=rank, world_size=world)
    state = ts.TrainState(ddp, opt, dataloader=sampler)
    start = 0
    if ts.list_snapshots(root):
        info = ts.load(state, root)
        assert info.level == "strict", info
        start = info.step + 1
    loader = torch.utils.data.DataLoader(
        range(len(data)), batch_size=sampler.local_batch_size, sampler=sampler
    )
    it = iter(loader)
    rows = []
    for step in range(start, total):
        ids = next(it).tolist()
        model.step = step
        batch = torch.stack([data[i] for i in ids])
        logits = (
            model.forward_ids(batch[:, :-1], ids) if world == 1 else _ddp_forward(ddp, batch, ids)
        )
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sampler.step()
        global_ids, global_loss = _gather(ids, loss.detach(), world)
        rows.append((step, global_ids, global_loss.hex()))
        if step == save_at:
            ts.save(state, root, step=step)
    return rows


def _ddp_forward(ddp: Any, batch: torch.Tensor, ids: list[int]) -> torch.Tensor:
    # DDP wraps forward(); the derived-dropout path is a method, so go through the module's
    # forward hook machinery by temporarily pointing forward at it.
    module = ddp.module
    module.forward = lambda tokens: module.forward_ids(tokens, ids)
    try:
        return ddp(batch[:, :-1])
    finally:
        del module.forward


def _gather(ids: list[int], loss: torch.Tensor, world: int) -> tuple[list[int], float]:
    if world == 1:
        return ids, float(loss.item())
    all_ids: list[Any] = [None] * world
    dist.all_gather_object(all_ids, ids)
    total = loss.clone()
    dist.all_reduce(total)
    return [i for part in all_ids for i in part], float(total.item() / world)
