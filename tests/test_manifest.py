"""Manifest and marker validation: crafted or damaged metadata only ever raises TrainsnapError
kinds, and never makes a reader or verifier touch anything outside the root."""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trainsnap as ts
from trainsnap.format import encoding, marker
from trainsnap.format import manifest as mf
from trainsnap.format.checksums import Hasher
from trainsnap.protocol import commit
from trainsnap.storage import PosixStorage

_TEMPLATE: dict[str, Any] = {}


class SpyStorage(PosixStorage):
    """A POSIX root that records every key it is asked for and fails the test on any key that
    would resolve outside the root."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.touched: list[str] = []

    def _path(self, key: str) -> Path:
        p = super()._path(key)
        assert self.root in p.resolve().parents, f"{key!r} escapes the root"
        self.touched.append(key)
        return p


def _template() -> dict[str, Any]:
    """A root with one committed snapshot (built once), as {relative path: bytes}."""
    if not _TEMPLATE:
        with tempfile.TemporaryDirectory() as d:
            state = {
                "w": torch.arange(600, dtype=torch.float32).reshape(20, 30),
                "b": torch.ones(7, dtype=torch.bfloat16),
                "cfg": {"lr": 0.5, "names": ["a", "b"]},
            }
            info = ts.save(state, d, step=3)
            _TEMPLATE["id"] = info.id
            _TEMPLATE["files"] = {
                p.relative_to(d).as_posix(): p.read_bytes()
                for p in Path(d).rglob("*")
                if p.is_file()
            }
    return _TEMPLATE


def _materialise(
    root: Path, manifest: bytes | None, marker: bytes | None, version: int = mf.FORMAT_VERSION
) -> str:
    t = _template()
    sid = t["id"]
    for rel, data in t["files"].items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    if manifest is not None:
        (root / mf.manifest_key(sid)).unlink()
        (root / mf.manifest_key(sid, version)).write_bytes(manifest)
    if marker is not None:
        (root / mf.marker_key(sid)).write_bytes(marker)
    return sid


def _reseal(manifest_bytes: bytes, sid: str, version: int = mf.FORMAT_VERSION) -> bytes:
    """A marker that matches these manifest bytes, so validation goes past the checksum."""
    h = Hasher()
    return json.dumps(
        {
            "format": mf.MARKER_FORMAT,
            "format_version": version,
            "snapshot_id": sid,
            "manifest": {
                "size": len(manifest_bytes),
                "algorithm": h.algorithm,
                "digest": h.digest(manifest_bytes).hex(),
            },
            "summary": json.loads(_template()["files"][mf.marker_key(sid)])["summary"],
        }
    ).encode()


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _set(doc: Any, path: tuple[Any, ...], value: Any, delete: bool) -> Any:
    if not path:
        return value
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    if delete and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc


def _int_array(values: list[int]) -> str:
    return base64.b64encode(np.array(values, "<i8").tobytes()).decode()


def _manifest_doc() -> tuple[dict[str, Any], bytes]:
    """The template's manifest as its header document and its body of tables."""
    t = _template()
    doc, body = encoding.unpack(t["files"][mf.manifest_key(t["id"])])
    return doc, bytes(body)


def _pack_hostile(doc: Any, body: bytes) -> bytes:
    """A format-3 container around any JSON a reader might meet (NaN, a non-object, a header
    that leaves the body unaligned), written without trainsnap's writer, which refuses those."""
    header = json.dumps(doc).encode()
    return encoding.MAGIC + struct.pack("<Q", len(header)) + header + body


def _column(ref: dict[str, int], body: bytes) -> bytes:
    return body[ref["offset"] : ref["offset"] + ref["length"]]


hostile_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(-3, 40),
    st.floats(allow_nan=False),
    st.sampled_from(
        ["../../outside", "/etc/passwd", "objects/../../x", "step-000000000003-aaaa", "", "zz"]
    ),
    st.text(max_size=20),
    st.lists(st.integers(-2, 40), max_size=6).map(_int_array),
    st.lists(st.integers(-2, 5), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    # format 3's references into the body: past its end, overlapping, misaligned, negative
    st.fixed_dictionaries({"offset": st.integers(-8, 3000), "length": st.integers(-8, 3000)}),
)


def _outcomes(root: Path, sid: str) -> None:
    storage = SpyStorage(root)
    dst = {
        "w": torch.zeros(20, 30),
        "b": torch.zeros(7, dtype=torch.bfloat16),
        "cfg": {"lr": 0.0, "names": None},
    }
    with contextlib.suppress(ts.TrainsnapError):
        ts.load(dst, storage, snapshot=sid)
    try:
        ts.list_snapshots(storage)
        ts.verify(storage)
    except ts.TrainsnapError:
        pass


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), reseal=st.booleans())
def test_mutated_manifests_only_raise_trainsnap_errors(data, reseal):
    sid = _template()["id"]
    doc, body = _manifest_doc()
    path = data.draw(st.sampled_from(_paths(doc)))
    value = data.draw(hostile_values)
    doc = _set(copy.deepcopy(doc), path, value, delete=data.draw(st.booleans()))
    raw = _pack_hostile(doc, body)
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "root"
        outside = Path(d) / "outside"
        outside.mkdir()
        (outside / "sentinel").write_text("keep")
        _materialise(root, raw, _reseal(raw, sid) if reseal else None)
        _outcomes(root, sid)
        assert (outside / "sentinel").read_text() == "keep"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), reseal=st.booleans())
def test_damaged_manifest_bodies_only_raise_trainsnap_errors(data, reseal):
    sid = _template()["id"]
    doc, body = _manifest_doc()
    damaged = bytearray(body)
    for _ in range(data.draw(st.integers(1, 4))):
        damaged[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(body)))
    raw = encoding.pack(doc, bytes(damaged[:cut] if data.draw(st.booleans()) else damaged))
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "root"
        _materialise(root, raw, _reseal(raw, sid) if reseal else None)
        _outcomes(root, sid)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_markers_only_raise_trainsnap_errors(data):
    t = _template()
    sid = t["id"]
    doc = json.loads(t["files"][mf.marker_key(sid)])
    path = data.draw(st.sampled_from(_paths(doc)))
    doc = _set(copy.deepcopy(doc), path, data.draw(hostile_values), data.draw(st.booleans()))
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "root"
        _materialise(root, None, json.dumps(doc).encode())
        _outcomes(root, sid)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=200))
def test_garbage_bytes_are_corrupt_not_crashes(data):
    with pytest.raises(ts.TrainsnapError):
        encoding.decode(data, snapshot_id="step-000000000001-abcd")
    with pytest.raises(ts.TrainsnapError):
        marker.decode_marker(data, "step-000000000001-abcd")
    with pytest.raises(ts.TrainsnapError):  # a format-3 header that is garbage
        encoding.decode(encoding.MAGIC + data, snapshot_id="step-000000000001-abcd")


def test_a_manifest_whose_container_contradicts_its_version_is_corrupt():
    doc, body = _manifest_doc()
    with pytest.raises(ts.CorruptError, match="claims format version 4 but is JSON"):
        encoding.decode(json.dumps(doc).encode())
    doc["format_version"] = 2
    with pytest.raises(ts.CorruptError, match="claims format version 2 but is binary"):
        encoding.decode(encoding.pack(doc, body))


def test_a_table_reference_past_the_body_is_corrupt_and_named():
    doc, body = _manifest_doc()
    doc["shards"]["geo"] = {"offset": len(body) - 8, "length": 64}
    with pytest.raises(ts.CorruptError, match=r"shards\.geo.*run past the end"):
        encoding.decode(encoding.pack(doc, body))


def test_an_unknown_format_version_is_incompatible_and_says_upgrade():
    doc, body = _manifest_doc()
    doc["format_version"] = 99
    with pytest.raises(ts.IncompatibleError, match="Upgrade trainsnap"):
        encoding.decode(encoding.pack(doc, body))
    with pytest.raises(ts.IncompatibleError, match="Upgrade trainsnap"):
        encoding.decode(json.dumps(doc).encode())


def _as_json(doc: Any, body: bytes) -> Any:
    """A format-3 header with its tables inlined in base64, as formats 1 and 2 hold them."""
    if isinstance(doc, dict) and set(doc) == {"offset", "length"}:
        return base64.b64encode(_column(doc, body)).decode()
    if isinstance(doc, dict):
        return {k: _as_json(v, body) for k, v in doc.items()}
    return doc


def test_a_format_2_manifest_still_reads_as_the_same_manifest(tmp_path):
    sid = _template()["id"]
    doc, body = _manifest_doc()
    v2 = _as_json(doc, body)
    v2["format_version"] = 2
    raw = json.dumps(v2).encode()
    _materialise(tmp_path, raw, _reseal(raw, sid, version=2), version=2)
    assert (tmp_path / mf.manifest_key(sid, 2)).name == "manifest.json"
    m = commit.open_snapshot(ts.open_storage(tmp_path), sid)
    assert m.format_version == 2 and m.tree is None  # format 2 has no saved structure
    current = encoding.decode(encoding.pack(doc, body))
    assert current.tree is not None
    current.tree = None
    assert encoding.encode(m) == encoding.encode(current)
    dst = {"w": torch.zeros(20, 30)}
    ts.load(dst, tmp_path, snapshot=sid)
    assert dst["w"].reshape(-1).tolist() == list(range(600))


def test_a_round_trip_of_the_encoding_is_exact():
    t = _template()
    raw = t["files"][mf.manifest_key(t["id"])]
    m = encoding.decode(raw)
    assert encoding.encode(m) == raw


def test_crafted_object_names_cannot_leave_the_root(tmp_path):
    sid = _template()["id"]
    doc, body = _manifest_doc()
    doc = _as_json(doc, body)
    # Formats 2 and 3 store names as raw digest bytes, so no name can spell a path; format 1
    # (still read) stored strings: a crafted one must be refused.
    objs = doc["objects"]
    names = base64.b64decode(objs["names"]).hex()
    doc["format_version"] = 1
    doc["objects"] = {
        "names": ["../" * 6 + "etc/passwd"]
        + [names[i : i + 32] for i in range(32, len(names), 32)],
        "sizes": objs["sizes"],
        "codecs": ["raw"] * (len(names) // 32),
        "blocks": objs["blocks"],
    }
    tens = doc["tensors"]
    ndim = np.frombuffer(base64.b64decode(tens.pop("ndim")), "<i8").tolist()
    dims = np.frombuffer(base64.b64decode(tens.pop("dims")), "<i8").tolist()
    tens["shapes"] = [dims[sum(ndim[:i]) : sum(ndim[: i + 1])] for i in range(len(ndim))]
    raw = json.dumps(doc).encode()
    _materialise(tmp_path, raw, _reseal(raw, sid, version=1), version=1)
    with pytest.raises(ts.CorruptError, match="hex"):
        ts.load({"w": torch.zeros(20, 30)}, SpyStorage(tmp_path), snapshot=sid)


def test_golden_template_is_usable(tmp_path):
    sid = _materialise(tmp_path, None, None)
    dst = {"w": torch.zeros(20, 30)}
    ts.load(dst, tmp_path, snapshot=sid)
    assert dst["w"].reshape(-1).tolist() == list(range(600))
    shutil.rmtree(tmp_path / "objects")
    with pytest.raises(ts.CorruptError, match="missing"):
        ts.load(dst, tmp_path, snapshot=sid)
