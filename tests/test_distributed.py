"""Multi-rank save and load with real gloo processes: resharding across topologies, agreement,
and failures of one rank (an exception, a SIGKILL) that must never commit."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import trainsnap as ts
from trainsnap.format.regions import Flat
from trainsnap.protocol import commit
from trainsnap.testing import assert_all_ok, errors_by_rank, run_ranks

# -- the reference state --------------------------------------------------------------------------

SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "emb": ((11, 6), torch.float32),  # Shard(0) over tp: uneven 6 + 5 rows
    "proj": ((7, 9), torch.bfloat16),  # 2-D: Shard(0) over dp, Shard(1) over tp, uneven both
    "norm": ((5,), torch.float32),  # replicated on every rank
    "opt.exp_avg": ((12, 5), torch.float32),  # ZeRO flat ranges, re-cut as row boxes later
    "experts": ((8, 3, 4), torch.float32),  # expert parallel: experts by global id
}
FLAT_CUTS = [0, 17, 30, 45, 60]  # uneven flat ranges of the 60 elements of opt.exp_avg


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    out = {}
    for key, (shape, dtype) in SHAPES.items():
        out[key] = torch.randn(shape, generator=g).to(dtype)
    return out


def _mesh(dp: int, tp: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def _dtensor(full: torch.Tensor, mesh: Any, placements: list[Any], blank: bool) -> Any:
    from torch.distributed.tensor import distribute_tensor

    src = torch.zeros_like(full) if blank else full
    return distribute_tensor(src, mesh, placements)


def build_state(rank: int, world: int, dp: int, tp: int, flat: bool, blank: bool) -> dict:
    """The layout of one topology: DTensors on a (dp, tp) mesh, optimizer state as flat ranges
    (4 ranks) or row boxes, experts split over all ranks by global id."""
    from torch.distributed.tensor import Replicate, Shard

    ref = reference()
    mesh = _mesh(dp, tp)
    state: dict[str, Any] = {
        "emb": _dtensor(ref["emb"], mesh, [Replicate(), Shard(0)], blank),
        "proj": _dtensor(ref["proj"], mesh, [Shard(0), Shard(1)], blank),
        "norm": _dtensor(ref["norm"], mesh, [Replicate(), Replicate()], blank),
    }
    zero = torch.zeros_like
    opt = ref["opt.exp_avg"]
    if flat:
        lo, hi = FLAT_CUTS[rank], FLAT_CUTS[rank + 1]
        part = opt.reshape(-1)[lo:hi].clone()
        state["opt"] = {
            "exp_avg": ts.Sharded.flat(
                zero(part) if blank else part, global_shape=(12, 5), start=lo
            )
        }
    else:
        rows = 12 // world
        part = opt[rank * rows : (rank + 1) * rows].clone()
        state["opt"] = {
            "exp_avg": ts.Sharded(
                zero(part) if blank else part, global_shape=(12, 5), offsets=(rank * rows, 0)
            )
        }
    per = 8 // world
    experts = ref["experts"][rank * per : (rank + 1) * per].clone()
    state["experts"] = ts.Sharded(
        zero(experts) if blank else experts, global_shape=(8, 3, 4), offsets=(rank * per, 0, 0)
    )
    return state


def _local_reference(key: str, value: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(what this rank holds, what it should hold) for one entry of a built state."""
    ref = reference()
    if isinstance(value, ts.Sharded):
        region = value.region
        full = ref[key]
        if isinstance(region, Flat):
            want = full.reshape(-1)[region.start : region.start + region.length]
        else:
            idx = tuple(slice(o, o + n) for o, n in zip(region.offsets, region.sizes, strict=True))
            want = full[idx]
        return value.local, want
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements
    )
    idx = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
    return value.to_local(), ref[key][idx]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def check_state(state: dict) -> int:
    """Bitwise comparison of every local element with the reference; returns elements checked."""
    n = 0
    flat = {
        "emb": state["emb"],
        "proj": state["proj"],
        "norm": state["norm"],
        "opt.exp_avg": state["opt"]["exp_avg"],
        "experts": state["experts"],
    }
    for key, value in flat.items():
        got, want = _local_reference(key, value)
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert torch.equal(_bits(got), _bits(want)), f"{key} differs on rank {dist.get_rank()}"
        n += got.numel()
    return n


def save_rank(rank: int, world: int, root: str) -> str:
    state = build_state(rank, world, dp=2, tp=2, flat=True, blank=False)
    return ts.save(state, root, step=100, timeout=60).id


def load_rank(rank: int, world: int, root: str, dp: int, tp: int) -> int:
    state = build_state(rank, world, dp=dp, tp=tp, flat=False, blank=True)
    info = ts.load(state, root, timeout=60)
    assert info.step == 100
    return check_state(state)


# -- the reshard matrix ---------------------------------------------------------------------------


def test_reshard_matrix(tmp_path):
    root = str(tmp_path)
    ids = assert_all_ok(run_ranks(save_rank, 4, args=(root,), timeout=120))
    assert len(set(ids)) == 1
    assert ts.verify(root).ok

    for world, dp, tp in [(4, 4, 1), (4, 1, 4), (2, 2, 1)]:
        counts = assert_all_ok(run_ranks(load_rank, world, args=(root, dp, tp), timeout=120))
        assert all(c > 0 for c in counts), (world, dp, tp)

    # One process, no process group: everything as plain full tensors.
    ref = reference()
    dst = {k: torch.zeros_like(v) for k, v in ref.items() if k != "opt.exp_avg"}
    dst["opt"] = {"exp_avg": torch.zeros_like(ref["opt.exp_avg"])}
    ts.load(dst, root)
    for key in ("emb", "proj", "norm", "experts"):
        assert torch.equal(_bits(dst[key]), _bits(ref[key])), key
    assert torch.equal(dst["opt"]["exp_avg"], ref["opt.exp_avg"])


def test_replicas_are_written_once_and_balanced(tmp_path):
    root = str(tmp_path)
    ids = assert_all_ok(run_ranks(save_rank, 4, args=(root,), timeout=120))
    m = commit.open_snapshot(ts.open_storage(root), ids[0])
    keys = list(zip(m.tensor_keys, m.tensor_ranks.tolist(), strict=True))
    assert all(r == -1 for _, r in keys), keys  # nothing stored per rank
    shards = {k: len(m.tensor_shards(i)) for i, (k, _) in enumerate(keys)}
    # emb: 2 tp shards (replicated over dp); proj: 4; norm: 1 (replicated everywhere).
    assert shards == {"emb": 2, "experts": 4, "norm": 1, "opt.exp_avg": 4, "proj": 4}


# -- agreement and failures -----------------------------------------------------------------------


def save_at_step(rank: int, world: int, root: str, steps: list[int]) -> str:
    state = {"w": ts.Sharded(torch.ones(4, 8), global_shape=(4 * world, 8), offsets=(4 * rank, 0))}
    return ts.save(state, root, step=steps[rank], timeout=60).id


def test_ranks_at_different_steps_refuse_everywhere_and_write_nothing(tmp_path):
    results = run_ranks(save_at_step, 2, args=(str(tmp_path), [7, 8]), timeout=90)
    errors = errors_by_rank(results)
    assert set(errors) == {0, 1}
    for text in errors.values():
        assert (
            "InvalidArgumentError" in text
            and "step 7 on ranks 0" in text
            and "step 8 on ranks 1" in text
        )
    assert not (tmp_path / "objects").exists() and not (tmp_path / "snapshots").exists()


def save_twice(rank: int, world: int, root: str) -> str:
    g = torch.Generator().manual_seed(rank)
    state = {
        "w": ts.Sharded(
            torch.randn(64, 1024, generator=g),
            global_shape=(64 * world, 1024),
            offsets=(64 * rank, 0),
        ),
        "step": 1,
    }
    ts.save(state, root, step=1, timeout=60)
    os.environ["TRAINSNAP_FAULTS"] = os.environ.get("LATER_FAULTS", "")
    state["w"].local.add_(1)
    state["step"] = 2
    started = time.monotonic()
    try:
        ts.save(state, root, step=2, timeout=30)
    except ts.CommitFailedError as e:
        return f"failed after {time.monotonic() - started:.1f}s: {e}"
    return "committed"


@pytest.mark.parametrize("action", ["raise", "crash"])
def test_a_failing_rank_means_no_commit_and_every_survivor_names_it(tmp_path, action):
    root = str(tmp_path)
    rank_env = {1: {"LATER_FAULTS": f"before_write={action}", "TRAINSNAP_HEARTBEAT_SECONDS": "5"}}
    env = {"TRAINSNAP_HEARTBEAT_SECONDS": "5"}
    results = run_ranks(save_twice, 3, args=(root,), timeout=120, env=env, rank_env=rank_env)
    if action == "crash":
        assert results[1].killed
    else:
        assert results[1].error is None and results[1].value.startswith("failed")
    for r in (0, 2):
        text = results[r].value
        assert text is not None and text.startswith("failed"), (r, results[r])
        assert "rank 1:" in text, text
        if action == "raise":
            assert "InjectedFault" in text
        seconds = float(text.split()[2].rstrip("s:"))
        assert seconds < 30, text
    assert [s.step for s in ts.list_snapshots(root)] == [1]
    dst = {"w": torch.zeros(64 * 3, 1024), "step": None}
    ts.load(dst, root)
    assert dst["step"] == 1
    assert ts.verify(root).ok


def _load_lookup(rank: int, world: int, root: str) -> str:
    dst = {"r": torch.zeros(2), "same": torch.zeros(2), "cfg": {"rank": None, "lr": None}}
    try:
        ts.load(dst, root, timeout=60)
    except ts.TrainsnapError as e:
        return f"{type(e).__name__}: {e}"
    assert dst["r"].tolist() == [float(rank)] * 2 and dst["cfg"]["rank"] == rank
    return "ok"


def _save_per_rank(rank: int, world: int, root: str) -> str:
    state = {
        "r": torch.full((2,), float(rank)),  # differs per rank: kept per rank
        "same": torch.ones(2),  # identical everywhere: stored once
        "cfg": {"rank": rank, "lr": 0.5},
    }
    return ts.save(state, root, step=3, timeout=60).id


def test_per_rank_state_maps_rank_to_rank_and_refuses_another_world(tmp_path):
    root = str(tmp_path)
    (sid, _) = assert_all_ok(run_ranks(_save_per_rank, 2, args=(root,), timeout=90))
    m = commit.open_snapshot(ts.open_storage(root), sid)
    scoped = sorted(zip(m.tensor_keys, m.tensor_ranks.tolist(), strict=True))
    assert scoped == [("r", 0), ("r", 1), ("same", -1)]
    assert sorted(zip(m.value_keys, m.value_ranks.tolist(), strict=True)) == [
        ("cfg.lr", -1),
        ("cfg.rank", 0),
        ("cfg.rank", 1),
    ]
    assert assert_all_ok(run_ranks(_load_lookup, 2, args=(root,), timeout=90)) == ["ok", "ok"]
    out = assert_all_ok(run_ranks(_load_lookup, 3, args=(root,), timeout=90))
    assert all("IncompatibleError" in o and "per-rank state" in o and "'r'" in o for o in out), out
    # One process: the same refusal, never rank 0's value passed off as everyone's.
    with pytest.raises(ts.IncompatibleError, match="per-rank"):
        ts.load({"r": torch.zeros(2)}, root)


# -- memory ---------------------------------------------------------------------------------------

ROWS, COLS = 4096, 16384  # 256 MiB of float32


def _save_columns(rank: int, world: int, root: str) -> None:
    cols = COLS // world
    local = torch.full((ROWS, cols), float(rank))
    ts.save(
        {"big": ts.Sharded(local, global_shape=(ROWS, COLS), offsets=(0, rank * cols))},
        root,
        step=1,
        timeout=120,
    )


def _peak_rss_extra(rank: int, world: int, root: str, warm_root: str) -> tuple[int, int]:
    import resource

    rows = ROWS // world
    dst = torch.empty(rows, COLS)
    dst.fill_(-1)  # touched: part of the baseline
    ts.load({"x": torch.zeros(4)}, warm_root, timeout=60)  # imports and warm-up outside the count
    before = _rss()
    ts.load(
        {"big": ts.Sharded(dst, global_shape=(ROWS, COLS), offsets=(rank * rows, 0))},
        root,
        timeout=120,
    )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    want = torch.arange(world * 0 + 4, dtype=torch.float32).repeat_interleave(COLS // 4)
    assert torch.equal(dst[0], want) and torch.equal(dst[-1], want)
    return peak - before, int(os.environ["TRAINSNAP_READ_BUDGET"])


def _rss() -> int:
    import resource

    # ru_maxrss is the high-water mark so far; the baseline is the high-water mark before the
    # load, which the load must not raise by more than the budget.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.mark.slow
def test_reshard_load_keeps_peak_memory_within_the_budget(tmp_path):
    root, warm = str(tmp_path / "big"), str(tmp_path / "warm")
    ts.save({"x": torch.zeros(4)}, warm, step=1)
    assert_all_ok(run_ranks(_save_columns, 4, args=(root,), timeout=300))
    budget = 32 << 20
    env = {"TRAINSNAP_READ_BUDGET": str(budget)}
    results = assert_all_ok(run_ranks(_peak_rss_extra, 2, args=(root, warm), timeout=300, env=env))
    for extra, b in results:
        assert b == budget
        # Budget for bounce buffers, plus a constant: one scratch block per I/O thread (8 MiB)
        # and allocator slack.
        assert extra <= budget + (24 << 20), (
            f"peak extra RSS {extra >> 20} MiB > budget {budget >> 20} MiB + 24"
        )
    print(
        f"peak extra RSS per rank: {[e >> 20 for e, _ in results]} MiB, budget {budget >> 20} MiB"
    )


def test_save_without_process_group_inside_a_clean_process(tmp_path):
    def_root = str(tmp_path)
    assert_all_ok(run_ranks(_save_columns_small, 1, args=(def_root,), timeout=60, init_pg=False))
    dst = {"w": torch.zeros(3, 3)}
    ts.load(dst, def_root)
    assert dst["w"].sum().item() == 9


def _save_columns_small(rank: int, world: int, root: str) -> bool:
    assert not dist.is_initialized()
    ts.save({"w": torch.ones(3, 3)}, root, step=1)
    return True


_ = Path


class _Stage(torch.nn.Module):
    """A pipeline stage: its own layers, named by their global index, as torchtitan's are."""

    def __init__(self, layers: list[int]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(4, 4) for i in layers})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


def _stage_state(layers: list[int], trained: bool) -> tuple[_Stage, Any]:
    torch.manual_seed(sum(layers) if trained else 1234)
    model = _Stage(layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    if trained:
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    return model, optimizer


def _stage_tensors(model: _Stage, optimizer: Any) -> dict[str, list]:
    out = {k: v.tolist() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in optimizer.state.items():
        out |= {f"{names[id(p)]}.{k}": v.tolist() for k, v in st.items()}
    return out


def _save_stages(rank: int, world: int, root: str) -> dict[str, list]:
    model, optimizer = _stage_state([rank], trained=True)
    ts.save(ts.TrainState(model=model, optimizer=optimizer), root, step=5)
    return _stage_tensors(model, optimizer)


def _load_stages(
    rank: int, world: int, root: str, layers: list[list[int]], level: str = "strict"
) -> Any:
    model, optimizer = _stage_state(layers[rank], trained=False)
    try:
        ts.load(ts.TrainState(model=model, optimizer=optimizer), root, level=level)
    except ts.TrainsnapError as e:
        return type(e).__name__, str(e)
    return _stage_tensors(model, optimizer)


def test_pipeline_stages_get_their_own_layers_back_and_not_the_others(tmp_path):
    """Two pipeline stages save their own layers (and Adam moments) into one snapshot, whose
    tree holds both. Loaded on the same stages, and on swapped ones, each stage gets exactly
    its layers and moments back (before: every stage was also given the other's layers, and
    its module refused them); one process holding both stages gets both models' weights (a
    weights-level load: the stages' optimizer groups and RNG are per rank). One process holding
    one stage is refused, naming the layers it lacks, and so are two that both lack a layer."""
    root = str(tmp_path)
    saved = assert_all_ok(run_ranks(_save_stages, 2, args=(root,)))
    assert all(len(s) == 8 for s in saved)  # weight, bias; their step and two moments each
    for layers in ([[0], [1]], [[1], [0]]):
        out = assert_all_ok(run_ranks(_load_stages, 2, args=(root, layers)))
        assert out == [saved[layers[0][0]], saved[layers[1][0]]]
    # No rank holds layer 1: the model changed since the save. Every rank fails, naming it.
    lost = assert_all_ok(run_ranks(_load_stages, 2, args=(root, [[0], [0]])))
    assert [error for error, _ in lost] == ["LoadFailedError"] * 2
    assert all("no rank loads 4 key(s)" in why and "layers.1.weight" in why for _, why in lost)
    (both,) = assert_all_ok(run_ranks(_load_stages, 1, args=(root, [[0, 1]], "weights")))
    weights = {k: v for k, v in (saved[0] | saved[1]).items() if k.count(".") == 2}
    assert both == weights and len(weights) == 4
    (alone,) = assert_all_ok(run_ranks(_load_stages, 1, args=(root, [[1]], "weights")))
    assert alone[0] == "IncompatibleError"
    assert "layers.0.weight" in alone[1] and "state lacks" in alone[1]


def _save_stage_module(rank: int, world: int, root: str) -> dict[str, list]:
    model, _ = _stage_state([rank], trained=True)
    ts.save({"model": model, "step": 5}, root, step=5)
    return {k: v.tolist() for k, v in model.state_dict().items()}


def _load_stage_module(rank: int, world: int, root: str) -> dict[str, list]:
    model, _ = _stage_state([1 - rank], trained=False)
    ts.load({"model": model, "step": 0}, root)
    return {k: v.tolist() for k, v in model.state_dict().items()}


def test_a_stage_module_in_a_plain_state_gets_only_its_layers(tmp_path):
    """The same through a module in a plain dict (its state dict is exact), on swapped stages."""
    root = str(tmp_path)
    saved = assert_all_ok(run_ranks(_save_stage_module, 2, args=(root,)))
    assert assert_all_ok(run_ranks(_load_stage_module, 2, args=(root,))) == saved[::-1]
