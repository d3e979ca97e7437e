"""Single-process save and load: bitwise round trips, load semantics, plain values, pickle."""

from __future__ import annotations

import tempfile
from collections import OrderedDict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trainsnap as ts
from trainsnap.format.values import _dtypes

ALL_DTYPES = sorted(_dtypes().values(), key=str)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, denormals, every fp8 code) of the given dtype."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


shapes = st.lists(st.integers(0, 9), min_size=0, max_size=4).map(tuple)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(ALL_DTYPES),
    shape=shapes,
    seed=st.integers(0, 2**31),
    transpose=st.booleans(),
    blocks=st.sampled_from([None, 64]),
)
def test_every_dtype_and_shape_round_trips_bitwise(dtype, shape, seed, transpose, blocks):
    from trainsnap import tunables

    tunables.set_for_testing(
        None
        if blocks is None
        else tunables.Tunables(
            block_size=blocks, chunk_size=256, pack_threshold=128, read_budget=256
        )
    )
    src = random_tensor(shape, dtype, seed)
    if transpose and src.dim() >= 2:
        src = src.transpose(0, 1)  # non-contiguous source
    state = {"t": src, "scalar": random_tensor((), dtype, seed + 1)}
    with tempfile.TemporaryDirectory() as root:
        ts.save(state, root, step=1)
        # Destinations hold other random bits, and the same (non-)contiguity as the source.
        dst = {"t": random_tensor(shape, dtype, seed + 7), "scalar": random_tensor((), dtype, 9)}
        if transpose and src.dim() >= 2:
            dst["t"] = dst["t"].transpose(0, 1)
        ts.load(dst, root)
    assert same_bits(dst["t"], src)
    assert same_bits(dst["scalar"], state["scalar"])


def test_many_tensors_across_packs_chunks_and_blocks(tmp_path, small_blocks):
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}.w": torch.randn(i + 1, 37, generator=g) for i in range(60)}
    state["big"] = torch.randn(5000, generator=g)  # 20 KB: 5 chunks of 4 KiB
    state["empty"] = torch.empty(0, 3)
    info = ts.save(state, tmp_path, step=7)
    assert info.step == 7 and info.level == "strict" and info.nbytes > 0
    dst = {k: torch.full_like(v, 7.0) for k, v in state.items()}
    got = ts.load(dst, tmp_path)
    assert got.id == info.id
    for k, v in state.items():
        assert same_bits(dst[k], v), k


def test_plain_values_round_trip_with_their_types(tmp_path):
    values = {
        "lr": 3e-4,
        "betas": (0.9, 0.95),
        "milestones": [1, 2, 3],
        "nan": float("nan"),
        "inf": float("-inf"),
        "name": "run-α",
        "none": None,
        "flag": True,
        "blob": b"\x00\xff",
        "shape": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "nested": [{"a": 1, 2: "int key", "$x": "dollar key"}],
    }
    ts.save({"v": values}, tmp_path, step=1)
    dst = {"v": dict.fromkeys(values)}
    ts.load(dst, tmp_path)
    got = dst["v"]
    for k, v in values.items():
        if k == "nan":
            assert got[k] != got[k]
        else:
            assert got[k] == v and type(got[k]) is type(v), k


def test_load_restores_each_top_level_key_asked_whole_and_ignores_the_others(tmp_path):
    ts.save({"a": torch.ones(3), "b": torch.ones(2), "meta": {"x": 1, "y": 2}}, tmp_path, step=1)
    meta = {"y": 0}
    dst = {"a": torch.zeros(3), "meta": meta}
    ts.load(dst, tmp_path)
    assert dst["a"].tolist() == [1, 1, 1] and "b" not in dst
    assert dst["meta"] == {"x": 1, "y": 2} and dst["meta"] is meta  # filled in place, in order
    assert list(meta) == ["x", "y"]


def test_a_key_the_snapshot_lacks_is_an_error_and_nothing_is_filled(tmp_path):
    ts.save({"a": torch.ones(3)}, tmp_path, step=1)
    dst = {"a": torch.zeros(3), "missing": torch.zeros(1)}
    with pytest.raises(ts.NotFoundError, match="missing") as e:
        ts.load(dst, tmp_path)
    assert e.value.key == "missing"
    assert dst["a"].tolist() == [0, 0, 0]


def test_shape_and_dtype_mismatches_are_refused_before_reading(tmp_path):
    ts.save({"a": torch.ones(3), "b": torch.ones(2)}, tmp_path, step=1)
    dst = {"a": torch.zeros(4), "b": torch.zeros(2, dtype=torch.float64)}
    with pytest.raises(ts.IncompatibleError) as e:
        ts.load(dst, tmp_path)
    text = str(e.value)
    assert "'a'" in text and "[3]" in text and "'b'" in text and "float64" in text


class Counter:
    """A stateful object: saved through state_dict, restored through load_state_dict."""

    def __init__(self) -> None:
        self.n = 0
        self.buf = torch.zeros(4)

    def state_dict(self):
        return {"n": self.n, "buf": self.buf}

    def load_state_dict(self, sd):
        self.n = sd["n"]
        self.buf.copy_(sd["buf"])


def test_stateful_objects_and_modules(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    c = Counter()
    c.n, c.buf[:] = 5, torch.arange(4.0)
    ts.save({"model": model, "counter": c}, tmp_path, step=2)
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    c2 = Counter()
    ts.load({"model": model2, "counter": c2}, tmp_path)
    for (k, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    assert c2.n == 5 and c2.buf.tolist() == [0, 1, 2, 3]


def test_ordered_dicts_and_lists_of_tensors(tmp_path):
    state = OrderedDict(layers=[torch.ones(2), torch.full((3,), 2.0)], steps=[1, 2])
    ts.save(state, tmp_path, step=1)
    dst = OrderedDict(layers=[torch.zeros(2), torch.zeros(3)], steps=None)
    ts.load(dst, tmp_path)
    assert dst["layers"][1].tolist() == [2, 2, 2] and dst["steps"] == [1, 2]


class Opaque:
    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.x == self.x


def test_non_plain_values_need_pickle_opt_in_on_save_and_on_load(tmp_path):
    with pytest.raises(ts.InvalidArgumentError, match="allow_pickle"):
        ts.save({"o": Opaque(1)}, tmp_path, step=1)
    assert ts.list_snapshots(tmp_path) == []
    assert not (tmp_path / "objects").exists() or not any((tmp_path / "objects").rglob("*"))
    ts.save({"o": Opaque(3)}, tmp_path, step=1, options=ts.SaveOptions(allow_pickle=True))
    dst = {"o": None}
    with pytest.raises(ts.IncompatibleError, match="pickle"):
        ts.load(dst, tmp_path)
    assert dst["o"] is None
    ts.load(dst, tmp_path, allow_pickle=True)
    assert dst["o"] == Opaque(3)


def test_latest_is_the_highest_step_and_ids_are_unique(tmp_path):
    infos = [ts.save({"a": torch.full((2,), float(s))}, tmp_path, step=s) for s in (5, 20, 10)]
    again = ts.save({"a": torch.full((2,), 20.0)}, tmp_path, step=20)
    ids = [i.id for i in [*infos, again]]
    assert len(set(ids)) == 4
    listed = ts.list_snapshots(tmp_path)
    assert [s.step for s in listed] == [5, 10, 20, 20]
    dst = {"a": torch.zeros(2)}
    got = ts.load(dst, tmp_path)
    assert got.step == 20 and dst["a"].tolist() == [20, 20]
    got = ts.load(dst, tmp_path, snapshot=infos[0].id)
    assert got.step == 5 and dst["a"].tolist() == [5, 5]


def test_unchanged_objects_are_not_rewritten(tmp_path, caplog):
    state = {"w": torch.randn(300_000)}
    ts.save(state, tmp_path, step=1)
    objects = sorted(p.name for p in (tmp_path / "objects").rglob("*") if p.is_file())
    ts.save(state, tmp_path, step=2)
    assert sorted(p.name for p in (tmp_path / "objects").rglob("*") if p.is_file()) == objects
    assert "written=0" in caplog.records[-1].getMessage()


def test_bad_arguments_name_the_problem(tmp_path):
    with pytest.raises(ts.InvalidArgumentError, match="step"):
        ts.save({"a": torch.ones(1)}, tmp_path, step=-1)
    with pytest.raises(ts.InvalidArgumentError, match="mapping"):
        ts.save(torch.ones(1), tmp_path, step=1)
    with pytest.raises(ts.InvalidArgumentError, match="collide"):
        ts.save({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, tmp_path, step=1)
    with pytest.raises(ts.NotFoundError, match="no committed snapshot"):
        ts.load({"a": torch.ones(1)}, tmp_path)
    with pytest.raises(ts.InvalidArgumentError, match="scheme"):
        ts.save({"a": torch.ones(1)}, "nosuch://x", step=1)
    with pytest.raises(ts.IncompatibleError, match="not a trainsnap snapshot id"):
        ts.load({"a": torch.ones(1)}, tmp_path, snapshot="../../etc")


def test_sharded_boxes_and_flat_ranges_on_one_process(tmp_path):
    full = torch.arange(24.0).reshape(4, 6)
    state = {
        "top": ts.Sharded(full[:2].clone(), global_shape=(4, 6), offsets=(0, 0)),
        "bottom": ts.Sharded.flat(full.reshape(-1)[12:].clone(), global_shape=(4, 6), start=12),
    }
    # A single process saving one piece of each tensor is an incomplete tiling: refused.
    with pytest.raises(ts.TrainsnapError, match="cover"):
        ts.save(state, tmp_path, step=1)


def test_bounce_pool_reuses_buffers_and_stays_within_its_budget():
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from trainsnap.engine.buffers import BouncePool

    mib = 1 << 20
    pool = BouncePool(16 * mib)
    in_use, peak_in_use, lock = [0], [0], threading.Lock()

    def piece(i: int) -> None:
        n = (3 + i % 2) * mib  # two sizes, both below one rounded mapping
        with pool.buffer(n) as buf:
            assert len(buf) == n
            with lock:
                in_use[0] += n
                peak_in_use[0] = max(peak_in_use[0], in_use[0])
            buf[:] = bytes([i % 256]) * n  # a buffer is this task's alone while it holds it
            assert buf[0] == buf[-1] == i % 256
            with lock:
                in_use[0] -= n
        assert pool.mapped <= pool.limit + 4 * mib

    with ThreadPoolExecutor(8) as ex:
        list(ex.map(piece, range(200)))
    assert peak_in_use[0] <= pool.limit and pool.peak <= pool.limit
    assert pool.maps <= 8, f"{pool.maps} mappings for 200 pieces: buffers are not reused"
    pool.close()
    assert pool.mapped == 0


def test_replica_digests_are_hashed_in_parallel_batches_in_entry_order(monkeypatch):
    from trainsnap.format.checksums import Hasher
    from trainsnap.protocol import rank_save

    monkeypatch.setattr(rank_save, "_HASH_BATCH", 300)  # many batches on the thread pool
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(i % 7 * 13 + 1, generator=g) for i in range(60)}
    state["sharded"] = ts.Sharded(torch.ones(4), global_shape=(4,), offsets=(0,))
    hasher = Hasher()
    local = rank_save.describe(state, rank_save.SaveRequest(step=1), hasher, replica_digests=True)
    by_key = {e[0]: e[5] for e in local.entries}
    assert by_key.pop("sharded") is None  # declared layouts are not hashed
    for key, digest in by_key.items():
        assert digest == hasher.digest(state[key].numpy().tobytes()), key
