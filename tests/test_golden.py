"""Golden snapshots of every format version, kept forever: each must still load and verify."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch

import trainsnap as ts
from trainsnap.format import encoding
from trainsnap.protocol import commit

GOLDEN = Path(__file__).parent / "golden"


def test_format_v1_golden_loads_bitwise_and_verifies(tmp_path):
    root = tmp_path / "v1"
    shutil.copytree(GOLDEN / "v1", root)  # never write into the checked-in copy
    (info,) = ts.list_snapshots(root)
    assert info.step == 42 and info.tokens_seen == 1000 and info.level == "strict"
    state = {
        "model": {"w": torch.zeros(20, 30), "b": torch.zeros(7, dtype=torch.bfloat16)},
        "flag": torch.zeros(3, dtype=torch.bool),
        "extra": {"lr": None, "betas": None, "name": None, "nan": None},
    }
    ts.load(state, root)
    assert torch.equal(state["model"]["w"], torch.arange(600, dtype=torch.float32).reshape(20, 30))
    assert torch.equal(state["model"]["b"], torch.arange(7, dtype=torch.bfloat16))
    assert state["flag"].tolist() == [True, False, True]
    extra = state["extra"]
    assert extra["lr"] == 0.001 and extra["betas"] == (0.9, 0.95) and extra["name"] == "golden"
    assert math.isnan(extra["nan"])
    report = ts.verify(root)
    assert report.ok and report.snapshots[0].objects == 4


def _load_compressed_golden(root: Path, version: int) -> dict:
    """Load the state of the golden snapshots of formats 2 and 3 (the same state, stored with
    every object codec), check it bitwise and verify the root."""
    (info,) = ts.list_snapshots(root)
    assert info.step == 42 and info.tokens_seen == 1000
    m = commit.open_snapshot(ts.open_storage(root), info.id)
    assert m.format_version == version
    assert {"bg4+zstd", "bg2+zstd", "zstd", "raw"} <= set(m.object_codecs)
    state = {
        "model": {"w": torch.zeros(20, 30), "b": torch.zeros(7, dtype=torch.bfloat16)},
        "optim": {"m": torch.zeros(300)},
        "flag": torch.zeros(3, dtype=torch.bool),
        "extra": {"lr": None, "betas": None, "name": None, "nan": None},
    }
    ts.load(state, root)
    assert torch.equal(state["model"]["w"], torch.arange(600, dtype=torch.float32).reshape(20, 30))
    assert torch.equal(state["model"]["b"], torch.arange(7, dtype=torch.bfloat16))
    assert torch.equal(state["optim"]["m"], torch.linspace(0, 1, 300, dtype=torch.float32))
    assert state["flag"].tolist() == [True, False, True] and state["extra"]["name"] == "golden"
    assert state["extra"]["betas"] == (0.9, 0.95) and math.isnan(state["extra"]["nan"])
    assert ts.verify(root).ok
    return {"id": info.id, "manifest": m}


def test_format_v2_golden_with_compressed_objects_loads_bitwise_and_verifies(tmp_path):
    root = tmp_path / "v2"
    shutil.copytree(GOLDEN / "v2", root)
    got = _load_compressed_golden(root, 2)
    assert (root / "snapshots" / got["id"] / "manifest.json").exists()


def test_format_v3_golden_binary_manifest_loads_bitwise_and_verifies(tmp_path):
    root = tmp_path / "v3"
    shutil.copytree(GOLDEN / "v3", root)
    got = _load_compressed_golden(root, 3)
    raw = (root / "snapshots" / got["id"] / "manifest.bin").read_bytes()
    assert raw.startswith(encoding.MAGIC)
    assert got["manifest"].versions["user"] == {"model": "golden-3"}


def test_format_v4_golden_reads_back_its_tree_exactly_and_verifies(tmp_path):
    import collections
    import pathlib

    import numpy as np

    root = tmp_path / "v4"
    shutil.copytree(GOLDEN / "v4", root)
    (info,) = ts.list_snapshots(root)
    m = commit.open_snapshot(ts.open_storage(root), info.id)
    assert m.format_version == 4 and m.tree is not None and info.step == 42
    assert {"zstd", "bg4+zstd", "raw"} <= set(m.object_codecs)
    tree = ts.read(root)
    assert list(tree) == ["model", "optim", "flag", "pair", "extra"]
    model = tree["model"]
    assert type(model) is collections.OrderedDict and list(model) == ["w", "b"]
    assert torch.equal(model["w"], torch.arange(600, dtype=torch.float32).reshape(20, 30))
    assert torch.equal(model["b"], torch.arange(7, dtype=torch.bfloat16))
    moments = tree["optim"]["state"][0]  # an int key, as saved
    assert torch.equal(moments["m"], torch.linspace(0, 1, 300, dtype=torch.float32))
    assert tree["optim"]["param_groups"] == [{"lr": 0.001, "betas": (0.9, 0.95), "params": [0]}]
    assert tree["flag"].tolist() == [True, False, True]
    assert type(tree["pair"]) is tuple and tree["pair"][1] == "second"
    extra = tree["extra"]
    assert extra["empty"] == {} and extra["nothing"] is None and extra["no_list"] == []
    assert extra["path"] == pathlib.PurePosixPath("data/shard-0") and extra["tags"] == {"a", "b"}
    assert extra["np"].dtype == np.int16 and extra["np"].tolist() == [0, 1, 2]
    assert math.isnan(extra["nan"]) and extra["when"].year == 2026
    state = {"optim": {"state": {}}, "extra": None}  # placeholders, filled from the tree
    ts.load(state, root)
    assert torch.equal(state["optim"]["state"][0]["m"], moments["m"])
    assert state["extra"]["path"] == extra["path"]
    assert ts.verify(root).ok
