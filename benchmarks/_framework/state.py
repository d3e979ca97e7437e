"""The synthetic training state of the single-process benchmarks, and bitwise checks.

``make_state`` builds a flat dict of contiguous CPU tensors shaped like a model's: a few large
2-D weights, medium 2-D weights, and many small 1-D tensors (norms, biases) interleaved with
them, fp32 and bf16, deterministic for a seed.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

Tensors = dict[str, torch.Tensor]

# Large 2-D weights, as fractions of the total (embedding, output head, a fused projection), with
# their dtypes. What they leave (less the small tensors) goes to medium weights.
_LARGE: tuple[tuple[str, float, torch.dtype], ...] = (
    ("embed.weight", 0.22, torch.float32),
    ("lm_head.weight", 0.14, torch.bfloat16),
    ("fused_qkv.weight", 0.09, torch.float32),
)
# Medium weights cycle through these sizes (MiB at a 1 GiB state; they scale with the total).
_MEDIUM_MIB: tuple[int, ...] = (4, 12, 8, 24, 16, 6)
# Small tensors (biases, norms): (elements, dtype), cycled; 2-8 KiB each.
_SMALL: tuple[tuple[int, torch.dtype], ...] = (
    (1024, torch.float32),
    (2048, torch.bfloat16),
    (2048, torch.float32),
    (1536, torch.bfloat16),
    (4096, torch.bfloat16),
)


def _rows(nbytes: int, columns: int, dtype: torch.dtype) -> int:
    return max(1, nbytes // (columns * dtype.itemsize))


def _random(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)


def _medium_shapes(budget: int, scale: float) -> list[tuple[int, torch.dtype, int]]:
    """(rows, dtype, columns) of the medium weights that fill ``budget`` bytes."""
    shapes = []
    index = 0
    while budget > 0:
        size_mib = _MEDIUM_MIB[index % len(_MEDIUM_MIB)]
        nbytes = min(budget, max(64 * KiB, int(size_mib * MiB * scale)))
        dtype = torch.float32 if index % 3 != 2 else torch.bfloat16
        columns = (1024, 2048, 4096)[index % 3]
        shapes.append((_rows(nbytes, columns, dtype), dtype, columns))
        budget -= nbytes
        index += 1
    return shapes


def make_state(gib: float = 1.0, *, small_tensors: int = 2000, seed: int = 0) -> Tensors:
    """A flat dict of contiguous CPU tensors of about ``gib`` GiB, fp32 and bf16, deterministic
    for a given ``seed``: a few large 2-D weights (tens to hundreds of MiB at 1 GiB), medium
    2-D weights, and ``small_tensors`` 1-D tensors of a few KiB, interleaved with the medium
    weights as a model's layers would be.
    """
    if gib <= 0:
        raise ValueError(f"gib must be positive, got {gib}")
    total = int(gib * GiB)
    generator = torch.Generator().manual_seed(seed)
    small = [_SMALL[i % len(_SMALL)] for i in range(small_tensors)]
    state: Tensors = {}
    columns = 4096 if total >= 256 * MiB else 1024
    for name, fraction, dtype in _LARGE:
        rows = _rows(int(fraction * total), columns, dtype)
        state[name] = _random((rows, columns), dtype, generator)
    small_bytes = sum(count * dtype.itemsize for count, dtype in small)
    budget = max(0, total - state_nbytes(state) - small_bytes)
    medium = _medium_shapes(budget, total / GiB)
    # Interleave: each medium weight is followed by its share of the small tensors.
    per_layer = math.ceil(small_tensors / max(1, len(medium)))
    small_keys = iter(range(small_tensors))
    for layer, (rows, dtype, width) in enumerate(medium):
        state[f"layers.{layer}.weight"] = _random((rows, width), dtype, generator)
        for norm, index in zip(range(per_layer), small_keys, strict=False):
            count, small_dtype = small[index]
            state[f"layers.{layer}.norm{norm}"] = _random((count,), small_dtype, generator)
    for index in small_keys:  # no medium weights at all (a tiny state)
        count, small_dtype = small[index]
        state[f"extra.{index}"] = _random((count,), small_dtype, generator)
    return state


def equal_state(gib: float, count: int, *, seed: int = 0) -> Tensors:
    """``count`` fp32 tensors of equal size, about ``gib`` GiB in all (``layers.<i>.weight``,
    1024 columns), deterministic for a given ``seed``."""
    if gib <= 0 or count < 1:
        raise ValueError(f"gib must be positive and count at least 1, got {gib}, {count}")
    generator = torch.Generator().manual_seed(seed)
    rows = _rows(int(gib * GiB) // count, 1024, torch.float32)
    return {
        f"layers.{i}.weight": _random((rows, 1024), torch.float32, generator) for i in range(count)
    }


def state_nbytes(state: Tensors) -> int:
    return sum(tensor.nbytes for tensor in state.values())


def describe_state(state: Tensors) -> dict[str, Any]:
    """Counts and sizes of a state, for reports."""
    sizes = sorted((tensor.nbytes for tensor in state.values()), reverse=True)
    by_dtype: dict[str, int] = {}
    for tensor in state.values():
        name = str(tensor.dtype).removeprefix("torch.")
        by_dtype[name] = by_dtype.get(name, 0) + tensor.nbytes
    return {
        "tensors": len(sizes),
        "bytes": sum(sizes),
        "largest_mib": [round(n / MiB, 1) for n in sizes[:3]],
        "at_least_1mib": sum(1 for n in sizes if n >= MiB),
        "under_64kib": sum(1 for n in sizes if n < 64 * KiB),
        "bytes_by_dtype": by_dtype,
    }


def empty_like_state(state: Tensors) -> Tensors:
    """Preallocated (and touched) destinations of the same shapes and dtypes."""
    return {key: torch.zeros_like(tensor) for key, tensor in state.items()}


ONE_COPY = (
    "one copy: copy_ of every tensor into preallocated tensors of the same shapes whose pages "
    "were touched before (a warm copy: no page faults, no allocation)"
)
"""How every benchmark measures "one copy" of a state (and says so in its output)."""


class OneCopy:
    """The reference every pause and memory tier cost is measured against: :data:`ONE_COPY`.
    The destination is allocated and touched (a first copy) here, once."""

    def __init__(self, state: Tensors) -> None:
        self.destination = empty_like_state(state)
        self.copy(state)

    def copy(self, state: Tensors) -> None:
        for key, tensor in state.items():
            self.destination[key].copy_(tensor)

    def seconds(self, state: Tensors) -> float:
        start = time.perf_counter()
        self.copy(state)
        return time.perf_counter() - start


def clear_state(state: dict[str, Any]) -> None:
    """Zero every tensor of ``state`` (the local shard of a DTensor)."""
    for tensor in state.values():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        local.zero_()


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor (no copy)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


def tensor_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte memoryview of a contiguous CPU tensor (no copy)."""
    assert tensor.device.type == "cpu" and tensor.is_contiguous()
    return memoryview(tensor_bytes(tensor).numpy()).cast("B")


def bitwise_problem(key: str, got: torch.Tensor, expected: torch.Tensor) -> str | None:
    """Why ``got`` does not hold the bytes of ``expected`` (None when it does)."""
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return f"{key}: {got.dtype}{list(got.shape)} != {expected.dtype}{list(expected.shape)}"
    if not torch.equal(tensor_bytes(got.contiguous()), tensor_bytes(expected.contiguous())):
        return f"{key}: bytes differ"
    return None


def check_bitwise_equal(expected: Tensors, got: Tensors, what: str) -> None:
    """Raise AssertionError unless every tensor of ``got`` has the bytes of ``expected``."""
    if expected.keys() != got.keys():
        missing = sorted(expected.keys() - got.keys())[:5]
        extra = sorted(got.keys() - expected.keys())[:5]
        raise AssertionError(f"{what}: keys differ (missing {missing}, extra {extra})")
    problems = [bitwise_problem(key, got[key], tensor) for key, tensor in expected.items()]
    raise_problems(what, problems)


def raise_problems(what: str, problems: list[str | None]) -> None:
    bad = [problem for problem in problems if problem is not None]
    if bad:
        raise AssertionError(f"{what}: {len(bad)} tensor(s) wrong, e.g. {bad[:5]}")
