"""DCP's ``CheckpointableTensor`` leaves (torch 2.14+): a plain tensor carrying its global shape
and the offsets of its shard is taken wherever ``ts.Sharded`` is -- saved as that box of the
logical tensor, loaded into in place, resharded to other layouts -- and what is not one box is
refused, naming the key and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import trainsnap as ts
from trainsnap.testing import assert_all_ok, run_ranks

try:
    from torch.distributed.checkpoint import CheckpointableTensor
except ImportError:
    CheckpointableTensor = None

pytestmark = pytest.mark.skipif(
    CheckpointableTensor is None,
    reason=f"torch {torch.__version__} has no torch.distributed.checkpoint.CheckpointableTensor "
    "(DCP's protocol arrived in torch 2.14)",
)

ROWS, COLS = 8, 6


def _full() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def checkpointable(
    tensor: torch.Tensor,
    *,
    global_shape: tuple[int, ...],
    global_offsets: tuple[tuple[int, ...], ...],
    local_offsets: tuple[tuple[int, ...], ...] | None = None,
    local_sizes: tuple[tuple[int, ...], ...] | None = None,
) -> torch.Tensor:
    """``tensor`` with DCP's fields set on it, as a training stack would leave them."""
    tensor.global_shape = global_shape  # type: ignore[attr-defined]
    tensor.global_offsets = global_offsets  # type: ignore[attr-defined]
    tensor.local_offsets = local_offsets or tuple((0,) * tensor.dim() for _ in global_offsets)  # type: ignore[attr-defined]
    tensor.local_sizes = local_sizes or tuple(tuple(tensor.shape) for _ in global_offsets)  # type: ignore[attr-defined]
    assert isinstance(tensor, CheckpointableTensor)
    return tensor


def _padded_rows(rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s rows of ``_full()`` inside a buffer with a padding row before them."""
    rows = ROWS // world
    buffer = torch.full((rows + 1, COLS), -1.0)
    buffer[1:] = _full()[rank * rows : (rank + 1) * rows]
    return checkpointable(
        buffer,
        global_shape=(ROWS, COLS),
        global_offsets=((rank * rows, 0),),
        local_offsets=((1, 0),),
        local_sizes=((rows, COLS),),
    )


def save_rows(rank: int, world: int, root: str) -> str:
    return ts.save({"w": _padded_rows(rank, world), "step": 3}, root, step=3, timeout=60).id


def load_rows(rank: int, world: int, root: str) -> bool:
    buffer = _padded_rows(rank, world)
    buffer.zero_()
    ts.load({"w": buffer, "step": 0}, root)
    expected = _padded_rows(rank, world)
    expected[0] = 0.0  # the padding row is not part of the shard: left as it was
    return torch.equal(buffer, expected)


def test_ranks_save_their_shards_of_one_tensor_and_load_them_back(tmp_path: Path) -> None:
    root = str(tmp_path)
    ids = assert_all_ok(run_ranks(save_rows, 2, args=(root,), timeout=120))
    assert ids[0] == ids[1]
    # One logical (8, 6) tensor of two row shards, without the padding rows.
    assert torch.equal(ts.read(root)["w"], _full())
    assert assert_all_ok(run_ranks(load_rows, 2, args=(root,), timeout=120)) == [True, True]


def test_a_shard_loads_from_a_snapshot_of_another_layout(tmp_path: Path) -> None:
    ts.save({"w": _full()}, tmp_path, step=1)
    # Columns 2..4 of every row, held in the middle of a wider parameter (a strided view).
    buffer = torch.nn.Parameter(torch.zeros(ROWS, COLS + 2))
    target = checkpointable(
        buffer,
        global_shape=(ROWS, COLS),
        global_offsets=((0, 2),),
        local_offsets=((0, 3),),
        local_sizes=((ROWS, 3),),
    )
    ts.load({"w": target}, tmp_path)
    expected = torch.zeros(ROWS, COLS + 2)
    expected[:, 3:6] = _full()[:, 2:5]
    assert torch.equal(buffer.detach(), expected)


def test_one_process_holding_every_shard_saves_the_whole_tensor(tmp_path: Path) -> None:
    buffer = torch.full((ROWS, COLS + 2), -1.0)  # a padding column on either side
    buffer[:, 1:-1] = _full()
    state: dict[str, Any] = {
        "w": checkpointable(
            buffer,
            global_shape=(ROWS, COLS),
            global_offsets=((0, 0),),
            local_offsets=((0, 1),),
            local_sizes=((ROWS, COLS),),
        )
    }
    ts.save(state, tmp_path, step=1)
    assert torch.equal(ts.read(tmp_path)["w"], _full())
    ts.async_save(state, tmp_path, step=2).wait()  # staged from the strided view
    assert torch.equal(ts.read(tmp_path)["w"], _full())
    restored = {"w": torch.zeros(ROWS, COLS)}
    ts.load(restored, tmp_path)
    assert torch.equal(restored["w"], _full())


def test_more_than_one_shard_in_a_tensor_is_refused_with_the_fix(tmp_path: Path) -> None:
    two = checkpointable(
        torch.zeros(2, COLS),
        global_shape=(ROWS, COLS),
        global_offsets=((0, 0), (4, 0)),
        local_offsets=((0, 0), (1, 0)),
        local_sizes=((1, COLS), (1, COLS)),
    )
    with pytest.raises(ts.InvalidArgumentError, match=r"'opt\.w'.*2 shards.*one shard"):
        ts.save({"opt": {"w": two}}, tmp_path, step=1)
    assert not (tmp_path / "snapshots").exists()


@pytest.mark.parametrize(
    ("fields", "what"),
    [
        ({"global_offsets": ((6, 0),)}, "outside the global shape"),
        ({"local_offsets": ((1, 0),)}, "outside the local tensor"),
        ({"local_sizes": ((4,),)}, "dimensions"),
    ],
)
def test_fields_that_do_not_fit_are_refused_naming_the_key(
    tmp_path: Path, fields: dict[str, Any], what: str
) -> None:
    base: dict[str, Any] = {"global_shape": (ROWS, COLS), "global_offsets": ((0, 0),)}
    tensor = checkpointable(torch.zeros(4, COLS), **{**base, **fields})
    with pytest.raises(ts.InvalidArgumentError, match=rf"'w'.*{what}"):
        ts.save({"w": tensor}, tmp_path, step=1)
