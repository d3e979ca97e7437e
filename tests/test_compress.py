"""Lossless compression: byte grouping + zstd per block, bitwise round trips, ranged reads,
and damage to stored or decoded bytes detected."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import trainsnap as ts
from trainsnap.format.compression import compress_block, decompress_block
from trainsnap.protocol import commit


@pytest.mark.parametrize("codec", ["zstd", "bg2+zstd", "bg4+zstd", "bg8+zstd"])
def test_block_codecs_round_trip(codec):
    data = memoryview(torch.randn(1001).numpy().tobytes())  # not a multiple of every width
    assert decompress_block(compress_block(data, codec), codec, len(data)) == bytes(data)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.int64,
        torch.uint8,
        torch.bool,
    ],
)
def test_compressed_snapshots_round_trip_bitwise(tmp_path, small_blocks, dtype):
    g = torch.Generator().manual_seed(0)
    src = torch.randn(37, 41, generator=g).mul(100).to(dtype)
    state = {"model": {"w": src, "tiny": src[:2, :3].clone()}, "optim": {"m": src.t().clone()}}
    ts.save(
        state,
        tmp_path,
        step=1,
        options=ts.SaveOptions(compression={"model": "bytegroup+zstd", "optim": "zstd"}),
    )
    dst = {
        "model": {"w": torch.zeros_like(src), "tiny": torch.zeros(2, 3, dtype=dtype)},
        "optim": {"m": torch.zeros(41, 37, dtype=dtype)},
    }
    ts.load(dst, tmp_path)
    assert torch.equal(dst["model"]["w"], src) and torch.equal(dst["optim"]["m"], src.t())
    assert torch.equal(dst["model"]["tiny"], src[:2, :3])
    assert ts.verify(tmp_path).ok


def test_ranged_reads_of_compressed_objects(tmp_path, small_blocks):
    full = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
    ts.save({"w": full}, tmp_path, step=1, options=ts.SaveOptions(compression="bytegroup+zstd"))
    for offsets, sizes in [((5, 0), (9, 48)), ((0, 7), (64, 13)), ((31, 40), (2, 8))]:
        part = torch.zeros(sizes)
        ts.load({"w": ts.Sharded(part, global_shape=(64, 48), offsets=offsets)}, tmp_path)
        idx = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
        assert torch.equal(part, full[idx]), offsets


def test_damage_to_a_compressed_object_is_detected(tmp_path, small_blocks):
    w = torch.randn(64, 64)
    info = ts.save({"w": w}, tmp_path, step=1, options=ts.SaveOptions(compression="zstd"))
    m = commit.open_snapshot(ts.open_storage(tmp_path), info.id)
    o = next(i for i, c in enumerate(m.object_codecs) if c != "raw")
    path = next(Path(tmp_path).rglob(m.object_names[o]))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(ts.CorruptError, match="checksum"):
        ts.load({"w": torch.zeros(64, 64)}, tmp_path)
    with pytest.raises(ts.CorruptError) as e:
        ts.verify(tmp_path)
    assert m.object_names[o] in str(e.value)


def test_compression_saves_bytes_on_trained_state(tmp_path):
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(10):
        model(torch.randn(8, 256)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    st = ts.TrainState(model, opt, rng=False)
    raw = ts.save(st, tmp_path / "raw", step=1)
    packed = ts.save(
        st, tmp_path / "z", step=1, options=ts.SaveOptions(compression="bytegroup+zstd")
    )
    assert packed.nbytes < 0.95 * raw.nbytes


def test_an_unknown_compression_is_refused_before_writing(tmp_path):
    with pytest.raises(ts.InvalidArgumentError, match="compression"):
        ts.save({"w": torch.ones(3)}, tmp_path, step=1, options=ts.SaveOptions(compression="lz4"))
    assert not (tmp_path / "objects").exists()
