"""Decoders whose time is linear in what they read: keys crafted to share one hash (integers
``k * (2**61 - 1)`` all hash to 0) and pickles whose memo expands one record exponentially are
refused, in about the time a harmless container of the same size takes to decode."""

from __future__ import annotations

import json
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

import trainsnap as ts
from trainsnap.format import flooding, tree, values
from trainsnap.integrations.dcp_metadata import decode_metadata

P = 2**61 - 1
N = 40_000


def _keys(colliding: bool, n: int = N) -> list[int]:
    """``n`` integers of the same digits: all of one hash, or each of its own."""
    return [k * P if colliding else k * P + k for k in range(1, n + 1)]


def _decode(document: Any) -> Any:
    data = json.dumps(document).encode()
    return values.decode(values.JSON, data, "cfg", allow_pickle=False, snapshot_id="s")


def _seconds(fn: Callable[[], Any], *, refused: bool) -> float:
    """How long ``fn`` takes; it must raise a TrainsnapError when ``refused``, and not else."""
    start = time.perf_counter()
    if refused:
        with pytest.raises(ts.TrainsnapError):
            fn()
    else:
        fn()
    return time.perf_counter() - start


def _within_twice_the_control(make: Callable[[bool], Callable[[], Any]]) -> None:
    """The attack (refused with a TrainsnapError) takes at most twice as long as the harmless
    control of the same size, best of three each (the host is shared)."""
    attack, control = make(True), make(False)
    spent = min(_seconds(attack, refused=True) for _ in range(3))
    baseline = min(_seconds(control, refused=False) for _ in range(3))
    assert spent <= 2 * baseline + 0.01, (spent, baseline)


def test_a_set_of_colliding_integers_is_refused_as_fast_as_a_harmless_one() -> None:
    """Hostile suite 3: 40,000 such integers in a $set made ts.read take 15.9 s (2.1 s without
    collisions)."""

    def make(colliding: bool) -> Callable[[], Any]:
        document = {"$set": _keys(colliding)}
        return lambda: _decode(document)

    _within_twice_the_control(make)


def test_a_dict_of_colliding_integer_keys_is_refused_as_fast_as_a_harmless_one() -> None:
    """Hostile suite 3: the same in a $dict took 33.5 s."""

    def make(colliding: bool) -> Callable[[], Any]:
        document = {"$dict": [[k, 0] for k in _keys(colliding)]}
        return lambda: _decode(document)

    _within_twice_the_control(make)


def _tree_problems(colliding: bool) -> Callable[[], Any]:
    keys = _keys(colliding)
    node = {"d": [[k, 0] for k in keys]}
    names = {str(k) for k in keys}

    def run() -> None:
        found = tree.problems(node, names)
        if found:
            raise ts.CorruptError(found[0])

    return run


def test_a_tree_node_of_colliding_integer_keys_is_refused_as_fast_as_a_harmless_one() -> None:
    """Hostile suite 3: a tree node with 30,000 such keys did not finish in 40 s (the tree check
    runs in verify, gc and the manager's collection)."""
    _within_twice_the_control(_tree_problems)
    found = tree.problems({"d": [[k, 0] for k in _keys(True, 100)]}, {str(k) for k in _keys(True)})
    assert found and "one hash value" in found[0]


def test_a_read_of_a_snapshot_holding_a_colliding_set_is_corrupt_in_time(tmp_path: Path) -> None:
    """End to end: the crafted value (a save refuses it, so it is planted with the save's check
    off) is damage to its snapshot, found in well under a second."""
    crafted = set(_keys(True, 2000))  # building it is quadratic too: kept small
    with mock.patch.object(values, "check_spread", lambda keys, what: None):
        ts.save({"w": torch.ones(2), "ids": crafted}, tmp_path, step=1)
    start = time.perf_counter()
    with pytest.raises(ts.CorruptError, match="one hash value"):
        ts.read(tmp_path)
    assert time.perf_counter() - start < 5


def test_a_save_refuses_what_a_reader_would_refuse(tmp_path: Path) -> None:
    for crafted in (set(_keys(True, 100)), [{k: 1 for k in _keys(True, 100)}]):
        with pytest.raises(ts.InvalidArgumentError, match="one hash value"):
            ts.save({"w": torch.ones(1), "cfg": crafted}, tmp_path, step=1)
    ordinary = {-1, -2, 0, 1, 2**61 - 1, 2**64, 2.5, "x", None, 3.5}
    assert _decode(json.loads(values.encode_plain(ordinary))) == ordinary


def test_the_bound_is_on_one_hash_not_on_the_size() -> None:
    flooding.check_spread(range(10**5), "a set")  # distinct hashes: any number
    flooding.check_spread(["a"] * 1000, "a set")  # strings hash with a random key: skipped
    flooding.check_spread(_keys(True, flooding.MAX_SHARED_HASH), "a set")
    with pytest.raises(flooding.FloodError, match="a set holds more than"):
        flooding.check_spread(_keys(True, flooding.MAX_SHARED_HASH + 1), "a set")


# -- DCP metadata ----------------------------------------------------------------------------------


def _doubling(levels: int, *, memo: bool) -> bytes:
    """A pickle of a set holding T(levels), T(0) = () and T(i+1) = (T(i), T(i)): each level
    one reference to the one before (DUP, or MEMOIZE and a memo GET), 2^levels leaves to
    hash."""
    out = bytearray(pickle.PROTO + b"\x04" + pickle.EMPTY_SET + pickle.MARK + pickle.EMPTY_TUPLE)
    for i in range(levels):
        if memo:
            out += pickle.MEMOIZE + pickle.BINGET + bytes([i]) + pickle.TUPLE2
        else:
            out += pickle.DUP + pickle.TUPLE2
    return bytes(out + pickle.ADDITEMS + pickle.STOP)


@pytest.mark.parametrize("memo", [True, False])
def test_a_metadata_of_shared_references_is_refused_in_under_a_second(memo: bool) -> None:
    """Hostile suite 3: a 220-byte .metadata whose memo builds T(i+1) = (T(i), T(i)) 40 times
    made hash() walk 2^40 leaves: import-dcp hung, uninterruptibly."""
    data = _doubling(40, memo=memo)
    assert len(data) <= 220
    start = time.perf_counter()
    with pytest.raises(ts.IncompatibleError, match="expand to more than"):
        decode_metadata(data)
    assert time.perf_counter() - start < 1


def _colliding_set_pickle(colliding: bool, n: int = 60_000) -> bytes:
    out = bytearray(pickle.PROTO + b"\x04" + pickle.EMPTY_SET + pickle.MARK)
    for value in _keys(colliding, n):
        raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
        out += pickle.LONG1 + bytes([len(raw)]) + raw
    return bytes(out + pickle.ADDITEMS + pickle.STOP)


def test_a_metadata_set_of_colliding_integers_is_refused_as_fast_as_a_harmless_one() -> None:
    """Hostile suite 3: 60,000 colliding integers (0.7 MB) took the DCP reader 36-38 s before it
    refused the set for not being DCP metadata."""

    def make(colliding: bool) -> Callable[[], Any]:
        data = _colliding_set_pickle(colliding)

        def run() -> None:
            with pytest.raises(ts.IncompatibleError) as refused:
                decode_metadata(data)
            assert ("one hash value" in str(refused.value)) == colliding
            if colliding:
                raise refused.value

        return run

    _within_twice_the_control(make)
