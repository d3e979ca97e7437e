"""DTensor placements as real training stacks produce them: FSDP2 over tensor parallelism
(``_StridedShard``) on a small transformer laid out as torchtitan lays out Llama, saved on one
layout and loaded on others, bitwise; HSDP; what is not a box is refused, naming the key and the
fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import trainsnap as ts
from trainsnap.testing import assert_all_ok, run_ranks

VOCAB, DIM, HEAD, HIDDEN = 16, 8, 2, 16


class Block(nn.Module):
    """A pre-norm transformer block; attention heads and MLP columns split by TP."""

    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.w1, self.w2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention_norm(x)
        b, t, _ = h.shape
        q, k, v = (w(h).view(b, t, -1, HEAD).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(attn.transpose(1, 2).reshape(b, t, -1))
        return x + self.w2(nn.functional.relu(self.w1(self.ffn_norm(x))))


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm, self.output = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(ids)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return TinyTransformer()


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(seed))


def _parallelize(model: nn.Module, dp: int, tp: int) -> nn.Module:
    """torchtitan's layout: TP (Colwise then Rowwise) inside, FSDP2 over the data-parallel dim."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if dp * tp == 1:
        return model
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        for layer in model.layers:
            plan = {w: ColwiseParallel() for w in ("wq", "wk", "wv", "w1")}
            plan |= {"wo": RowwiseParallel(), "w2": RowwiseParallel()}
            parallelize_module(layer, mesh["tp"], plan)
    if dp > 1:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def _full(tensor: Any) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach().clone()


def _everything(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters and Adam moments as full tensors, by name."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"param.{n}": _full(p) for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for what in ("exp_avg", "exp_avg_sq"):
            out[f"{what}.{names[id(p)]}"] = _full(state[what])
    return out


def _train_and_save(rank: int, world_size: int, root: str) -> dict[str, torch.Tensor]:
    model = _parallelize(_model(), 2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        model(_batch(step * 10 + rank // 2)).sum().backward()
        opt.step()
        opt.zero_grad()
    placements = {str(p.placements) for p in model.parameters()}
    assert any("_StridedShard" in p for p in placements), placements
    ts.save(ts.TrainState(model=model, optimizer=opt), root, step=3)
    return _everything(model, opt)


def _load_on(rank: int, world_size: int, root: str, dp: int, tp: int) -> dict[str, torch.Tensor]:
    model = _parallelize(_model(), dp, tp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ts.load(ts.TrainState(model=model, optimizer=opt), root, level="training")
    return _everything(model, opt)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    root = str(tmp_path_factory.mktemp("fsdp_tp"))
    results = assert_all_ok(run_ranks(_train_and_save, world_size=4, args=(root,)))
    return root, results[0]


def _assert_same(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize(("world", "dp", "tp"), [(4, 2, 2), (4, 4, 1), (2, 1, 2)])
def test_fsdp2_over_tp_loads_on_other_layouts_bitwise(
    saved: tuple[str, dict[str, torch.Tensor]], world: int, dp: int, tp: int
) -> None:
    root, expected = saved
    for loaded in assert_all_ok(run_ranks(_load_on, world_size=world, args=(root, dp, tp))):
        _assert_same(loaded, expected)


def test_fsdp2_over_tp_loads_in_one_process(saved: tuple[str, dict[str, torch.Tensor]]) -> None:
    root, expected = saved
    _assert_same(_load_on(0, 1, root, 1, 1), expected)


def _refusals(rank: int, world_size: int, root: str) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    local = torch.ones(2, 3)
    cases = {
        "partial": [Partial(), Shard(0)],
        "strided_rows": [_StridedShard(0, split_factor=2), Shard(1)],  # strided rows per rank
    }
    messages = []
    for key, placements in cases.items():
        tensor = DTensor.from_local(local, mesh, placements, run_check=False)
        with pytest.raises(ts.InvalidArgumentError) as error:
            ts.save({key: tensor}, root, step=1)
        messages.append(str(error.value))
    return messages


def test_placements_that_are_not_a_box_are_refused_with_the_fix(tmp_path: Path) -> None:
    partial, strided = assert_all_ok(run_ranks(_refusals, world_size=4, args=(str(tmp_path),)))[0]
    assert "'partial'" in partial and "redistribute" in partial
    assert "'strided_rows'" in strided and "not a box" in strided
    assert ts.list_snapshots(tmp_path) == []


def _hsdp(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    fully_shard(model, mesh=mesh)  # a 2-D mesh: replicate over the first, shard over the second
    return model


def _train_hsdp_and_save(rank: int, world_size: int, root: str) -> dict[str, torch.Tensor]:
    model = _hsdp(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(_batch(7)).sum().backward()
    opt.step()
    assert "(Replicate(), Shard(dim=0))" in {str(p.placements) for p in model.parameters()}
    ts.save(ts.TrainState(model=model, optimizer=opt), root, step=1)
    return _everything(model, opt)


def test_hsdp_saved_on_4_ranks_loads_on_2(tmp_path: Path) -> None:
    saved = assert_all_ok(run_ranks(_train_hsdp_and_save, world_size=4, args=(str(tmp_path),)))
    for loaded in assert_all_ok(run_ranks(_load_on, world_size=2, args=(str(tmp_path), 2, 1))):
        _assert_same(loaded, saved[0])


def _boxes_of_layouts(rank: int, world_size: int) -> list[str]:
    """One walk over DTensors of one global shape on three meshes of two ranks or more (the 2-D
    mesh and its two 1-D submeshes, whose coordinates differ) in several placements, three of
    each: every box must be torch's own for that tensor, every local tensor the DTensor's own
    memory, and torch's computation run once per layout and process, not once per tensor or
    per walk."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor import _utils as dtensor_utils

    from trainsnap.format.regions import Box
    from trainsnap.state.capture import capture
    from trainsnap.state.template import targets

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(7 * 6, dtype=torch.float32).view(7, 6)  # uneven: 7 rows on 2 ranks
    layouts = [
        (mesh, (Shard(0), Shard(1))),
        (mesh, (Shard(1), Shard(0))),
        (mesh, (Replicate(), Shard(0))),
        (mesh["dp"], (Shard(0),)),
        (mesh["tp"], (Shard(0),)),
        (mesh["tp"], (Shard(1),)),
    ]
    state = {
        f"t{i}.{j}": distribute_tensor(full, m, list(p))
        for i, (m, p) in enumerate(layouts)
        for j in range(3)
    }
    expected = {}
    for key, tensor in state.items():
        sizes, offsets = dtensor_utils.compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements
        )
        expected[key] = Box(tuple(offsets), tuple(sizes))
    computed = 0
    original = dtensor_utils.compute_local_shape_and_global_offset

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal computed
        computed += 1
        return original(*args, **kwargs)

    dtensor_utils.compute_local_shape_and_global_offset = counting
    problems = []
    try:
        # the first walk computes each layout once; later walks (every save and load walks
        # the state again) find them all computed
        for walk, count in ((targets, len(layouts)), (capture, 0), (targets, 0)):
            computed = 0
            items = walk(state).tensors
            if computed != count:
                problems.append(f"{walk.__name__}: {computed} computations, not {count}")
            for item in items:
                if item.region != expected[item.key]:
                    problems.append(f"{walk.__name__} {item.key}: {item.region}")
                if item.local.data_ptr() != state[item.key].to_local().data_ptr():
                    problems.append(f"{walk.__name__} {item.key}: not the local shard's memory")
    finally:
        dtensor_utils.compute_local_shape_and_global_offset = original
    return problems


def test_dtensor_boxes_are_torchs_own_computed_once_per_layout_and_process() -> None:
    assert assert_all_ok(run_ranks(_boxes_of_layouts, world_size=4)) == [[]] * 4
