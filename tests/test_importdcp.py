"""Importing torch.distributed.checkpoint directories: a 2-rank DCP of uneven DTensor shards
becomes a snapshot that verifies and loads bitwise on 1 process and on a 4-rank mesh; items
are read by range, odd layouts and non-plain values are handled, refusals name the fix."""

from __future__ import annotations

import logging
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from typer.testing import CliRunner

import trainsnap as ts
from trainsnap.protocol import commit
from trainsnap.testing import assert_all_ok, run_ranks
from trainsnap.tools.cli import app
from trainsnap.tools.export import export_safetensors
from trainsnap.tools.import_dcp import import_dcp

SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "model.emb": ((11, 6), torch.float32),
    "model.proj": ((7, 9), torch.bfloat16),
    "model.norm": ((5,), torch.float32),
    "optim.exp_avg": ((13, 4), torch.float32),
}


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    return {k: torch.randn(shape, generator=g).to(dt) for k, (shape, dt) in SHAPES.items()}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, v in flat.items():
        top, rest = key.split(".", 1)
        out.setdefault(top, {})[rest] = v
    return out


def dtensors(placements: dict[str, list[Any]], mesh: Any, blank: bool) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    ref = reference()
    return {
        k: distribute_tensor(torch.zeros_like(ref[k]) if blank else ref[k], mesh, placements[k])
        for k in ref
    }


# -- 2 ranks save with dcp, 4 ranks load with trainsnap ------------------------------------------


def dcp_save_rank(rank: int, world: int, path: str) -> None:
    """1-D mesh of 2: uneven row shards (6 + 5), uneven column shards (5 + 4), a replica."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    placements = {
        "model.emb": [Shard(0)],
        "model.proj": [Shard(1)],
        "model.norm": [Replicate()],
        "optim.exp_avg": [Shard(0)],
    }
    state = nest(dtensors(placements, mesh, blank=False))
    state["train"] = {"step": 41, "lr": 0.5, "name": "run-a"}
    dcp.save(state, checkpoint_id=path)


def ts_load_rank(rank: int, world: int, root: str) -> int:
    """2 x 2 mesh, other placements than saved: each rank checks its local shard bitwise."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    placements = {
        "model.emb": [Shard(0), Shard(1)],
        "model.proj": [Replicate(), Shard(0)],
        "model.norm": [Shard(0), Replicate()],
        "optim.exp_avg": [Shard(1), Shard(0)],
    }
    flat = dtensors(placements, mesh, blank=True)
    state = nest(flat)
    state["train"] = {"step": None}
    ts.load(state, root, timeout=60)
    assert state["train"]["step"] == 41
    ref, n = reference(), 0
    for key, dt in flat.items():
        sizes, offsets = compute_local_shape_and_global_offset(dt.shape, mesh, dt.placements)
        want = ref[key][tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
        assert torch.equal(bits(dt.to_local()), bits(want)), f"{key} on rank {rank}"
        n += want.numel()
    return n


def _make_dcp_checkpoint(path: Path) -> None:
    """The input of the import: a 2-rank ``dcp.save``. Rarely, a rank of torch's own save aborts
    in C++ ("terminate called without an active exception", SIGABRT, before returning); that
    is not what these tests check, so such a fixture is made again, once, in a fresh place."""
    results = run_ranks(dcp_save_rank, 2, args=(str(path),), timeout=120)
    if any(r.exitcode == -signal.SIGABRT for r in results):
        shutil.rmtree(path, ignore_errors=True)
        results = run_ranks(dcp_save_rank, 2, args=(str(path),), timeout=120)
    assert_all_ok(results)


def test_two_rank_dcp_imports_and_loads_on_one_and_four_ranks(tmp_path: Path) -> None:
    path, root = tmp_path / "dcp", tmp_path / "root"
    _make_dcp_checkpoint(path)
    info = import_dcp(path, root, step=41)
    assert info.step == 41 and info.id.startswith("step-000000000041-")
    assert ts.verify(root).ok

    m = commit.open_snapshot(ts.open_storage(root), info.id)
    shards = {k: len(m.tensor_shards(t)) for t, k in enumerate(m.tensor_keys)}
    assert shards == {"model.emb": 2, "model.proj": 2, "model.norm": 1, "optim.exp_avg": 2}
    assert sorted(m.value_keys) == ["train.lr", "train.name", "train.step"]
    assert m.topology["world_size"] == 2 and m.state_kinds["model"] and m.state_kinds["optimizer"]

    # One process, plain full tensors.
    ref = reference()
    dst = nest({k: torch.zeros_like(v) for k, v in ref.items()})
    dst["train"] = {"step": None, "lr": None, "name": None}
    ts.load(dst, root)
    for key, want in ref.items():
        top, rest = key.split(".", 1)
        assert torch.equal(bits(dst[top][rest]), bits(want)), key
    assert dst["train"] == {"step": 41, "lr": 0.5, "name": "run-a"}

    # Four ranks, DTensors on a 2 x 2 mesh.
    counts = assert_all_ok(run_ranks(ts_load_rank, 4, args=(str(root),), timeout=120))
    assert all(c > 0 for c in counts)

    # Box shards stream out through flat pieces too.
    out = export_safetensors(root, info.id, tmp_path / "hf", piece_bytes=40)
    got = load_file(str(out))
    assert sorted(got) == ["emb", "norm", "proj"]
    for name, t in got.items():
        assert torch.equal(bits(t), bits(ref[f"model.{name}"])), name


# -- one process: layouts, values, refusals -------------------------------------------------------


class Opaque:
    """Not plain data: DCP pickles it, import must not unpickle it."""

    def __init__(self) -> None:
        self.x = 1


def test_odd_layouts_values_and_skipped_entries(tmp_path: Path, caplog) -> None:
    g = torch.Generator().manual_seed(5)
    base = torch.randn(3, 4, generator=g)
    state = {
        "w": base.t(),  # stored by DCP with its transposed strides
        "big": torch.randn(70_000, generator=g),  # several objects of its own
        "empty": torch.zeros(0, 3),
        "cfg": {"layers": [1, 2], "tied": True},
        "opaque": Opaque(),
    }
    with pytest.warns(UserWarning):  # no process group: dcp says it saves as one process
        dcp.save(state, checkpoint_id=tmp_path / "dcp")
    with caplog.at_level(logging.WARNING, logger="trainsnap"):
        info = import_dcp(tmp_path / "dcp", tmp_path / "root")
    assert "opaque" in caplog.text and "skips 1" in caplog.text
    assert ts.verify(tmp_path / "root").ok
    dst = {"w": torch.empty(4, 3), "big": torch.empty(70_000), "empty": torch.ones(0, 3)}
    dst["cfg"] = {"layers": None, "tied": None}
    ts.load(dst, tmp_path / "root", snapshot=info.id)
    assert torch.equal(dst["w"], base.t()) and torch.equal(dst["big"], state["big"])
    assert dst["cfg"] == {"layers": [1, 2], "tied": True}
    m = commit.open_snapshot(ts.open_storage(tmp_path / "root"), info.id)
    assert "opaque" not in m.value_keys and m.step == 0


def test_reads_only_the_items_not_whole_files(tmp_path: Path, monkeypatch) -> None:
    import trainsnap.tools.import_dcp as imp

    state = {"a": torch.randn(200_000), "b": torch.randn(10)}
    with pytest.warns(UserWarning):
        dcp.save(state, checkpoint_id=tmp_path / "dcp")
    largest = 0
    real = imp._pread_into

    def spy(fd: int, out: memoryview, pos: int) -> int:
        nonlocal largest
        largest = max(largest, len(out))
        return real(fd, out, pos)

    monkeypatch.setattr(imp, "_pread_into", spy)
    small = ts.tunables.Tunables(block_size=64 << 10, chunk_size=256 << 10, pack_threshold=4096)
    ts.tunables.set_for_testing(small)
    import_dcp(tmp_path / "dcp", tmp_path / "root")
    assert largest <= 256 << 10  # one object's worth, not the 800 KB file
    dst = {"a": torch.empty(200_000), "b": torch.empty(10)}
    ts.load(dst, tmp_path / "root")
    assert torch.equal(dst["a"], state["a"]) and torch.equal(dst["b"], state["b"])


def test_refusals_name_the_directory_and_fix(tmp_path: Path) -> None:
    with pytest.raises(ts.NotFoundError, match=r"not a torch.distributed.checkpoint directory"):
        import_dcp(tmp_path, tmp_path / "root")
    with pytest.warns(UserWarning):
        dcp.save({"a": torch.ones(3)}, checkpoint_id=tmp_path / "dcp")
    with pytest.raises(ts.InvalidArgumentError, match="step"):
        import_dcp(tmp_path / "dcp", tmp_path / "root", step=-1)
    (data,) = (tmp_path / "dcp").glob("*.distcp")
    data.write_bytes(data.read_bytes()[:-40])
    with pytest.raises(ts.CorruptError, match=r"DCP item 'a' .* damaged .* dcp.save"):
        import_dcp(tmp_path / "dcp", tmp_path / "root")
    data.unlink()
    with pytest.raises(ts.NotFoundError, match="lacks its data file"):
        import_dcp(tmp_path / "dcp", tmp_path / "root")
    assert not (tmp_path / "root" / "snapshots").exists()


def test_cli_import_dcp(tmp_path: Path) -> None:
    with pytest.warns(UserWarning):
        dcp.save({"model": {"w": torch.ones(2, 2)}, "step": 3}, checkpoint_id=tmp_path / "dcp")
    res = CliRunner().invoke(
        app, ["import-dcp", str(tmp_path / "dcp"), str(tmp_path / "root"), "--step", "3"]
    )
    assert res.exit_code == 0, res.output
    assert (
        "as snapshot step-000000000003-" in res.stdout and "1 tensor(s), 1 value(s)" in res.stdout
    )
    res = CliRunner().invoke(app, ["import-dcp", str(tmp_path / "nope"), str(tmp_path / "root")])
    assert res.exit_code == 2 and "not a torch.distributed.checkpoint directory" in res.stderr


# -- the .metadata is read, never unpickled (issue: no code from a checkpoint) ------------------


def _no_unpickling(*_args: Any, **_kwargs: Any) -> Any:
    raise AssertionError("the DCP checkpoint was unpickled")


def test_import_reads_the_metadata_without_unpickling_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real DCP checkpoint of this torch imports exactly with pickle's loaders disabled."""
    import pickle

    src, tensors = tmp_path / "dcp", reference()
    dcp.save({**tensors, "step": 7, "cfg": {"lr": 0.5}}, checkpoint_id=str(src), no_dist=True)
    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, _no_unpickling)
    info = import_dcp(src, tmp_path / "root")
    monkeypatch.undo()
    got = ts.read(tmp_path / "root", info.id)
    for key, tensor in tensors.items():
        assert torch.equal(bits(got[key]), bits(tensor)), key
    assert got["step"] == 7


def _metadata_with(tmp_path: Path, edit: Any) -> Path:
    """A DCP directory whose .metadata is the pickle of a real one after ``edit``."""
    import pickle

    src = tmp_path / "dcp"
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(src), no_dist=True)
    metadata = pickle.loads((src / ".metadata").read_bytes())
    (src / ".metadata").write_bytes(pickle.dumps(edit(metadata), protocol=2))
    return src


def _build_on_a_class() -> bytes:
    """A pickle that BUILDs a dict onto the MetadataIndex *class* (an allow-listed name): an
    allow-list unpickler sets the attribute on the class for the whole process."""
    return (
        b"\x80\x04c" + b"torch.distributed.checkpoint.metadata\nMetadataIndex\n"
        b"}\x8c\x0bhacked_attr\x94K\x01sb."
    )


def test_a_build_on_an_allow_listed_class_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    src = tmp_path / "dcp"
    src.mkdir()
    (src / ".metadata").write_bytes(_build_on_a_class())
    with pytest.raises(ts.IncompatibleError, match="BUILD on a class"):
        import_dcp(src, tmp_path / "root")
    assert not hasattr(MetadataIndex, "hacked_attr")


@pytest.mark.parametrize(
    ("edit", "what"),
    [
        (lambda m: setattr(m, "storage_data", ["not", "a", "dict"]) or m, "storage_data"),
        (lambda m: setattr(m, "state_dict_metadata", {"w": 3}) or m, "entry 'w'"),
        (lambda m: [m, m], "not DCP Metadata"),
    ],
)
def test_malformed_dcp_metadata_is_a_trainsnap_error(tmp_path: Path, edit: Any, what: str) -> None:
    """Metadata of the wrong shape was a raw AttributeError deep in the import."""
    src = _metadata_with(tmp_path, edit)
    with pytest.raises(ts.TrainsnapError, match=what):
        import_dcp(src, tmp_path / "root")


def test_an_item_range_past_its_file_is_refused_before_allocation(tmp_path: Path) -> None:
    """A value item claiming 2^40 bytes was allocated before it was read."""

    def huge(m: Any) -> Any:
        for index, info in m.storage_data.items():
            if index.fqn == "n":
                info.length = 1 << 40
        return m

    import pickle

    src = tmp_path / "dcp"
    dcp.save({"w": torch.ones(3), "n": 5}, checkpoint_id=str(src), no_dist=True)
    metadata = huge(pickle.loads((src / ".metadata").read_bytes()))
    (src / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ts.CorruptError, match="runs past the end"):
        import_dcp(src, tmp_path / "root")


def test_metadata_lacking_a_required_field_is_refused_not_a_type_error() -> None:
    """Found by the fuzz suite's long form: a Metadata record whose state misnames its one
    required field reached the dataclass constructor (a raw TypeError)."""
    import pickle

    from trainsnap.integrations.dcp_metadata import decode_metadata

    data = pickle.dumps(dcp.metadata.Metadata(state_dict_metadata={}), protocol=4)
    damaged = data.replace(b"state_dict_metadata", b"rtate_dict_metadata")
    with pytest.raises(ts.IncompatibleError, match="without the fields"):
        decode_metadata(damaged)
