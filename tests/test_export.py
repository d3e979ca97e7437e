"""Export to Hugging Face safetensors: files that load bitwise, sharding with an index, dtype
conversion, reads in bounded pieces, and refusals that say what to do."""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import trainsnap as ts
from trainsnap.format.manifest import ManifestBuilder
from trainsnap.format.regions import Box
from trainsnap.storage import PosixStorage
from trainsnap.storage.base import Steps
from trainsnap.tools.cli import app
from trainsnap.tools.export import (
    INDEX_FILE,
    SINGLE_FILE,
    export_safetensors,
    parse_size,
    plan_export,
)

PIECE = 256
"""Bytes per streamed piece in these tests: every tensor but the smallest spans several."""


def model_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "embed.weight": torch.randn(40, 16, generator=g),  # 2560 B: ten pieces
        "layers.0.attn.weight": torch.randn(16, 16, generator=g).bfloat16(),
        "layers.0.norm": torch.randn(16, generator=g),
        "layers.0.bias": torch.randn(3, 5, 2, generator=g).bfloat16(),
        "position_ids": torch.arange(33),
        "scale": torch.tensor(0.5),
        "mask": torch.rand(7, generator=g) > 0.5,
    }


@pytest.fixture
def root(tmp_path: Path) -> Path:
    model = model_state()
    state = {
        "model": model,
        "optim": {"exp_avg": torch.ones(40, 16), "step": 3},
        "epoch": 1,
    }
    ts.save(state, tmp_path / "root", step=5)
    return tmp_path / "root"


def loaded_model(root: Path) -> dict[str, torch.Tensor]:
    """What ts.load gives for the model: the reference an export must match."""
    dst = {k: torch.empty_like(v) for k, v in model_state().items()}
    ts.load({"model": dst}, root)
    return dst


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(bits(got[k]), bits(v)), k


def header(path: Path) -> dict[str, object]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    doc: dict[str, object] = json.loads(raw[8 : 8 + n])
    return doc


def test_single_file_loads_bitwise_model_keys_only(root: Path, tmp_path: Path) -> None:
    path = export_safetensors(root, "latest", tmp_path / "out", piece_bytes=PIECE)
    assert path == tmp_path / "out" / SINGLE_FILE
    assert sorted(p.name for p in path.parent.iterdir()) == [SINGLE_FILE]  # no index, no temp
    got = load_file(str(path))
    assert_bitwise(got, loaded_model(root))
    meta = header(path)["__metadata__"]
    assert isinstance(meta, dict) and meta["format"] == "pt"


def test_sharded_export_has_an_index_and_loads_bitwise(root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    path = export_safetensors(root, "latest", out, max_shard_size=600, piece_bytes=PIECE)
    assert path == out / INDEX_FILE
    index = json.loads(path.read_text())
    files = sorted({*index["weight_map"].values()})
    assert len(files) >= 3
    assert files == [
        f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, 1 + len(files))
    ]
    assert sorted(p.name for p in out.iterdir()) == sorted([*files, INDEX_FILE])
    got: dict[str, torch.Tensor] = {}
    for name in files:
        part = load_file(str(out / name))
        assert all(index["weight_map"][k] == name for k in part)
        # Only a tensor larger than the limit may make a file larger than the limit.
        assert sum(t.nbytes for t in part.values()) <= 600 or len(part) == 1
        got.update(part)
    assert_bitwise(got, loaded_model(root))
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in got.values())


def test_dtype_conversion_touches_floating_tensors_only(root: Path, tmp_path: Path) -> None:
    path = export_safetensors(root, "latest", tmp_path / "out", dtype="bf16", piece_bytes=PIECE)
    ref = loaded_model(root)
    want = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in ref.items()}
    assert_bitwise(load_file(str(path)), want)
    assert load_file(str(path))["position_ids"].dtype == torch.int64


def test_reexport_replaces_a_previous_layout(root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out).mkdir()
    (out / "config.json").write_text("{}")  # not ours: kept
    export_safetensors(root, "latest", out, max_shard_size=1200)
    export_safetensors(root, "latest", out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", SINGLE_FILE]
    export_safetensors(root, "latest", out, max_shard_size=1200)
    names = sorted(p.name for p in out.iterdir())
    assert SINGLE_FILE not in names and INDEX_FILE in names and "config.json" in names


class CountingStorage(PosixStorage):
    """Records the largest single read of an object: what an export holds of it at once."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.largest = 0
        self.reads = 0
        self._count_lock = threading.Lock()

    def _count(self, key: str, nbytes: int) -> None:
        if key.startswith("objects/"):
            with self._count_lock:
                self.largest = max(self.largest, nbytes)
                self.reads += 1

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        self._count(key, len(out))
        super().read_into(key, start, out)

    def read_steps(self, key: str, start: int, steps: Steps, done: Callable[[int], None]) -> None:
        self._count(key, sum(len(b) for step in steps for b in step))
        super().read_steps(key, start, steps, done)


def test_export_reads_in_bounded_pieces(tmp_path: Path) -> None:
    big = torch.randn(16 << 20, generator=torch.Generator().manual_seed(1))  # 64 MiB
    ts.save({"model": {"w": big}}, tmp_path / "root", step=1)
    storage = CountingStorage(tmp_path / "root")
    piece = 4 << 20
    path = export_safetensors(storage, "latest", tmp_path / "out", piece_bytes=piece)
    assert storage.reads >= big.nbytes // piece
    assert 0 < storage.largest <= piece
    got = load_file(str(path))["w"]
    assert torch.equal(bits(got), bits(big))


def test_plan_skips_rank_scoped_tensors(tmp_path: Path) -> None:
    b = ManifestBuilder(
        snapshot_id="step-000000000001-abcd",
        created="2024-01-01T00:00:00Z",
        step=1,
        level="weights",
        algorithm="xxh3-128",
        block_size=1 << 20,
    )
    b.add_tensor("model.w", -1, "float32", (2,))
    b.add_shard(0, Box((0,), (2,)), [])
    b.add_tensor("model.rng", 0, "uint8", (4,))
    b.add_shard(1, Box((0,), (4,)), [])
    plan = plan_export(b.build(), dtype=None, max_shard_size=10, prefix="model.")
    assert [t.name for f in plan.files for t in f.tensors] == ["w"]
    assert plan.skipped == ["model.rng (rank 0)"]


def test_refusals_name_the_snapshot_and_the_fix(root: Path, tmp_path: Path) -> None:
    sid = ts.list_snapshots(root)[-1].id
    with pytest.raises(ts.NotFoundError, match=f"{sid}.*'decoder.'.*--prefix"):
        export_safetensors(root, sid, tmp_path / "out", prefix="decoder.")
    with pytest.raises(ts.InvalidArgumentError, match="bf16, fp16, fp32"):
        export_safetensors(root, sid, tmp_path / "out", dtype="int8")
    with pytest.raises(ts.InvalidArgumentError, match="2GB"):
        export_safetensors(root, sid, tmp_path / "out", max_shard_size="lots")
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_parse_size_units() -> None:
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("1.5KiB") == 1536
    assert parse_size(4096) == parse_size("4096") == 4096


def test_cli_export(root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["export", str(root), "latest", str(out), "--format", "safetensors"]
    res = CliRunner().invoke(app, [*args, "--dtype", "fp16", "--max-shard-size", "1KB"])
    assert res.exit_code == 0, res.output
    assert "exported 7 tensor(s)" in res.stdout and INDEX_FILE in res.stdout
    assert ts.list_snapshots(root)[-1].id in res.stdout
    index = json.loads((out / INDEX_FILE).read_text())
    assert all(
        load_file(str(out / f))[k].dtype != torch.float32 for k, f in index["weight_map"].items()
    )
    res = CliRunner().invoke(app, [*args[:-1], "gguf"])
    assert res.exit_code == 2 and "--format safetensors" in res.stderr
