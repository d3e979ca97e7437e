"""One rank of the demo's training job: a small transformer LM with tensor parallelism (DTensor,
Megatron-style column/row splits) and data parallelism, saving asynchronously through the
CheckpointManager, resuming from whatever the root holds.

Run by :mod:`trainsnap.tools.demo`:
``python -m trainsnap.tools.demo_worker --root ... --dp 2 --tp 2 ...``
with ``RANK``/``WORLD_SIZE`` set and a file rendezvous. Rank 0 appends one JSON line per step and
per save to ``--log``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import trainsnap as ts
from trainsnap import faults

VOCAB, DIM, HEADS, LAYERS, SEQ = 96, 64, 4, 2, 24
GLOBAL_BATCH, DATASET = 8, 2048
SEED = 1234


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q, self.k, self.v = (nn.Linear(DIM, DIM) for _ in range(3))
        self.o = nn.Linear(DIM, DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.heads = HEADS  # heads on this rank: divided by the TP size once parallelised

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (
            f(h).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        out: torch.Tensor = x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))
        return out


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor, ids: list[int], step: int) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        # Dropout from (seed, step, global sample id): the same masks on any rank layout.
        keep = torch.stack(
            [torch.rand(x.shape[1:], generator=ts.rng.generator(SEED, step, i)) > 0.1 for i in ids]
        )
        x = x * keep / 0.9
        for blk in self.blocks:
            x = blk(x)
        logits: torch.Tensor = self.head(self.ln(x))
        return logits


def dataset() -> torch.Tensor:
    """Sequences from a fixed random Markov chain: learnable structure, so the loss falls."""
    g = torch.Generator().manual_seed(7)
    trans = torch.softmax(torch.randn(VOCAB, VOCAB, generator=g) * 3, dim=-1)
    seqs = torch.empty(DATASET, SEQ + 1, dtype=torch.long)
    seqs[:, 0] = torch.randint(0, VOCAB, (DATASET,), generator=g)
    for t in range(SEQ):
        seqs[:, t + 1] = torch.multinomial(trans[seqs[:, t]], 1, generator=g).squeeze(1)
    return seqs


def parallelize(model: TinyGPT, mesh: Any) -> None:
    """Megatron-style tensor parallelism on the mesh's "tp" dimension (DTensor parameters);
    embeddings, norms and the head stay plain tensors, replicated on every rank (the snapshot
    stores them once after checking that every rank holds the same bytes)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = mesh["tp"]
    for blk in model.blocks:
        parallelize_module(
            blk,
            tp,
            {
                "q": ColwiseParallel(),
                "k": ColwiseParallel(),
                "v": ColwiseParallel(),
                "o": RowwiseParallel(),
                "fc1": ColwiseParallel(),
                "fc2": RowwiseParallel(),
            },
        )
        blk.heads = HEADS // tp.size()


def warmup_cosine(step: int, total: int) -> float:
    if step < 10:
        return (step + 1) / 10
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 10) / max(1, total - 10)))


def average_gradients(model: nn.Module, dp_group: Any, dp: int) -> None:
    """Data parallelism: average gradients over the data-parallel group, as one flat buffer."""
    if dp == 1:
        return
    grads: list[torch.Tensor] = []
    for p in model.parameters():
        g: Any = p.grad
        grads.append(g.to_local() if hasattr(g, "to_local") else g)
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=dp_group)
    flat /= dp
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--dp", type=int, required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--crash-at", type=int, default=-1, help="rank 1 dies writing this step's save")
    ap.add_argument("--log", required=True)
    ap.add_argument("--rendezvous", required=True)
    return ap.parse_args()


class Job:
    """One rank's model, optimizer, data cursor and manager."""

    def __init__(self, args: argparse.Namespace) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.args = args
        self.rank = dist.get_rank()
        self.mesh = init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
        self.dp_group = self.mesh["dp"].get_group()
        random.seed(SEED)
        np.random.seed(SEED)
        torch.manual_seed(SEED)  # alike on every rank: the RNG state is stored once
        self.model = TinyGPT()
        parallelize(self.model, self.mesh)
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=3e-3, weight_decay=0.01, foreach=False
        )
        sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: warmup_cosine(s, args.steps))
        self.data = dataset()
        self.sampler = ts.ElasticSampler(
            DATASET,
            global_batch_size=GLOBAL_BATCH,
            seed=SEED,
            rank=self.mesh.get_local_rank("dp"),
            world_size=args.dp,
        )
        self.state = ts.TrainState(
            self.model,
            self.opt,
            sched,
            dataloader=self.sampler,
            extra={"tokens_seen": 0},
            versions={"model": "tinygpt-1", "data": "markov-7"},
        )
        self.mgr = ts.CheckpointManager(
            args.root,
            interval=ts.Every(steps=args.save_every),
            retention=ts.KeepLast(3),
            options=ts.ManagerOptions(timeout=30, gc_grace=600, progress_seconds=0.0),
        )
        self.log = Path(args.log)

    def emit(self, **kw: Any) -> None:
        if self.rank == 0:
            with self.log.open("a") as f:
                f.write(json.dumps(kw) + "\n")

    def train_step(self, step: int, ids: list[int]) -> float:
        batch = self.data[ids]
        logits = self.model(batch[:, :-1], ids, step)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        average_gradients(self.model, self.dp_group, self.args.dp)
        self.opt.step()
        self.state.schedulers[0].step()
        self.sampler.step()
        self.state.extra["tokens_seen"] += GLOBAL_BATCH * SEQ
        total = loss.detach().clone()
        dist.all_reduce(total, group=self.dp_group)
        return float(total.item()) / int(self.args.dp)

    def global_ids(self, ids: list[int]) -> list[int]:
        everyone: list[Any] = [None] * self.args.dp
        dist.all_gather_object(everyone, ids, group=self.dp_group)
        return [i for part in everyone for i in part]

    def run(self) -> None:
        restored = self.mgr.restore(self.state)
        start = 0 if restored is None else restored.step + 1
        if restored is not None:
            self.emit(event="restore", step=restored.step, level=restored.level, id=restored.id)
        indices: Any = range(DATASET)
        loader: Any = torch.utils.data.DataLoader(
            indices, batch_size=self.sampler.local_batch_size, sampler=self.sampler
        )
        it = iter(loader)
        for step in range(start, self.args.steps):
            t0 = time.perf_counter()
            ids = next(it).tolist()
            loss = self.train_step(step, ids)
            if self.rank == 1 and step == self.args.crash_at:
                faults.install("mid_write=crash")  # this step's save kills rank 1 mid-write
            saved = self.mgr.step(step, self.state)
            pause = self.mgr._handles[-1].pause if saved and self.mgr._handles else 0.0
            self.emit(
                event="step",
                step=step,
                loss=loss,
                ids=self.global_ids(ids),
                seconds=time.perf_counter() - t0,
                saved=saved,
                pause=pause,
            )
        self.mgr.close()
        self.emit(event="done", step=self.args.steps - 1)


def main() -> None:
    args = _args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=args.rendezvous,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        Job(args).run()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Done and torn down: skip interpreter finalization, whose destruction of torch's C++
    # objects in no set order can abort a finished worker (see trainsnap.testing.harness).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
