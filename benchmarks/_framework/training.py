"""Small models and optimizer steps, for benchmarks that need trained rather than random state:
a stack of pre-norm MLP blocks (optionally with LoRA adapters), and a bag-of-embeddings
classifier, trained on synthetic tasks for a few real optimizer steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._framework.state import MiB


class Block(nn.Module):
    """A pre-norm MLP block: x + fc2(gelu(fc1(norm(x))))."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1: nn.Module = nn.Linear(width, 4 * width)
        self.fc2: nn.Module = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def stack_width(mib: float, layers: int) -> int:
    """The width (a multiple of 64) at which ``layers`` blocks hold about ``mib`` MiB of fp32
    parameters (8 d^2 each)."""
    width = math.sqrt(mib * MiB / 4 / (8 * layers))
    return max(64, round(width / 64) * 64)


class LoRALinear(nn.Module):
    """A frozen linear plus a trainable low-rank update ``b @ a`` (``b`` starts at zero)."""

    def __init__(self, base: nn.Linear, rank: int) -> None:
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
        self.b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


def add_lora(model: Stack, rank: int) -> None:
    """Freeze ``model`` and wrap both linears of every block with adapters of ``rank``."""
    model.requires_grad_(False)
    for block in model.blocks:
        assert isinstance(block, Block)
        block.fc1 = LoRALinear(block.fc1, rank)  # type: ignore[arg-type]
        block.fc2 = LoRALinear(block.fc2, rank)  # type: ignore[arg-type]


class BagClassifier(nn.Module):
    """Mean of token embeddings, then a linear head."""

    def __init__(self, vocabulary: int, dimension: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, dimension)
        self.head = nn.Linear(dimension, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(1))


def param_bytes(model: nn.Module, *, trainable: bool | None = None) -> int:
    """Bytes of the parameters (only the trainable or frozen ones when ``trainable`` is set)."""
    return sum(
        p.numel() * p.element_size()
        for p in model.parameters()
        if trainable is None or p.requires_grad == trainable
    )


def regression_loss(
    model: nn.Module, width: int, batch: int, seed: int
) -> Callable[[], torch.Tensor]:
    """The loss of a regression towards a fixed random teacher on fresh Gaussian inputs."""
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(width, width, generator=generator) / math.sqrt(width)

    def loss() -> torch.Tensor:
        x = torch.randn(batch, width, generator=generator)
        return F.mse_loss(model(x), torch.tanh(x @ teacher))

    return loss


def stepper(
    optimizer: torch.optim.Optimizer, loss: Callable[[], torch.Tensor]
) -> Callable[[], float]:
    """One optimizer step on ``loss``; returns the loss."""

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        value = loss()
        value.backward()
        optimizer.step()
        return float(value.detach())

    return step
