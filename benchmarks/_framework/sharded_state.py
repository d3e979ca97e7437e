"""The synthetic DTensor state of the distributed benchmark.

A model's tensors on a (dp, tp) device mesh, placed [Replicate(), Shard(0)],
[Replicate(), Shard(1)], [Shard(0), Shard(1)] or replicated, fp32 and bf16. Each rank builds
only its local shards, never a full tensor: the values are a function of the global coordinates
(see :func:`expected_local`), so any rank of any topology can check what it loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from benchmarks._framework.state import GiB, MiB, bitwise_problem, raise_problems

PLACEMENTS = ("RS0", "RS1", "S0S1", "RR")
HIDDEN = 2048
LAYERS = 16


@dataclass(frozen=True, slots=True)
class Spec:
    """One tensor of the state: its global shape, dtype and placement on the mesh."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    placement: str  # one of PLACEMENTS: [Replicate(), Shard(0)], ..., [Replicate(), Replicate()]
    seed: int

    @property
    def nbytes(self) -> int:
        count = self.dtype.itemsize
        for size in self.shape:
            count *= size
        return count


def _layer(index: int, rows: Any) -> list[tuple[str, tuple[int, ...], torch.dtype, str]]:
    """The tensors of one layer; ``rows(fraction, dtype)`` sizes its weights."""
    f32, bf16, hidden = torch.float32, torch.bfloat16, HIDDEN
    per_layer = 0.80 / LAYERS
    prefix = f"layers.{index}"
    qkv = rows(per_layer * 0.3, f32)
    return [
        (f"{prefix}.norm1.weight", (hidden,), f32, "RR"),
        (f"{prefix}.norm1.bias", (hidden,), f32, "RR"),
        (f"{prefix}.attn.qkv.weight", (qkv, hidden), f32, "RS0"),
        (f"{prefix}.attn.qkv.bias", (qkv,), f32, "RS0"),
        (f"{prefix}.attn.out.weight", (rows(per_layer * 0.2, f32), hidden), f32, "RS1"),
        (f"{prefix}.attn.out.bias", (hidden,), f32, "RR"),
        (f"{prefix}.norm2.weight", (hidden,), f32, "RR"),
        (f"{prefix}.norm2.bias", (hidden,), f32, "RR"),
        (f"{prefix}.mlp.up.weight", (rows(per_layer * 0.3, bf16), hidden), bf16, "S0S1"),
        (f"{prefix}.mlp.down.weight", (rows(per_layer * 0.2, bf16), hidden), bf16, "RS1"),
        (f"{prefix}.mlp.down.bias", (hidden,), bf16, "RR"),
    ]


def state_specs(gib: float) -> list[Spec]:
    """About ``gib`` GiB of global tensors: an embedding and an output head ([R, S0]), 16 layers
    of a column-parallel QKV ([R, S0], fp32), a row-parallel output projection ([R, S1], fp32), an
    MLP up projection sharded over both mesh dimensions ([S0, S1], bf16) and a row-parallel down
    projection ([R, S1], bf16), each layer with 7 small 1-D tensors (a [R, S0] bias, replicated
    norms and biases). Rows scale with ``gib``; rows are multiples of 8."""
    if gib <= 0:
        raise ValueError(f"gib must be positive, got {gib}")
    total = int(gib * GiB)

    def rows(fraction: float, dtype: torch.dtype) -> int:
        count = int(fraction * total) // (HIDDEN * dtype.itemsize)
        return max(8, count - count % 8)

    f32, bf16 = torch.float32, torch.bfloat16
    tensors: list[tuple[str, tuple[int, ...], torch.dtype, str]] = [
        ("embed.weight", (rows(0.12, f32), HIDDEN), f32, "RS0")
    ]
    for index in range(LAYERS):
        tensors += _layer(index, rows)
    tensors.append(("final_norm.weight", (HIDDEN,), f32, "RR"))
    tensors.append(("lm_head.weight", (rows(0.08, bf16), HIDDEN), bf16, "RS0"))
    return [
        Spec(key, shape, dtype, placement, i)
        for i, (key, shape, dtype, placement) in enumerate(tensors)
    ]


def describe_specs(specs: list[Spec]) -> dict[str, Any]:
    by_placement: dict[str, int] = dict.fromkeys(PLACEMENTS, 0)
    by_dtype: dict[str, int] = {}
    for spec in specs:
        by_placement[spec.placement] += spec.nbytes
        name = str(spec.dtype).removeprefix("torch.")
        by_dtype[name] = by_dtype.get(name, 0) + spec.nbytes
    sizes = sorted((spec.nbytes for spec in specs), reverse=True)
    return {
        "tensors": len(specs),
        "bytes": sum(sizes),
        "under_64kib": sum(1 for n in sizes if n < 64 << 10),
        "largest_mib": [round(n / MiB, 1) for n in sizes[:3]],
        "bytes_by_placement": by_placement,
        "bytes_by_dtype": by_dtype,
    }


def _placements(name: str) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    placements: dict[str, list[Any]] = {
        "RS0": [Replicate(), Shard(0)],
        "RS1": [Replicate(), Shard(1)],
        "S0S1": [Shard(0), Shard(1)],
        "RR": [Replicate(), Replicate()],
    }
    return placements[name]


def expected_local(spec: Spec, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """The values of the box ``offsets``/``sizes`` of the global tensor ``spec``, computed from
    the box alone: ``a[row] * b[col] + c[row]`` with seeded random vectors (a row or column out
    of place changes the bytes). Elementwise ops are exactly rounded, so any box of any
    topology yields the same bits for the same element."""
    generator = torch.Generator().manual_seed(1_000_003 + spec.seed)
    rows = spec.shape[0]
    a = torch.randn(rows, generator=generator)
    if len(spec.shape) == 1:
        return a[offsets[0] : offsets[0] + sizes[0]].to(spec.dtype)
    b = torch.randn(spec.shape[1], generator=generator)
    c = torch.randn(rows, generator=generator)
    row0, column0 = offsets
    row_count, column_count = sizes
    values = a[row0 : row0 + row_count, None] * b[None, column0 : column0 + column_count]
    values.add_(c[row0 : row0 + row_count, None])
    return values if spec.dtype == torch.float32 else values.to(spec.dtype)


def local_box(spec: Spec, mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, sizes) of this rank's shard of ``spec``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(
        spec.shape, mesh, _placements(spec.placement)
    )
    return tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return tuple(strides)


def build_state(specs: list[Spec], mesh: Any, *, fill: bool) -> dict[str, Any]:
    """This rank's DTensors: local shards built directly (values, or zeros for destinations)."""
    from torch.distributed.tensor import DTensor

    state: dict[str, Any] = {}
    for spec in specs:
        offsets, sizes = local_box(spec, mesh)
        local = (
            expected_local(spec, offsets, sizes) if fill else torch.zeros(sizes, dtype=spec.dtype)
        )
        state[spec.key] = DTensor.from_local(
            local,
            mesh,
            _placements(spec.placement),
            run_check=False,
            shape=torch.Size(spec.shape),
            stride=_strides(spec.shape),
        )
    return state


def local_nbytes(state: dict[str, Any]) -> int:
    return sum(tensor.to_local().nbytes for tensor in state.values())


def check_state(specs: list[Spec], state: dict[str, Any], mesh: Any, what: str) -> int:
    """Bitwise comparison of every local shard with its expected values; returns bytes checked."""
    problems = []
    for spec in specs:
        got = state[spec.key].to_local()
        problems.append(
            bitwise_problem(spec.key, got, expected_local(spec, *local_box(spec, mesh)))
        )
    raise_problems(what, problems)
    return sum(state[spec.key].to_local().nbytes for spec in specs)
