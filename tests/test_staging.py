"""The staging pool (``engine/staging.py``): reused host buffers within a byte budget.

A staged buffer belongs to its lease until released -- never handed out again, never modified --
and is reused by the next save of the same layout; the pool never holds more than its budget; the
staged bytes are the source's bytes exactly, in row-major order, whatever the dtype and strides.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainsnap.engine.staging import BudgetExceeded, Lease, StagingPool

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A tensor of uniformly random bit patterns (NaNs with payloads, subnormals, -0.0 included
    for float types); booleans are 0 or 1, the only valid ones."""
    g = torch.Generator().manual_seed(seed)
    numel = int(np.prod(shape))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * size,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def row_major_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of the tensor's elements in row-major order (its contiguous copy's bytes)."""
    source = tensor.detach().resolve_conj().resolve_neg()
    fresh = torch.empty(source.shape, dtype=source.dtype).copy_(source)  # row-major strides
    return fresh.reshape(-1).view(torch.uint8).numpy().tobytes()


def address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def non_contiguous(base: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of a (6, 8, 10) tensor with strides other than row-major."""
    return {
        "transposed": base.transpose(0, 2),
        "permuted": base.permute(1, 2, 0),
        "stepped": base[::2, 1::3, ::4],
        "column": base[:, 3, :],
        "expanded": base[:1, :1, :].expand(4, 5, 10),
        "scalar_of_a_slice": base[2, 3, 4],
    }


# -- reuse ----------------------------------------------------------------------------------------


def test_a_released_buffer_is_reused_by_the_next_payload_of_its_size() -> None:
    pool = StagingPool()
    first = Lease()
    pool.stage(torch.ones(100, dtype=torch.float32), first)
    buffer = first.buffers[0].data_ptr()
    assert pool.allocated == 400 and first.nbytes == 400
    pool.release(first)
    assert first.buffers == []

    second = Lease()
    staged = pool.stage(torch.arange(50, dtype=torch.int64), second)  # 400 bytes as well
    assert second.buffers[0].data_ptr() == buffer, "a fresh buffer where one was free"
    assert pool.allocated == 400
    assert bytes(staged) == row_major_bytes(torch.arange(50, dtype=torch.int64))


def test_a_save_of_the_same_layout_reuses_the_arena_views_and_all() -> None:
    pool = StagingPool()
    shapes = [((3, 5), torch.float32), ((7,), torch.bfloat16), ((2, 2, 2), torch.int64)]
    first = Lease()
    views = pool.stage_many([torch.zeros(s, dtype=d) for s, d in shapes], first)
    arena, allocated = first.arena, pool.allocated
    assert arena is not None and allocated == arena.buffer.numel()
    pool.release(first)
    assert first.arena is None

    second = Lease()
    tensors = [random_bits(s, d, seed=i) for i, (s, d) in enumerate(shapes)]
    again = pool.stage_many(tensors, second)
    assert second.arena is arena, "the same layout did not reuse its arena"
    assert [address(v) for v in again] == [address(v) for v in views]
    assert pool.allocated == allocated
    assert [bytes(v) for v in again] == [row_major_bytes(t) for t in tensors]


def test_arena_views_sit_on_64_byte_boundaries_back_to_back() -> None:
    pool = StagingPool()
    lease = Lease()
    tensors = [torch.ones(3, dtype=torch.int8), torch.ones(5, dtype=torch.float64), torch.ones(1)]
    views = pool.stage_many(tensors, lease)
    assert lease.arena is not None
    base = lease.arena.buffer.data_ptr()
    assert [address(v) - base for v in views] == [0, 64, 128]
    assert [len(v) for v in views] == [3, 40, 4]
    assert lease.nbytes == 192 == pool.allocated


# -- a leased buffer belongs to its save --------------------------------------------------------


def test_a_leased_buffer_is_not_handed_out_again_until_released() -> None:
    pool = StagingPool()
    x, y, z = (random_bits((64,), torch.float32, seed=s) for s in (1, 2, 3))
    first, second = Lease(), Lease()
    staged_x = pool.stage(x, first)
    staged_y = pool.stage(y, second)  # same size, first still leased
    assert first.buffers[0].data_ptr() != second.buffers[0].data_ptr()
    assert pool.allocated == 2 * 256
    assert bytes(staged_x) == row_major_bytes(x) and bytes(staged_y) == row_major_bytes(y)

    pool.release(first)
    third = Lease()
    pool.stage(z, third)
    assert third.buffers[0].data_ptr() == address(staged_x), "the released buffer is the one reused"
    assert bytes(staged_y) == row_major_bytes(y), "a leased buffer was written by another save"
    assert pool.allocated == 2 * 256


def test_a_leased_arena_is_not_reused_by_a_save_of_the_same_layout() -> None:
    pool = StagingPool()
    a = [random_bits((4, 4), torch.float32, seed=1), random_bits((9,), torch.int16, seed=2)]
    b = [random_bits((4, 4), torch.float32, seed=3), random_bits((9,), torch.int16, seed=4)]
    first, second = Lease(), Lease()
    staged_a = pool.stage_many(a, first)
    staged_b = pool.stage_many(b, second)
    assert first.arena is not None and second.arena is not None
    assert first.arena is not second.arena
    assert first.arena.buffer.data_ptr() != second.arena.buffer.data_ptr()
    assert [bytes(v) for v in staged_a] == [row_major_bytes(t) for t in a]
    assert [bytes(v) for v in staged_b] == [row_major_bytes(t) for t in b]


def test_staged_bytes_do_not_follow_later_writes_to_the_source() -> None:
    pool = StagingPool()
    source = random_bits((32,), torch.float32, seed=5)
    expect = row_major_bytes(source)
    one, many = Lease(), Lease()
    staged = pool.stage(source, one)
    [staged_many] = pool.stage_many([source], many)
    source.fill_(0.0)  # training goes on and overwrites the parameter
    assert bytes(staged) == expect and bytes(staged_many) == expect


# -- the budget -----------------------------------------------------------------------------------


def test_the_budget_refuses_a_buffer_beyond_it_and_admits_it_after_a_release() -> None:
    pool = StagingPool(budget=1000)
    first = Lease()
    pool.stage(torch.ones(150), first)  # 600 bytes
    with pytest.raises(BudgetExceeded, match="budget of 1000"):
        pool.stage(torch.ones(150), Lease())
    assert pool.allocated == 600
    pool.release(first)
    second = Lease()
    pool.stage(torch.ones(150), second)
    assert pool.allocated == 600 and second.nbytes == 600


def test_the_budget_refuses_a_second_arena_while_the_first_is_leased() -> None:
    pool = StagingPool(budget=1000)
    first = Lease()
    pool.stage_many([torch.ones(150)], first)
    with pytest.raises(BudgetExceeded):
        pool.stage_many([torch.ones(150)], Lease())
    assert pool.allocated == 640  # 600 bytes rounded up to the 64-byte boundary
    pool.release(first)
    second = Lease()
    pool.stage_many([torch.zeros(150)], second)
    assert second.arena is not None and pool.allocated == 640


def test_idle_buffers_are_freed_to_make_room_and_the_pool_stays_within_budget() -> None:
    pool = StagingPool(budget=1000)
    lease = Lease()
    pool.stage(torch.ones(150), lease)  # 600 bytes
    pool.release(lease)
    bigger = Lease()
    pool.stage(torch.ones(200), bigger)  # 800 bytes: only fits once the idle 600 are freed
    assert pool.allocated == 800 <= pool.budget  # type: ignore[operator]
    pool.release(bigger)


def test_check_fits_compares_a_save_with_the_budget() -> None:
    pool = StagingPool(budget=1000)
    pool.check_fits([400, 600])  # exactly the budget fits
    with pytest.raises(BudgetExceeded, match=r"\(1001 bytes\) exceeds the staging budget \(1000"):
        pool.check_fits([400, 601])
    StagingPool().check_fits([2**40])  # no budget: anything fits


def test_a_new_layout_that_fits_the_budget_is_staged_once_the_old_one_is_released() -> None:
    pool = StagingPool(budget=1000)
    before = Lease()
    pool.stage_many([torch.ones(150, dtype=torch.float32)], before)  # 600 bytes
    pool.release(before)  # nothing is leased any more

    after = [torch.ones(150, dtype=torch.int32)]  # same bytes, another dtype: another layout
    pool.check_fits([600])
    lease = Lease()
    views = pool.stage_many(after, lease)
    assert bytes(views[0]) == row_major_bytes(after[0])
    assert pool.allocated <= 1000


def test_idle_arenas_of_layouts_no_longer_saved_are_freed_without_a_budget() -> None:
    pool = StagingPool()
    for n in range(1, 6):  # five layouts in turn, each released after its save
        lease = Lease()
        pool.stage_many([torch.ones(100 * n)], lease)
        pool.release(lease)
    assert pool.allocated <= (400 + 500) * 4 + 2 * 64  # only the two newest layouts stay warm


def test_an_async_save_that_cannot_be_staged_is_written_synchronously(tmp_path) -> None:
    import trainsnap as ts

    saver = ts.AsyncSaver(staging_budget=100_000)
    small = {"w": torch.ones(10_000)}  # 40 KB
    ts.async_save(small, tmp_path, step=1, saver=saver).wait()
    held = Lease()  # another save's buffers, still in use, fill most of the budget
    saver.pool.stage_many([torch.ones(12_000)], held)
    grown = {"w": torch.ones(10_000), "m": torch.ones(5_000)}  # 60 KB, a new layout
    info = ts.async_save(grown, tmp_path, step=2, saver=saver).wait()
    saver.pool.release(held)
    out = {"w": torch.zeros(10_000), "m": torch.zeros(5_000)}
    ts.load(out, tmp_path, snapshot=info.id)
    assert torch.equal(out["w"], grown["w"]) and torch.equal(out["m"], grown["m"])


# -- the staged bytes are the source's bytes ------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_staged_bytes_are_bitwise_those_of_the_source(dtype: torch.dtype) -> None:
    base = random_bits((6, 8, 10), dtype, seed=7)
    sources = {"contiguous": base, **non_contiguous(base)}
    pool = StagingPool()
    for name, source in sources.items():
        lease = Lease()
        assert bytes(pool.stage(source, lease)) == row_major_bytes(source), name
        pool.release(lease)
    # All of them at once through one arena, and again into the reused arena.
    for _ in range(2):
        lease = Lease()
        views = pool.stage_many(list(sources.values()), lease)
        for name, source, view in zip(sources, sources.values(), views, strict=True):
            assert bytes(view) == row_major_bytes(source), name
        pool.release(lease)


def test_special_float_values_survive_bit_for_bit() -> None:
    patterns = [0x7FC00001, 0xFFC00123, 0x7F800001, 0x80000000, 0x00000001, 0x7F800000, 0xFF800000]
    values = torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)
    strided = torch.stack([values, values]).t()[:, 0]  # the same values through a stride of 2
    pool = StagingPool()
    for source in (values, strided):
        assert bytes(pool.stage(source, Lease())) == row_major_bytes(values)
        assert bytes(pool.stage_many([source], Lease())[0]) == row_major_bytes(values)


def test_conjugate_and_negative_views_are_staged_resolved() -> None:
    g = torch.Generator().manual_seed(9)
    z = torch.complex(torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g))
    x = torch.randn(4, dtype=torch.float64, generator=g)
    cases = [
        (z.conj(), np.conj(z.numpy()).tobytes()),
        (z.conj().t(), np.ascontiguousarray(np.conj(z.numpy()).T).tobytes()),
        (torch._neg_view(x), (-x.numpy()).tobytes()),
    ]
    pool = StagingPool()
    for source, expect in cases:
        assert source.is_conj() or source.is_neg()
        assert bytes(pool.stage(source, Lease())) == expect
        assert bytes(pool.stage_many([source, x], Lease())[0]) == expect


def test_scalars_and_empty_tensors_are_staged() -> None:
    pool = StagingPool()
    scalar, empty = torch.tensor(2.5, dtype=torch.float64), torch.empty(0, 3)
    lease = Lease()
    assert bytes(pool.stage(scalar, lease)) == row_major_bytes(scalar)
    assert bytes(pool.stage(empty, lease)) == b""
    assert lease.nbytes == 8 and len(lease.buffers) == 1, "an empty tensor takes no buffer"
    views = pool.stage_many([empty, scalar, torch.empty(0)], Lease())
    assert [bytes(v) for v in views] == [b"", row_major_bytes(scalar), b""]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(1, 6), min_size=1, max_size=4),
    st.sampled_from(DTYPES),
    st.data(),
)
def test_any_strided_view_is_staged_in_row_major_order(
    shape: list[int], dtype: torch.dtype, data: st.DataObject
) -> None:
    base = random_bits(tuple(shape), dtype, seed=len(shape))
    order = data.draw(st.permutations(range(len(shape))))
    view = base.permute(*order)
    slices = tuple(
        slice(data.draw(st.integers(0, n - 1)), None, data.draw(st.integers(1, 3)))
        for n in view.shape
    )
    view = view[slices]
    pool = StagingPool()
    assert bytes(pool.stage(view, Lease())) == row_major_bytes(view)
    assert bytes(pool.stage_many([view, base], Lease())[0]) == row_major_bytes(view)
