"""The saved tree comes back whole: ``ts.read`` with no template, and the load rule (the state's
top-level keys say what to restore; under each, everything comes back exactly as saved)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import enum
import math
import pathlib
import tempfile
from collections import OrderedDict, namedtuple
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import trainsnap as ts
from trainsnap.testing import assert_all_ok, run_ranks

# -- exact equality: types, key order, tensors bitwise ---------------------------------------------


def same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return (
            list(a) == list(b)
            and all(type(k) is type(j) for k, j in zip(a, b, strict=True))
            and all(same(a[k], b[k]) for k in a)
        )
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return bool(a == b)


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.bool else flat


# -- random trees --------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8,
          torch.uint8, torch.bool]  # fmt: skip


@st.composite
def tensors(draw: Any) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(0, 100, shape, generator=g).to(dtype)


KEYS = st.one_of(
    st.text(alphabet="ab.{}/ é中$_0", min_size=1, max_size=5),
    st.integers(-2, 30),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**62), 2**62),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
)


def containers(children: Any) -> Any:
    return st.one_of(
        st.dictionaries(KEYS, children, max_size=4),
        st.dictionaries(KEYS, children, max_size=4).map(OrderedDict),
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
    )


TREES = st.dictionaries(
    KEYS,
    st.recursive(st.one_of(SCALARS, tensors()), containers, max_leaves=12),
    min_size=1,
    max_size=4,
)


def _save(state: dict, root: str) -> None:
    try:
        ts.save(state, root, step=1)
    except ts.InvalidArgumentError as e:
        assume("flatten to the key" not in str(e))  # two paths with one dotted key: refused
        raise


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state=TREES)
def test_any_tree_reads_back_exactly_with_no_template(state):
    with tempfile.TemporaryDirectory() as root:
        _save(state, root)
        assert same(ts.read(root), state)


@st.composite
def templates(draw: Any, saved: Any) -> Any:
    """A template made from ``saved``: keys deleted, lists shortened, subtrees replaced by
    placeholders, tensors by fresh ones of the same layout."""
    choice = draw(st.integers(0, 9))
    if choice == 0:
        return None
    if choice == 1:
        return {}
    if choice == 2:
        return []
    if isinstance(saved, torch.Tensor):
        return torch.zeros_like(saved)
    if isinstance(saved, dict):
        keys = [k for k in saved if draw(st.booleans()) or choice > 6]
        out = {k: draw(templates(saved[k])) for k in keys}
        return OrderedDict(out) if isinstance(saved, OrderedDict) else out
    if isinstance(saved, list | tuple):
        n = draw(st.integers(0, len(saved)))
        return type(saved)(draw(templates(x)) for x in saved[:n])
    return draw(st.one_of(st.none(), SCALARS))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), state=TREES)
def test_any_template_made_from_the_saved_tree_gets_every_asked_key_exactly(data, state):
    with tempfile.TemporaryDirectory() as root:
        _save(state, root)
        top = [k for k in state if data.draw(st.booleans())] or list(state)[:1]
        template = {k: data.draw(templates(state[k])) for k in top}
        try:
            ts.load(template, root)
        except ts.TrainsnapError:
            return  # refused loudly: allowed
        assert list(template) == top
        for k in top:
            assert same(template[k], state[k]), k


# -- the cases that used to come back different --------------------------------------------------


def test_placeholders_are_filled_from_the_snapshot(tmp_path):
    saved = {
        "extra": {"cfg": {"lr": 1e-3, "layers": [1, 2]}, "n": 5},
        "many": [torch.ones(2), torch.zeros(3), torch.arange(4)],
        "best_model_score": torch.tensor(0.25),
        "callbacks": {"ckpt": {"best": None, "paths": {}}},
    }
    ts.save(saved, tmp_path, step=1)
    dst = {
        "extra": {"cfg": {}, "n": 0},
        "many": [torch.empty(2)],
        "best_model_score": None,
        "callbacks": None,
    }
    ts.load(dst, tmp_path)
    assert same(dst, saved)


def test_a_raw_optimizer_gets_its_moments_from_a_fresh_template(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    ts.save({"opt": opt}, tmp_path, step=1)
    fresh = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=0.5)
    assert fresh.state_dict()["state"] == {}
    ts.load({"opt": fresh}, tmp_path)
    assert same(fresh.state_dict()["state"], opt.state_dict()["state"])
    assert fresh.param_groups[0]["lr"] == 0.1


def test_train_state_with_an_empty_extra_restores_the_saved_extra(tmp_path):
    model = torch.nn.Linear(2, 2)
    ts.save(ts.TrainState(model=model, extra={"tokens_seen": 7, "note": "x"}), tmp_path, step=3)
    extra: dict = {}
    ts.load(ts.TrainState(model=torch.nn.Linear(2, 2), extra=extra), tmp_path, level="training")
    assert extra == {"tokens_seen": 7, "note": "x"}


class _Counter:
    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state_dict: dict) -> None:
        self.n = state_dict["n"]


def test_a_load_leaves_no_reference_to_the_state(tmp_path):
    """Once loaded into, a stateful object is freed when its caller drops it, not by a later
    cyclic collection (objects that stop something in ``__del__`` -- a DataLoader's iterator
    with its worker processes -- rely on it)."""
    import gc
    import weakref

    ts.save({"counter": _Counter(7), "extra": {"x": 1}}, tmp_path, step=1)
    gc.collect()
    gc.disable()  # what only a cyclic collection frees stays
    try:
        counter = _Counter()
        ts.load({"counter": counter, "extra": {}}, tmp_path)
        assert counter.n == 7
        ref = weakref.ref(counter)
        del counter
        freed = ref() is None
    finally:
        gc.enable()
    assert freed


def _save_halves(rank: int, world: int, root: str) -> None:
    half = torch.full((2, 4), float(rank))
    ts.save({"w": ts.Sharded(half, global_shape=(4, 4), offsets=(2 * rank, 0))}, root, step=1)


def test_a_sharded_tensor_with_no_destination_is_refused_naming_the_key(tmp_path):
    assert_all_ok(run_ranks(_save_halves, 2, args=(str(tmp_path),), timeout=90))
    with pytest.raises(ts.IncompatibleError, match=r"'w'.*saved sharded \(2 shards"):
        ts.load({"w": None}, tmp_path)
    full = ts.read(tmp_path)["w"]  # ts.read assembles it, on request
    assert full.tolist() == [[0.0] * 4] * 2 + [[1.0] * 4] * 2


def test_a_key_the_snapshot_lacks_stays_an_error(tmp_path):
    ts.save({"extra": {"a": 1}}, tmp_path, step=1)
    with pytest.raises(ts.NotFoundError, match=r"extra\.b"):
        ts.load({"extra": {"a": 0, "b": 0}}, tmp_path)
    with pytest.raises(ts.IncompatibleError, match="holds 2 items, the snapshot 1"):
        ts.save({"l": [torch.ones(1)]}, tmp_path / "l", step=1)
        ts.load({"l": [torch.ones(1), torch.ones(1)]}, tmp_path / "l")


def test_read_selects_keys_and_ranks(tmp_path):
    state = {"model": {"w": torch.ones(2), "b": torch.zeros(1)}, "optim": {"lr": 0.1}}
    ts.save(state, tmp_path, step=1)
    assert same(ts.read(tmp_path, keys="model.w"), {"model": {"w": torch.ones(2)}})
    assert same(ts.read(tmp_path, keys=["optim"]), {"optim": {"lr": 0.1}})
    with pytest.raises(ts.NotFoundError, match="'nope'"):
        ts.read(tmp_path, keys="nope")
    with pytest.raises(ts.InvalidArgumentError, match="rank=3"):
        ts.read(tmp_path, rank=3)


def test_colliding_dotted_keys_are_refused_at_save(tmp_path):
    with pytest.raises(ts.InvalidArgumentError, match=r"flatten to the key .a\.b."):
        ts.save({"a": {"b": 1, 0: 2}, "a.b": 3}, tmp_path, step=1)
    with pytest.raises(ts.InvalidArgumentError, match=r"flatten to the key .x\.1."):
        ts.save({"x": {1: 1, "1": 2}}, tmp_path, step=1)


# -- plain values ---------------------------------------------------------------------------------


def test_common_plain_values_round_trip_as_themselves(tmp_path):
    value = {
        "path": pathlib.Path("/data/shards"),
        "pure": pathlib.PurePosixPath("a/b"),
        "win": pathlib.PureWindowsPath("C:/x"),
        "np_scalar": np.float32(0.5),
        "np_int": np.int64(7),
        "np_array": np.arange(6, dtype=np.int16).reshape(2, 3),
        "np_str": np.array(["a", "bc"]),
        "in_list": [OrderedDict([("b", 1), ("a", 2)]), {3, 1, 2}, frozenset({"x"})],
        "when": dt.datetime(2026, 12, 1, 12, 30, tzinfo=dt.timezone.utc),
        "day": dt.date(2026, 12, 1),
        "time": dt.time(1, 2, 3),
        "delta": dt.timedelta(days=1, seconds=2, microseconds=3),
    }
    ts.save({"v": value}, tmp_path, step=1)
    back = ts.read(tmp_path)["v"]
    assert same(back, value)
    dst: dict = {"v": None}
    ts.load(dst, tmp_path)
    assert same(dst["v"], value)


Point = namedtuple("Point", "x y")


class Color(enum.Enum):
    RED = 1


@dataclasses.dataclass
class Config:
    lr: float = 0.1


@pytest.mark.parametrize(
    ("value", "what"),
    [
        (Point(1, 2), "namedtuple"),
        (Color.RED, "enum"),
        (argparse.Namespace(lr=0.1), "argparse.Namespace"),
        (Config(), "dataclass"),
    ],
)
def test_other_values_are_refused_naming_the_key_and_the_per_key_opt_in(tmp_path, value, what):
    state = {"hyper_parameters": {"h": value}, "w": torch.ones(1)}
    with pytest.raises(ts.InvalidArgumentError, match=what) as e:
        ts.save(state, tmp_path, step=1)
    assert "'hyper_parameters.h'" in str(e.value)
    assert "allow_pickle=('hyper_parameters',)" in str(e.value)
    with pytest.raises(ts.InvalidArgumentError):  # an opt-in for another key does not cover it
        ts.save(state, tmp_path, step=1, options=ts.SaveOptions(allow_pickle=("w",)))
    ts.save(state, tmp_path, step=1, options=ts.SaveOptions(allow_pickle=("hyper_parameters",)))
    with pytest.raises(ts.IncompatibleError, match="pickle"):
        ts.read(tmp_path)
    with pytest.raises(ts.IncompatibleError, match="pickle"):
        ts.load({"hyper_parameters": None}, tmp_path, allow_pickle=("w",))
    dst: dict = {"hyper_parameters": None}
    ts.load(dst, tmp_path, allow_pickle=("hyper_parameters",))
    assert dst["hyper_parameters"]["h"] == value
    assert ts.read(tmp_path, keys="w", allow_pickle=False)["w"].tolist() == [1.0]
