"""The bulk plan of tensors read whole from their one saved shard: which tensors qualify (against
the shard geometry one tensor at a time), and the reads that fill them."""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

import trainsnap as ts
from trainsnap.format.manifest import Manifest, ManifestBuilder
from trainsnap.format.regions import Box, Flat, Region
from trainsnap.protocol.direct_reads import whole_reads, whole_shards

HEADER = {
    "snapshot_id": "step-000000000001-abcd",
    "created": "2026-01-01T00:00:00Z",
    "step": 1,
    "level": "weights",
    "algorithm": "xxh3-128",
    "block_size": 64,
}


def _regions(shape: tuple[int, ...]) -> st.SearchStrategy[Region]:
    """A box or flat range of ``shape`` (often the whole of it)."""
    numel = 1
    for n in shape:
        numel *= n

    def sized(offsets: tuple[int, ...]) -> st.SearchStrategy[Region]:
        sizes = (st.integers(0, n - o) for n, o in zip(shape, offsets, strict=True))
        return st.tuples(*sizes).map(lambda s: Box(offsets, tuple(s)))

    boxes = st.tuples(*(st.integers(0, n) for n in shape)).flatmap(sized)
    flats = st.integers(0, numel).flatmap(
        lambda start: st.integers(0, numel - start).map(lambda length: Flat(start, length))
    )
    return st.one_of(st.just(Box.full(shape)), st.just(Flat(0, numel)), boxes, flats)


@st.composite
def _cases(draw: st.DrawFn) -> tuple[Manifest, list[int], list[Region]]:
    """A manifest of a few tensors of 0 to 3 shards each, and a region wanted of each tensor."""
    builder = ManifestBuilder(**HEADER)
    obj = builder.add_object("0" * 32, 1 << 20, b"")
    wanted: list[Region] = []
    for t in range(draw(st.integers(1, 6))):
        shape = tuple(draw(st.lists(st.integers(1, 4), max_size=3)))
        builder.add_tensor(f"t{t}", -1, "float32", shape)
        for region in draw(st.lists(_regions(shape), max_size=3)):
            builder.add_shard(t, region, [(obj, 0, 4)])
        wanted.append(draw(_regions(shape)))
    order = draw(st.permutations(range(len(wanted))))
    return builder.build(), list(order), [wanted[t] for t in order]


@settings(max_examples=200, deadline=None)
@given(_cases())
def test_whole_shards_are_the_tensors_whose_one_shard_is_the_region(case):
    manifest, tensors, regions = case
    got = whole_shards(manifest, tensors, regions).tolist()
    for t, region, row in zip(tensors, regions, got, strict=True):
        shards = manifest.tensor_shards(t)
        expected = shards[0][0] if len(shards) == 1 and shards[0][1] == region else -1
        assert row == expected, (t, region, shards)


def test_no_tensors_and_no_shards():
    assert whole_shards(ManifestBuilder(**HEADER).build(), [], []).tolist() == []
    builder = ManifestBuilder(**HEADER)
    builder.add_tensor("empty", -1, "float32", (0,))
    assert whole_shards(builder.build(), [0], [Box.full((0,))]).tolist() == [-1]


def test_whole_reads_fill_the_destination_with_the_shard_chunks_in_order():
    builder = ManifestBuilder(**HEADER)
    a, b = builder.add_object("a" * 32, 100, b""), builder.add_object("b" * 32, 100, b"")
    builder.add_tensor("x", -1, "uint8", (10,))
    builder.add_shard(0, Box.full((10,)), [(b, 50, 4), (a, 0, 6)])
    builder.add_tensor("y", -1, "uint8", (3,))
    builder.add_shard(1, Box.full((3,)), [(a, 7, 3)])
    manifest = builder.build()
    x, y = memoryview(bytearray(10)), memoryview(bytearray(3))
    reads = whole_reads(manifest, [(y, 1, "y"), (x, 0, "x")])
    assert [(r.key, r.obj, r.start, r.stop) for r in reads] == [
        ("y", a, 7, 10),
        ("x", b, 50, 54),
        ("x", a, 0, 6),
    ]
    assert [len(p) for r in reads for p in r.parts] == [3, 4, 6]
    reads[2].parts[0][:] = b"\1" * 6  # the second chunk of x fills its bytes 4..10
    assert bytes(x) == b"\0" * 4 + b"\1" * 6


def test_a_load_mixing_whole_and_resharded_tensors(tmp_path):
    """Whole tensors, a column slice of a saved tensor and a tensor that requires grad, in one
    load: every one of them comes back exactly."""
    full = torch.randn(8, 64)
    leaf = torch.randn(5)
    ts.save({"whole": full, "column": full.clone(), "leaf": leaf}, tmp_path, step=1)
    column = torch.zeros(8, 16)
    dest = {
        "whole": torch.zeros(8, 64),
        "column": ts.Sharded(column, global_shape=(8, 64), offsets=(0, 16)),
        "leaf": torch.zeros(5, requires_grad=True),
    }
    ts.load(dest, tmp_path)
    assert torch.equal(dest["whole"], full)
    assert torch.equal(column, full[:, 16:32])
    assert torch.equal(dest["leaf"].detach(), leaf)
