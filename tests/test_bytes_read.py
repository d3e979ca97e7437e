"""What a load costs the storage: each stored block is read once per process, for tensors and
plain values alike (bytes read over bytes stored, counted by
:class:`~trainsnap.testing.counting_store.CountingStorage`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import trainsnap as ts
from trainsnap.storage.posix import PosixStorage
from trainsnap.testing import assert_all_ok, run_ranks
from trainsnap.testing.counting_store import CountingStorage


def _stored(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _small_train_state(seed: int) -> ts.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    return ts.TrainState(model=model, optimizer=opt, extra={"tokens_seen": seed})


def _many(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {f"t{i}": torch.randn(4096, generator=g) for i in range(2000)}
    state.update({f"v{i}": {"a": i + seed, "b": [i, str(i)]} for i in range(100)})
    return state


def _load_counted(state: Any, root: Path) -> CountingStorage:
    storage = CountingStorage(PosixStorage(str(root)))
    ts.load(state, storage)
    return storage


def test_a_small_train_state_reads_its_snapshot_about_once(tmp_path: Path) -> None:
    saved = _small_train_state(1)
    ts.save(saved, tmp_path, step=3)
    state = _small_train_state(2)
    storage = _load_counted(state, tmp_path)
    assert storage.bytes_read <= 1.05 * _stored(tmp_path)
    for a, b in zip(state.model.parameters(), saved.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_many_small_tensors_and_values_read_each_block_once(tmp_path: Path) -> None:
    saved = _many(1)
    ts.save(saved, tmp_path, step=3)
    state = _many(2)
    for i in range(100):
        state[f"v{i}"] = None
    storage = _load_counted(state, tmp_path)
    assert storage.bytes_read <= 1.05 * _stored(tmp_path)
    assert all(torch.equal(state[f"t{i}"], saved[f"t{i}"]) for i in range(2000))
    assert all(state[f"v{i}"] == saved[f"v{i}"] for i in range(100))


_KEYS = 1000  # x 4 ranks: 4,000 shards of 2 elements
_SIZE = 8


def _dtensors(world: int, blank: bool) -> ts.TrainState:
    """A model of tiny DTensor parameters, each cut in 4 shards, in a TrainState (RNG state
    per rank, global plain values)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    rank = mesh.get_local_rank()
    rows = _SIZE // world
    out = {}
    for i in range(_KEYS):
        full = torch.arange(_SIZE, dtype=torch.float32) + i
        local = torch.zeros(rows) if blank else full[rank * rows : (rank + 1) * rows].clone()
        out[f"w{i}"] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )
    params = torch.nn.ParameterDict({k: torch.nn.Parameter(v) for k, v in out.items()})
    return ts.TrainState(model=params)


def _save_dtensors(rank: int, world: int, root: str) -> None:
    ts.save(_dtensors(world, blank=False), root, step=1)


def _load_dtensors(rank: int, world: int, root: str) -> tuple[int, bool]:
    state = _dtensors(world, blank=True)
    storage = _load_counted(state, Path(root))
    rows = _SIZE // world
    full = torch.arange(_SIZE, dtype=torch.float32)
    ok = all(
        torch.equal(state.model[f"w{i}"].to_local(), full[rank * rows : (rank + 1) * rows] + i)
        for i in range(_KEYS)
    )
    return storage.bytes_read, ok


def test_tiny_dtensor_shards_on_four_ranks_read_the_snapshot_about_once(tmp_path: Path) -> None:
    root = str(tmp_path)
    assert_all_ok(run_ranks(_save_dtensors, 4, args=(root,), timeout=180))
    results = assert_all_ok(run_ranks(_load_dtensors, 4, args=(root,), timeout=180))
    assert all(ok for _, ok in results)
    read = sum(n for n, _ in results)
    assert read <= 1.3 * _stored(tmp_path)
