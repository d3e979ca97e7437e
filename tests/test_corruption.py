"""Damage after commit is found by verification (naming the snapshot and the object) and
refused by load with the matching error kind."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import trainsnap as ts
from trainsnap.format import encoding
from trainsnap.format import manifest as mf
from trainsnap.tools.cli import app


def _state() -> dict[str, object]:
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(512, 512, generator=g), "b": torch.randn(10, generator=g), "n": 3}


def _blank() -> dict[str, object]:
    return {"w": torch.zeros(512, 512), "b": torch.zeros(10), "n": None}


def _objects(root: Path) -> list[Path]:
    return sorted(p for p in (root / "objects").rglob("*") if p.is_file())


def _largest_object(root: Path) -> Path:
    return max(_objects(root), key=lambda p: p.stat().st_size)


def flip_byte(root: Path, sid: str) -> str:
    p = _largest_object(root)
    data = bytearray(p.read_bytes())
    data[len(data) // 3] ^= 0x01
    p.write_bytes(bytes(data))
    return p.name


def truncate(root: Path, sid: str) -> str:
    p = _largest_object(root)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 100])
    return p.name


def remove_object(root: Path, sid: str) -> str:
    p = _largest_object(root)
    p.unlink()
    return p.name


def edit_manifest(root: Path, sid: str) -> str:
    p = root / mf.manifest_key(sid)
    doc, body = encoding.unpack(p.read_bytes())
    doc["step"] = doc["step"] + 1  # same size class, different bytes
    p.write_bytes(encoding.pack(doc, bytes(body)))
    return "manifest"


def edit_manifest_same_size(root: Path, sid: str) -> str:
    p = root / mf.manifest_key(sid)
    raw = p.read_bytes()
    p.write_bytes(raw.replace(b'"level":"strict"', b'"level":"strick"'))
    return "manifest"


def remove_marker(root: Path, sid: str) -> str:
    (root / mf.marker_key(sid)).unlink()
    return "marker"


DAMAGE: dict[str, tuple[Callable[[Path, str], str], type[ts.TrainsnapError]]] = {
    "flipped byte": (flip_byte, ts.CorruptError),
    "truncated object": (truncate, ts.CorruptError),
    "missing object": (remove_object, ts.CorruptError),
    "manifest edited": (edit_manifest, ts.CorruptError),
    "manifest edited, same size": (edit_manifest_same_size, ts.CorruptError),
    "missing marker": (remove_marker, ts.IncompleteError),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_is_reported_by_verify_and_refused_by_load(tmp_path, damage):
    fn, kind = DAMAGE[damage]
    info = ts.save(_state(), tmp_path, step=5)
    assert ts.verify(tmp_path).ok
    what = fn(tmp_path, info.id)

    dst = _blank()
    with pytest.raises(kind) as e:
        ts.load(dst, tmp_path, snapshot=info.id)
    assert e.value.snapshot_id == info.id
    if damage in ("flipped byte", "truncated object", "missing object"):
        assert what in str(e.value)

    runner = CliRunner()
    result = runner.invoke(app, ["verify", str(tmp_path), info.id])
    assert result.exit_code != 0
    out = result.output
    assert info.id in out
    if what not in ("manifest", "marker"):
        assert what in out

    with pytest.raises(kind) as e:
        ts.verify(tmp_path, info.id)
    assert e.value.snapshot_id == info.id


def test_missing_marker_hides_the_snapshot_and_latest_falls_to_the_previous(tmp_path):
    old = ts.save(_state(), tmp_path, step=1)
    new = ts.save(_state(), tmp_path, step=2)
    remove_marker(tmp_path, new.id)
    assert [s.id for s in ts.list_snapshots(tmp_path)] == [old.id]
    assert ts.load(_blank(), tmp_path).id == old.id
    report = ts.verify(tmp_path)
    assert report.ok and report.uncommitted == [new.id]


def test_verify_lists_every_problem_not_just_the_first(tmp_path):
    info = ts.save(_state(), tmp_path, step=5)
    objs = _objects(tmp_path)
    assert len(objs) >= 2
    objs[0].unlink()
    data = bytearray(objs[1].read_bytes())
    data[0] ^= 0xFF
    objs[1].write_bytes(bytes(data))
    with pytest.raises(ts.CorruptError) as e:
        ts.verify(tmp_path)
    assert len(e.value.problems) == 2
    text = str(e.value)
    assert objs[0].name in text and objs[1].name in text and info.id in text
