"""The read plan's policy: built from the tunables (environment overrides included), and the
strategy it picks for each kind of piece (pure: no storage, no reads)."""

from __future__ import annotations

import torch

from trainsnap import tunables
from trainsnap.engine.buffers import raw_bytes
from trainsnap.engine.read_plan import (
    CopyRead,
    Destination,
    ObjectRead,
    ReadPolicy,
    Run,
    piece_reads,
)
from trainsnap.format.regions import Box, RegionIndex


def test_the_policy_comes_from_the_tunables_and_their_environment() -> None:
    env = {
        "TRAINSNAP_MIN_ROW": "4096",
        "TRAINSNAP_READ_WINDOW": str(1 << 20),
        "TRAINSNAP_COALESCE_MAX": str(3 << 20),
        "TRAINSNAP_COPY_MAX": str(1 << 30),
        "TRAINSNAP_READ_BUDGET": str(64 << 20),
        "TRAINSNAP_DIRECT_READS": "0",
    }
    policy = ReadPolicy.from_tunables(tunables.from_env(env))
    assert policy == ReadPolicy(
        min_row=4096, window=1 << 20, coalesce_max=3 << 20, copy_max=16 << 20, direct=False
    )  # a copy never takes more than a quarter of the read budget
    assert ReadPolicy.from_tunables(tunables.Tunables()).direct


def _records(saved: Box, wanted: Box, shape: tuple[int, ...], policy: ReadPolicy) -> list:
    """The records that fill a float32 tensor ``wanted`` of a tensor of ``shape`` saved as the
    one shard ``saved`` (stored as one object from byte 0)."""
    work = torch.zeros(wanted.sizes)
    dest = Destination(raw_bytes(work), work, 4, True, "t")
    ((_, pieces),) = RegionIndex([saved], shape).overlapping(wanted)

    def runs_of(start: int, stop: int) -> list[Run]:
        return [Run(0, start, start, stop - start)]

    return [r for piece in pieces for r in piece_reads(piece, runs_of, dest, policy)]


def test_each_kind_of_piece_gets_its_strategy() -> None:
    policy = ReadPolicy(
        min_row=256, window=1 << 20, coalesce_max=8 << 20, copy_max=1 << 20, direct=True
    )
    shape = (8, 128)
    # contiguous on both sides: one read in place
    (whole,) = _records(Box((0, 0), (8, 128)), Box((0, 0), (8, 128)), shape, policy)
    assert isinstance(whole, ObjectRead) and len(whole.parts) == 1
    assert (whole.start, whole.stop) == (0, 8 * 128 * 4)
    # a column half saved, the whole tensor wanted: rows of 256 bytes read into their rows
    (rows,) = _records(Box((0, 0), (8, 64)), Box((0, 0), (8, 128)), shape, policy)
    assert isinstance(rows, ObjectRead) and [len(p) for p in rows.parts] == [256] * 8
    # rows of 128 bytes, under min_row: copied from windows
    (narrow,) = _records(Box((0, 0), (8, 32)), Box((0, 0), (8, 128)), shape, policy)
    assert isinstance(narrow, CopyRead) and narrow.windowed
    assert (narrow.start, narrow.stop) == (0, 8 * 32 * 4)
    # a box of a saved box (not contiguous in the snapshot): one strided copy of its span
    (box,) = _records(Box((0, 0), (8, 128)), Box((2, 16), (3, 32)), shape, policy)
    assert isinstance(box, CopyRead) and not box.windowed
    assert (box.start, box.stop) == ((2 * 128 + 16) * 4, (4 * 128 + 48) * 4)
    # the same box with copies of at most one saved row: one copy per row
    small = ReadPolicy(min_row=256, window=1 << 20, coalesce_max=8 << 20, copy_max=512, direct=True)
    boxes = _records(Box((0, 0), (8, 128)), Box((2, 16), (3, 32)), shape, small)
    assert [(b.start, b.stop) for b in boxes] == [
        ((r * 128 + 16) * 4, (r * 128 + 48) * 4) for r in (2, 3, 4)
    ]
