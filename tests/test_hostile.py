"""Hostile roots: a crafted manifest, marker or object can neither crash, exhaust, escape nor
execute. Each test is one attack found by hand; every entry point must answer it with a
TrainsnapError kind (the CLI: one line, no traceback) and touch nothing outside the root."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final
from unittest import mock

import numpy as np
import pytest
import torch

import trainsnap as ts
from trainsnap.format import encoding, validation
from trainsnap.format.manifest import Manifest, object_key
from trainsnap.manager import collection
from trainsnap.protocol import commit
from trainsnap.storage import PosixStorage, open_storage

BIG = 2**63 - 1


def _state() -> dict:
    return {
        "w": torch.arange(600, dtype=torch.float32).reshape(20, 30),
        "b": torch.ones(7, dtype=torch.bfloat16),
        "c": torch.arange(5, dtype=torch.int64),
        "cfg": {"lr": 0.5, "names": ["a", "b"]},
    }


def _destination() -> dict:
    return {
        "w": torch.zeros(20, 30),
        "b": torch.zeros(7, dtype=torch.bfloat16),
        "c": torch.zeros(5, dtype=torch.int64),
        "cfg": {"lr": 0.0, "names": None},
    }


def _hostile_root(root: Path, mutate: Callable[[Manifest], None]) -> str:
    """A root whose one snapshot's manifest was changed by ``mutate`` and committed again with a
    marker that matches it, so that only validation stands between it and the readers."""
    sid = ts.save(_state(), root, step=3).id
    storage = open_storage(root)
    manifest = commit.open_snapshot(storage, sid)
    mutate(manifest)
    storage.delete(f"snapshots/{sid}/COMMITTED")
    commit.write_commit(storage, manifest, writer={})
    return sid


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "trainsnap.tools.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _every_reader_refuses(root: Path, sid: str) -> None:
    """ts.load, ts.verify and the CLI answer with TrainsnapError kinds, never a crash (the CLI
    in processes of its own: see _run_tools)."""
    with pytest.raises(ts.TrainsnapError):
        ts.load(_destination(), root, snapshot=sid)
    with pytest.raises(ts.TrainsnapError):
        ts.verify(root)
    tools = ("verify", "show", "gc --dry-run")
    jobs = [{"attack": None, "tool": tool, "root": str(root), "snapshot": sid} for tool in tools]
    answers = _run_tools(jobs)
    assert [_verdict(answer) for answer in answers] == ["error", "error", "error"]


def _set_column(name: str, values: list[int]) -> Callable[[Manifest], None]:
    def mutate(manifest: Manifest) -> None:
        setattr(manifest, name, np.array(values, np.int64))
        manifest._derived.clear()

    return mutate


def test_shard_counts_that_wrap_in_int64_are_corrupt_not_a_segfault(tmp_path: Path) -> None:
    """Finding 1: nshards [2^63-1, 2^63-1, 4] summed in int64 to the shards present, and
    np.repeat wrote past its buffer (SIGSEGV in show, verify, gc --dry-run and load)."""
    sid = _hostile_root(tmp_path, _set_column("tensor_nshards", [BIG, BIG, 5]))  # sums to 3
    _every_reader_refuses(tmp_path, sid)


def _wrapping_chunks(manifest: Manifest) -> None:
    """Tensor b's one chunk of 14 bytes becomes four at offset 2^62 of lengths 2^62 + 4, 4, 3, 3:
    each offset + length wraps negative (so "inside its object") and the lengths sum, wrapped,
    to the 14 bytes the shard needs."""
    shard = manifest.tensor_keys.index("b")  # one shard per tensor here
    first = int(manifest.chunk_start()[shard])
    obj = int(manifest.chunk_object[first])
    rows = [(obj, 2**62, 2**62 + n) for n in (4, 4, 3, 3)]
    names = ("chunk_object", "chunk_offset", "chunk_length")
    for name, column in zip(names, zip(*rows, strict=True), strict=True):
        old = getattr(manifest, name)
        setattr(manifest, name, np.concatenate([old[:first], column, old[first + 1 :]]))
    manifest.shard_nchunks[shard] = 4
    manifest._derived.clear()


def test_chunk_bounds_that_wrap_are_corrupt(tmp_path: Path) -> None:
    """Finding 2: chunks at offset 2^62 with lengths near 2^62 wrapped offset+length and
    passed; verify said "all ok"."""
    sid = _hostile_root(tmp_path, _wrapping_chunks)
    _every_reader_refuses(tmp_path, sid)


def _value_chunk_of_2_63_bytes(manifest: Manifest) -> None:
    last = len(manifest.chunk_length) - 1  # values come after the shards' chunks
    manifest.chunk_offset[last], manifest.chunk_length[last] = 1, BIG


def test_a_value_chunk_of_2_63_bytes_is_corrupt_not_a_memory_error(tmp_path: Path) -> None:
    sid = _hostile_root(tmp_path, _value_chunk_of_2_63_bytes)
    _every_reader_refuses(tmp_path, sid)


def _wrapping_chunk_counts(manifest: Manifest) -> None:
    counts = manifest.shard_nchunks  # BIG + BIG wraps to -2: the total stays right
    counts[:] = [BIG, BIG, int(counts.sum()) + 2]
    manifest._derived.clear()


def test_wrapped_chunk_counts_are_corrupt_not_an_index_error(tmp_path: Path) -> None:
    sid = _hostile_root(tmp_path, _wrapping_chunk_counts)
    _every_reader_refuses(tmp_path, sid)


def _million_dimensions(manifest: Manifest) -> None:
    manifest.tensor_shapes[0] = (1,) * 1_000_000


def test_a_tensor_of_a_million_dimensions_is_refused_before_any_allocation(
    tmp_path: Path,
) -> None:
    """Finding 8: validation built a tensors x max-rank matrix; one tensor with 10^6 dimensions
    would ask for gigabytes."""
    sid = _hostile_root(tmp_path, _million_dimensions)
    with pytest.raises(ts.CorruptError, match="dimensions"):
        commit.open_snapshot(open_storage(tmp_path), sid)


def _elements_beyond_2_58(manifest: Manifest) -> None:
    manifest.tensor_shapes[0] = (2**40, 2**40)


def test_a_tensor_larger_than_2_58_elements_is_corrupt(tmp_path: Path) -> None:
    sid = _hostile_root(tmp_path, _elements_beyond_2_58)
    with pytest.raises(ts.CorruptError, match="larger than"):
        commit.open_snapshot(open_storage(tmp_path), sid)


def test_the_validation_bounds_reject_every_wrapping_column() -> None:
    """The bounds check on its own: each column with a number that could wrap is named."""
    sid = "step-000000000003-0000aaaa"
    for column in ("object_sizes", "chunk_offset", "chunk_length", "tensor_nshards"):
        manifest = Manifest(
            snapshot_id=sid, created="", step=3, level="strict", algorithm="xxh3-128", block_size=64
        )
        setattr(manifest, column, np.array([BIG], np.int64))
        problems = validation.validate(manifest)
        assert problems and "outside" in problems[0], (column, problems)


# -- links, FIFOs and directories where objects should be ------------------------------------


def _outside(tmp_path: Path) -> Path:
    """A directory outside the root with canary files any escape would read, write or delete."""
    outside = tmp_path / "outside"
    (outside / "ab").mkdir(parents=True)
    for name in ("canary", "ab/" + "0" * 32):
        (outside / name).write_text("must survive")
    return outside


def _canaries(outside: Path) -> dict[str, str]:
    return {
        p.relative_to(outside).as_posix(): p.read_text() for p in outside.rglob("*") if p.is_file()
    }


def _an_object_of(root: Path, sid: str) -> Path:
    """The file of one object snapshot ``sid`` references (another snapshot may share the
    root)."""
    manifest = commit.open_snapshot(open_storage(root), sid)
    return root / object_key(manifest.object_names[0])


def _objects_directory_linked_out(root: Path) -> str:
    """ROOT/objects a link to a directory of canaries beside the root."""
    outside = _outside(root.parent)
    sid = ts.save(_state(), root, step=1).id
    real_objects = root / "objects"
    real_objects.rename(root.parent / "moved-objects")
    real_objects.symlink_to(outside, target_is_directory=True)
    return sid


def test_gc_never_deletes_through_a_symlinked_objects_directory(tmp_path: Path) -> None:
    """Finding 3: with ROOT/objects a link to another directory, gc deleted every unreferenced
    file under that directory."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    _objects_directory_linked_out(root)
    before = _canaries(outside)
    out = _cli("gc", str(root))
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    collection.collect(open_storage(root), grace=None)
    assert _canaries(outside) == before


def _object_linked_out(root: Path) -> str:
    """An object file replaced by a link to a copy of its bytes beside the root."""
    outside = _outside(root.parent)
    sid = ts.save(_state(), root, step=1).id
    victim = _an_object_of(root, sid)
    (outside / "copy").write_bytes(victim.read_bytes())  # the same bytes: only the link differs
    victim.unlink()
    victim.symlink_to(outside / "copy")
    return sid


def test_an_object_that_is_a_symlink_out_of_the_root_is_never_read(tmp_path: Path) -> None:
    """Finding 6: an object file linked to a file outside was read (verify printed the size of
    /etc/passwd) and loaded."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    sid = _object_linked_out(root)
    with pytest.raises(ts.CorruptError, match="not a regular file"):
        ts.load(_destination(), root, snapshot=sid)
    with pytest.raises(ts.CorruptError, match="not a regular file"):
        ts.verify(root)
    assert (outside / "copy").exists()


def _snapshot_directory_linked_out(root: Path) -> str:
    """The newer of two snapshots' directory moved beside the root, a link left in its place."""
    _, second = _two_snapshots(root)
    elsewhere = root.parent / "elsewhere"
    (root / "snapshots" / second).rename(elsewhere)
    (root / "snapshots" / second).symlink_to(elsewhere, target_is_directory=True)
    return second


def test_a_snapshot_directory_linked_out_of_the_root_is_not_listed(tmp_path: Path) -> None:
    root = tmp_path / "root"
    second = _snapshot_directory_linked_out(root)
    first = _other_snapshot(root, second)
    assert [s.id for s in ts.list_snapshots(root)] == [first]
    assert ts.load(_destination(), root).id == first
    with pytest.raises(ts.TrainsnapError):  # named explicitly, it is still not read
        ts.load(_destination(), root, snapshot=second)


def _planted_object_links(root: Path) -> str:
    """Links to a directory of canaries planted at each objects/<h2> a save of ``_state()``
    writes to (object names are predictable); the save is refused, so no snapshot is left."""
    outside = _outside(root.parent)
    probe = root.parent / "probe"
    ts.save(_state(), probe, step=1)
    for directory in (probe / "objects").iterdir():
        (root / "objects").mkdir(parents=True, exist_ok=True)
        (root / "objects" / directory.name).symlink_to(outside, target_is_directory=True)
    return "latest"


def test_a_planted_symlink_directory_cannot_make_a_save_write_outside(tmp_path: Path) -> None:
    """Object names are predictable: a link planted at objects/<h2> must not redirect writes."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    _planted_object_links(root)
    before = _canaries(outside)
    with pytest.raises((ts.TrainsnapError, OSError)):
        ts.save(_state(), root, step=1)
    assert _canaries(outside) == before
    assert ts.list_snapshots(root) == []


def _object_replaced_by(kind: str) -> Callable[[Path], str]:
    """A builder: an object file replaced by a FIFO (``"fifo"``) or a directory."""

    def build(root: Path) -> str:
        sid = ts.save(_state(), root, step=1).id
        victim = _an_object_of(root, sid)
        victim.unlink()
        if kind == "fifo":
            os.mkfifo(victim)
        else:
            victim.mkdir()
        return sid

    return build


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_fifo_or_directory_where_an_object_should_be_is_corrupt(
    tmp_path: Path, kind: str
) -> None:
    """Finding 12: a FIFO hung ts.load; a directory gave a raw IsADirectoryError."""
    sid = _object_replaced_by(kind)(tmp_path)
    with pytest.raises(ts.CorruptError):
        ts.load(_destination(), tmp_path, snapshot=sid)
    with pytest.raises(ts.CorruptError):
        ts.verify(tmp_path)


# -- decompression bombs ----------------------------------------------------------------------


def _zeros_frame(nbytes: int, declare: bool) -> bytes:
    """A zstd frame of ``nbytes`` zeros, a few KiB long, declaring its size or not."""
    import zstandard

    compressor = zstandard.ZstdCompressor().compressobj(size=nbytes if declare else -1)
    chunk = bytes(1 << 20)
    parts = [compressor.compress(chunk) for _ in range(nbytes >> 20)]
    return b"".join([*parts, compressor.flush()])


def test_a_frame_declaring_more_than_its_block_is_refused_before_decoding() -> None:
    """Finding 4: a 32 KiB frame declaring 1 GiB, stored as a 1 MiB block, was decompressed
    (1.29 GB peak) before the size check; the binding ignores max_output_size then."""
    from trainsnap.format import compression

    bomb = _zeros_frame(256 << 20, declare=True)
    assert len(bomb) < 64 << 10
    with pytest.raises(ValueError, match="declares 268435456 bytes"):
        compression.decompress_block(bomb, "zstd", 1 << 20)


def test_a_frame_that_hides_its_size_decodes_no_more_than_its_block() -> None:
    from trainsnap.format import compression

    with pytest.raises(ValueError, match="expected 1048576"):
        compression.decompress_block(_zeros_frame(64 << 20, declare=False), "zstd", 1 << 20)


def test_a_malformed_frame_is_a_value_error_not_a_zstd_error() -> None:
    """Finding 7: malformed frames raised ZstdError past every handler."""
    from trainsnap.format import compression

    with pytest.raises(ValueError, match="malformed"):
        compression.decompress_block(b"\x28\xb5\x2f\xfd" + b"\xff" * 40, "zstd", 64)


# -- import-dcp never runs code from a checkpoint ---------------------------------------------


class _Payload:
    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.canary}",))


def test_import_dcp_refuses_a_metadata_pickle_that_would_run_code(tmp_path: Path) -> None:
    """Finding 5: import-dcp pickle.load-ed the DCP .metadata; a crafted one ran a command."""
    import pickle

    dcp_dir, canary = tmp_path / "dcp", tmp_path / "canary"
    dcp_dir.mkdir()
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(_Payload(canary)))
    out = _cli("import-dcp", str(dcp_dir), str(tmp_path / "root"))
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "system" in out.stdout + out.stderr and "--trust-pickle" in out.stdout + out.stderr
    assert not canary.exists()
    assert "--trust-pickle" in _cli("import-dcp", "--help").stdout


# -- deep JSON, huge markers, unrenderable summaries, ids with a newline ------------------------

DEEP = b"[" * 100_000 + b"]" * 100_000


def _two_snapshots(root: Path) -> tuple[str, str]:
    return ts.save(_state(), root, step=1).id, ts.save(_state(), root, step=2).id


def _other_snapshot(root: Path, sid: str) -> str:
    """The one snapshot of a two-snapshot root that is not ``sid``."""
    (other,) = {p.name for p in (root / "snapshots").iterdir()} - {sid}
    return other


def _reseal_marker(root: Path, sid: str, edit: Callable[[dict], None]) -> None:
    """Rewrite snapshot ``sid``'s marker after ``edit`` changed its document, with a manifest
    size and digest that match the manifest as it now is."""
    import json

    from trainsnap.format.checksums import Hasher

    marker_path = root / "snapshots" / sid / "COMMITTED"
    doc = json.loads(marker_path.read_bytes())
    manifest = next((root / "snapshots" / sid).glob("manifest*")).read_bytes()
    hasher = Hasher(doc["manifest"]["algorithm"])
    doc["manifest"].update(size=len(manifest), digest=hasher.digest(manifest).hex())
    edit(doc)
    marker_path.write_text(json.dumps(doc))


def _only_the_first_is_listed_and_loaded(root: Path, first: str) -> None:
    assert [s.id for s in ts.list_snapshots(root)] == [first]
    assert ts.load(_destination(), root).id == first
    out = _cli("ls", str(root))
    assert out.returncode == 0 and first in out.stdout, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def _marker_nested_deep(root: Path) -> str:
    _, second = _two_snapshots(root)
    (root / "snapshots" / second / "COMMITTED").write_bytes(DEEP)
    return second


def test_a_marker_nested_100000_deep_breaks_only_its_own_snapshot(tmp_path: Path) -> None:
    """Finding 7: one such marker broke ls, verify, gc and load latest for the whole root
    with a RecursionError."""
    second = _marker_nested_deep(tmp_path)
    first = _other_snapshot(tmp_path, second)
    _only_the_first_is_listed_and_loaded(tmp_path, first)
    with pytest.raises(ts.CorruptError, match="nested too deeply"):
        commit.committed_marker(open_storage(tmp_path), second)


def _manifest_header_nested_deep(root: Path) -> str:
    _, second = _two_snapshots(root)
    manifest = next((root / "snapshots" / second).glob("manifest*"))
    manifest.write_bytes(encoding.MAGIC + len(DEEP).to_bytes(8, "little") + DEEP)
    _reseal_marker(root, second, lambda doc: None)
    return second


def test_a_manifest_header_nested_100000_deep_is_corrupt(tmp_path: Path) -> None:
    second = _manifest_header_nested_deep(tmp_path)
    first = _other_snapshot(tmp_path, second)
    with pytest.raises(ts.CorruptError, match="nested too deeply"):
        ts.load(_destination(), tmp_path, snapshot=second)
    with ts.CheckpointManager(tmp_path, options=ts.ManagerOptions(preemption_signals=())) as mgr:
        assert mgr.restore(_destination()).id == first  # falls back past it


def test_a_value_nested_100000_deep_is_an_error_of_that_value() -> None:
    from trainsnap.format import values

    with pytest.raises(ts.TrainsnapError, match="nested too deeply"):
        values.decode(values.JSON, DEEP, "cfg", allow_pickle=False, snapshot_id="s")


def _gigantic_marker(root: Path) -> str:
    _, second = _two_snapshots(root)
    with (root / "snapshots" / second / "COMMITTED").open("wb") as f:
        f.truncate(1 << 30)  # sparse: costs no disk
    return second


def test_a_gigantic_marker_is_refused_without_reading_it(tmp_path: Path) -> None:
    """Finding 11: a 1 GiB marker took ls to 2.28 GB and 9 s."""
    second = _gigantic_marker(tmp_path)
    first = _other_snapshot(tmp_path, second)
    _only_the_first_is_listed_and_loaded(tmp_path, first)

    class Counting(PosixStorage):
        read = 0

        def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
            data = super().get(key, start, end)
            Counting.read += len(data)
            return data

    assert [s.id for s in ts.list_snapshots(Counting(tmp_path))] == [first]
    assert Counting.read < 1 << 20  # the huge marker was never read


UNRENDERABLE: Final = [
    ("created", "0001-01-01T00:00:00-05:00"),
    ("nbytes", 10**400),
    ("created", "x" * 10**4),
]


def _unrenderable_summary(field: str, value: object) -> Callable[[Path], str]:
    """A builder: the newer of two snapshots' marker summary says ``field`` is ``value``."""

    def build(root: Path) -> str:
        _, second = _two_snapshots(root)
        _reseal_marker(root, second, lambda doc: doc["summary"].update({field: value}))
        return second

    return build


@pytest.mark.parametrize(("field", "value"), UNRENDERABLE)
def test_a_marker_summary_a_listing_cannot_render_is_corrupt(
    tmp_path: Path, field: str, value: object
) -> None:
    """Finding 9: year 1 with an offset, or nbytes 10^400, passed the summary check and then
    overflowed when rendered, breaking `trainsnap ls` of the whole root."""
    second = _unrenderable_summary(field, value)(tmp_path)
    first = _other_snapshot(tmp_path, second)
    _only_the_first_is_listed_and_loaded(tmp_path, first)


def test_ids_and_keys_with_a_trailing_newline_are_refused() -> None:
    """Finding 10: the checks used `$`, which accepts a trailing newline."""
    from trainsnap.format.manifest import check_snapshot_id
    from trainsnap.storage.base import check_key

    check_snapshot_id("step-000000000001-abcd")
    with pytest.raises(ts.TrainsnapError):
        check_snapshot_id("step-000000000001-abcd\n")
    with pytest.raises(ts.TrainsnapError):
        check_key("objects/ab\n")


def _value_chunks_repeated(manifest: Manifest) -> None:
    """The last value's chunk named 2,000 times more: a value many times larger than the bytes
    its objects hold."""
    last = len(manifest.chunk_length) - 1
    copies = 2000
    for name in ("chunk_object", "chunk_offset", "chunk_length"):
        column = getattr(manifest, name)
        setattr(manifest, name, np.concatenate([column, np.repeat(column[last:], copies)]))
    manifest.value_nchunks[-1] += copies
    manifest._derived.clear()


def test_a_value_larger_than_its_objects_is_corrupt_before_it_is_allocated(
    tmp_path: Path,
) -> None:
    """Finding 8: a value's declared size was allocated before it was read (a 17 KiB manifest
    allocated 1.29 GB). The value's chunks here all name one region many times over."""
    sid = _hostile_root(tmp_path, _value_chunks_repeated)
    with pytest.raises(ts.CorruptError, match="overlapping"):
        ts.load(_destination(), tmp_path, snapshot=sid)
    with pytest.raises(ts.CorruptError, match="overlapping"):  # every block of it checks out
        ts.verify(tmp_path)


@pytest.mark.parametrize(
    ("document", "why"),
    [
        (b'{"$dict": [[1, 2], [1, 3]]}', "repeats the key 1"),
        (b'{"$tuple": {"a": 1}}', "holds a dict"),
        (b'{"$dict": {"a": 1}}', "pairs"),
    ],
)
def test_malformed_tagged_values_are_refused_not_decoded_silently(
    document: bytes, why: str
) -> None:
    """Finding 12: a $dict with duplicate keys and a $tuple of a dict decoded silently."""
    from trainsnap.format import values

    with pytest.raises(ts.TrainsnapError, match=why):
        values.decode(values.JSON, document, "cfg", allow_pickle=False, snapshot_id="s")


def _malformed_rng_state(root: Path, model: torch.nn.Module | None = None) -> str:
    """A TrainState snapshot whose RNG state has the right shape but a version random.setstate
    refuses."""
    from trainsnap.state import rng

    def bad_capture() -> dict:
        state = real_capture()
        state["python"]["version"] = 99
        return state

    real_capture = rng.capture
    state = ts.TrainState(model=model if model is not None else torch.nn.Linear(4, 3))
    with mock.patch.object(rng, "capture", bad_capture):
        return ts.save(state, root, step=1).id


def test_a_strict_load_with_malformed_rng_state_applies_nothing(tmp_path: Path) -> None:
    """Finding 12: malformed RNG state raised a raw ValueError after the model and optimizer
    were already restored."""
    model = torch.nn.Linear(4, 3)
    _malformed_rng_state(tmp_path, model)
    fresh = torch.nn.Linear(4, 3)
    before = fresh.weight.detach().clone()
    with pytest.raises(ts.CorruptError, match="RNG state cannot be restored"):
        ts.load(ts.TrainState(model=fresh), tmp_path)
    assert torch.equal(fresh.weight, before) and not torch.equal(fresh.weight, model.weight)


def test_export_to_a_file_is_one_line_of_error_not_a_traceback(tmp_path: Path) -> None:
    """Finding 12: `export` to an OUT that is a file printed a traceback."""
    sid = ts.save({"model": {"w": torch.ones(3)}}, tmp_path / "root", step=1).id
    (tmp_path / "out").write_text("a file")
    out = _cli(
        "export", str(tmp_path / "root"), sid, str(tmp_path / "out"), "--format", "safetensors"
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr + out.stdout
    assert "not a directory" in out.stderr and len(out.stderr.strip().splitlines()) <= 3


def test_a_root_that_is_itself_a_symlink_works_and_stays_inside(tmp_path: Path) -> None:
    """A user's root may be a link (``/ckpt -> /mnt/fast/ckpt``): everything works through it,
    and nothing beside its target is touched."""
    outside = _outside(tmp_path)
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    before = _canaries(outside)
    first = ts.save(_state(), link, step=1).id
    ts.save(_state(), link, step=2)
    commit.delete_snapshot(open_storage(link), first)
    collection.collect(open_storage(link), grace=None)
    assert [s.step for s in ts.list_snapshots(link)] == [2]
    assert ts.load(_destination(), link).step == 2
    assert ts.verify(link).ok
    assert _canaries(outside) == before
    assert any((real / "objects").rglob("*"))


# -- every tool on every hostile root: an answer, never a crash, a hang or an escape -------------
#
# Each tool runs in a process of its own, forked from one that has imported everything (so a
# segfault or a hang is that tool's alone and a process start is paid once), and its peak RSS is
# measured there: getrusage's ru_maxrss after the call minus before it.

TOOLS: Final = ("verify", "show", "gc --dry-run", "diff", "export", "ts.load", "ts.read")
ANSWERING: Final = frozenset({"verify", "diff", "export", "ts.load", "ts.read"})
"""The tools that read the snapshot under attack itself: each must answer with an error
(show and gc read only manifests: they must end cleanly, whichever way)."""
PEAK_MB: Final = 200
TOOL_TIMEOUT: Final = 60.0


def _other_state() -> dict:
    """Other values under the same keys: a diff against it must read the snapshot under
    attack (identical objects would be called unchanged without a byte read)."""
    state = _state()
    return {
        key: value + 1 if isinstance(value, torch.Tensor) else value for key, value in state.items()
    }


def _mutated(mutate: Callable[[Manifest], None]) -> Callable[[Path], str]:
    """A builder: a root whose one snapshot's manifest ``mutate`` changed (see _hostile_root)."""
    return lambda root: _hostile_root(root, mutate)


def _zstd_bomb(root: Path) -> str:
    """Finding 4 as a root: the one 1 MiB block of a compressed tensor replaced by a 32 KiB
    frame declaring 1 GiB, with a stored size, frame size and digest that match it, so that
    only the frame check stands between it and the decoder."""
    options = ts.SaveOptions(compression="zstd")
    sid = ts.save({"w": torch.zeros(1 << 18)}, root, step=3, options=options).id
    storage = open_storage(root)
    manifest = commit.open_snapshot(storage, sid)
    bomb = _zeros_frame(1 << 30, declare=True)
    (root / object_key(manifest.object_names[0])).write_bytes(bomb)
    manifest.object_stored[0] = manifest.frames[0] = len(bomb)
    manifest.blocks = manifest.hasher.digest(bomb)
    manifest._derived.clear()
    storage.delete(f"snapshots/{sid}/COMMITTED")
    commit.write_commit(storage, manifest, writer={})
    return sid


def _block_size_2_30(manifest: Manifest) -> None:
    """Finding 8: block_size 2^30 over objects of a few bytes (each still one block, so every
    digest holds) asked for 1 GiB of scratch per reading thread."""
    manifest.block_size = 1 << 30


@dataclass(frozen=True, slots=True)
class Attack:
    """A hostile root: how to build it and what the tools must answer."""

    build: Callable[[Path], str]
    """Makes the root at the path given (links and canaries beside it) and returns the id of
    the snapshot under attack ("latest" where none survived)."""
    companion: Callable[[], dict] | None = _other_state
    """A sound snapshot saved first, which ``diff`` compares with the one under attack."""
    destination: Callable[[], Any] = _destination
    readable: frozenset[str] = frozenset()
    """Tools that must succeed: for them the root is sound (only its meaning or a size in it
    is hostile)."""


ATTACKS: Final[dict[str, Attack]] = {
    "nshards-wrap": Attack(_mutated(_set_column("tensor_nshards", [BIG, BIG, 5]))),
    "chunk-bounds-wrap": Attack(_mutated(_wrapping_chunks)),
    "value-chunk-2^63": Attack(_mutated(_value_chunk_of_2_63_bytes)),
    "nchunks-wrap": Attack(_mutated(_wrapping_chunk_counts)),
    "million-dimensions": Attack(_mutated(_million_dimensions)),
    "elements-2^80": Attack(_mutated(_elements_beyond_2_58)),
    # diff and export read tensors only: a damaged value they never read cannot stop them.
    "value-chunks-repeated": Attack(
        _mutated(_value_chunks_repeated), readable=frozenset({"diff", "export"})
    ),
    "block-size-2^30": Attack(_mutated(_block_size_2_30), readable=frozenset(TOOLS)),
    "zstd-bomb": Attack(
        _zstd_bomb,
        companion=lambda: {"w": torch.ones(1 << 18)},
        destination=lambda: {"w": torch.zeros(1 << 18)},
    ),
    "objects-dir-link": Attack(_objects_directory_linked_out),
    "object-link": Attack(_object_linked_out),
    # The linked directory is no part of the root: verify checks the one snapshot left.
    "snapshot-dir-link": Attack(_snapshot_directory_linked_out, readable=frozenset({"verify"})),
    "planted-links": Attack(_planted_object_links, companion=None),
    "object-fifo": Attack(_object_replaced_by("fifo")),
    "object-directory": Attack(_object_replaced_by("directory")),
    "deep-marker": Attack(_marker_nested_deep),
    "deep-header": Attack(_manifest_header_nested_deep),
    "gigantic-marker": Attack(_gigantic_marker),
    "summary-year-1": Attack(_unrenderable_summary(*UNRENDERABLE[0])),
    "summary-nbytes-10^400": Attack(_unrenderable_summary(*UNRENDERABLE[1])),
    "summary-created-10^4": Attack(_unrenderable_summary(*UNRENDERABLE[2])),
    "rng-malformed": Attack(
        _malformed_rng_state,
        destination=lambda: ts.TrainState(model=torch.nn.Linear(4, 3)),
        readable=frozenset(TOOLS) - {"ts.load"},
    ),
}


def _argv(job: dict[str, Any]) -> list[str]:
    root, sid = job["root"], job["snapshot"]
    if job["tool"] == "diff":
        return ["diff", root, job["other"], sid]
    if job["tool"] == "export":
        return ["export", root, sid, job["out"], "--format", "safetensors", "--prefix", ""]
    return {"verify": ["verify", root], "show": ["show", root, sid]}.get(
        job["tool"], ["gc", root, "--dry-run"]
    )


def _run_tool(job: dict[str, Any]) -> dict[str, Any]:
    """Run one tool in this process as a user would (the CLI's own entry point, or the API
    call): how it ended and its peak RSS above where it started."""
    from trainsnap.tools.cli import app

    answer: dict[str, Any] = {"exit": None, "raised": None, "trainsnap": False, "message": ""}
    destination = ATTACKS[job["attack"]].destination if job["attack"] else _destination
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        if job["tool"] == "ts.load":
            ts.load(destination(), job["root"], snapshot=job["snapshot"])
        elif job["tool"] == "ts.read":
            ts.read(job["root"], job["snapshot"])
        else:
            app(args=_argv(job), prog_name="trainsnap")
        answer["exit"] = 0
    except SystemExit as e:
        answer["exit"] = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException as e:  # everything is recorded: a raw exception is a finding
        answer["raised"] = f"{type(e).__module__}.{type(e).__qualname__}"
        answer["trainsnap"] = isinstance(e, ts.TrainsnapError)
        answer["message"] = str(e)[:400]
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    answer["peak_mb"] = (after - before) / 1024  # Linux counts KiB
    return answer


def _fork_tool(job: dict[str, Any], workdir: Path) -> int:
    """Start one tool in a child of this process, its stdout and stderr into files."""
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(workdir / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        answer = _run_tool(job)
        sys.stdout.flush()
        sys.stderr.flush()
        (workdir / "answer.json").write_text(json.dumps(answer))
    except BaseException:
        code = 3
    finally:
        os._exit(code)


def _reaped(pid: int, workdir: Path, deadline: float) -> dict[str, Any] | None:
    """A finished child's answer (killed past its deadline: it hung), or None while it runs."""
    done, status = os.waitpid(pid, os.WNOHANG)
    if not done:
        if time.monotonic() < deadline:
            return None
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    found = workdir / "answer.json"
    answer = json.loads(found.read_text()) if found.exists() else {}
    for name in ("stdout", "stderr"):
        answer[name] = (workdir / name).read_text(errors="replace")[-4000:]
    answer["hung"] = not done
    answer["signal"] = os.WTERMSIG(status) if done and os.WIFSIGNALED(status) else None
    return answer


def _probe_main(jobs_path: str, answers_path: str) -> None:
    """In a fresh interpreter (see the end of this file): each job in a child of its own, two
    at a time."""
    # Everything the tools import is imported before the forks, so that no figure counts it:
    # ts.load imports DTensor's module (and sympy) on first use, the CLI's first parse pydantic.
    import torch.distributed.tensor  # noqa: F401
    import zstandard  # noqa: F401

    import trainsnap.tools.cli  # noqa: F401

    with contextlib.suppress(ImportError):
        import typer._adapters  # noqa: F401

    jobs = json.loads(Path(jobs_path).read_text())
    answers: list[dict[str, Any] | None] = [None] * len(jobs)
    queue = list(enumerate(jobs))[::-1]
    running: dict[int, tuple[int, Path, float]] = {}
    while queue or running:
        if queue and len(running) < 2:
            index, job = queue.pop()
            workdir = Path(answers_path).parent / f"job-{index}"
            workdir.mkdir()
            running[_fork_tool(job, workdir)] = (index, workdir, time.monotonic() + TOOL_TIMEOUT)
            continue
        time.sleep(0.002)
        for pid, (index, workdir, deadline) in list(running.items()):
            answers[index] = _reaped(pid, workdir, deadline)
            if answers[index] is not None:
                del running[pid]
    Path(answers_path).write_text(json.dumps(answers))


def _run_tools(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each job's answer (see _run_tool and _reaped), from one fresh interpreter."""
    with tempfile.TemporaryDirectory() as scratch:
        jobs_path, answers_path = Path(scratch, "jobs.json"), Path(scratch, "answers.json")
        jobs_path.write_text(json.dumps(jobs))
        cmd = [sys.executable, __file__, str(jobs_path), str(answers_path)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        answers: list[dict[str, Any]] = json.loads(answers_path.read_text())
    return answers


def _verdict(answer: dict[str, Any]) -> str:
    """How a tool ended: ok; error (a TrainsnapError, or a clean exit: status 2 with one error
    message, 1 with the problems found); or, in words, what went wrong instead."""
    if answer["hung"]:
        return f"hung past {TOOL_TIMEOUT:.0f} s"
    if answer["signal"]:
        return f"killed by {signal.Signals(answer['signal']).name}"
    if "exit" not in answer:
        return f"no answer: {answer['stderr'][-300:]}"
    if "Traceback" in answer["stdout"] + answer["stderr"]:
        return f"traceback: {answer['stderr'][-300:]}"
    if answer["raised"]:
        return "error" if answer["trainsnap"] else f"raw {answer['raised']}: {answer['message']}"
    if answer["exit"] == 0:
        return "ok"
    first, *problems = answer["stderr"].rstrip().splitlines() or [""]
    one_message = first.startswith("error: ") and all(p.startswith("  - ") for p in problems)
    if answer["exit"] == 2 and one_message:  # the message, then each problem it gathered
        return "error"
    if answer["exit"] == 1 and answer["stdout"].strip():
        return "error"
    return f"exit {answer['exit']}: {answer['stderr'][-300:]}"


def _fingerprint(home: Path, skip: Path) -> dict[str, tuple[int, int, int, str]]:
    """Every entry under ``home`` (links not followed), bar ``skip``: its kind, size, mtime and
    link target, which any write, deletion or creation changes."""
    prints = {}
    for directory, subdirectories, files in os.walk(home):
        for name in subdirectories + files:
            path = Path(directory, name)
            if path == skip or skip in path.parents:
                continue
            info = path.lstat()
            target = os.readlink(path) if path.is_symlink() else ""
            prints[str(path.relative_to(home))] = (
                info.st_mode,
                info.st_size,
                info.st_mtime_ns,
                target,
            )
    return prints


def _stored_mb(root: Path) -> float:
    """Megabytes the root really occupies (a sparse file counts what it holds, a link
    nothing): the most data a tool may legitimately need."""
    total = 0
    for directory, _, files in os.walk(root):
        total += sum(Path(directory, name).lstat().st_blocks * 512 for name in files)
    return total / 2**20


@dataclass(frozen=True, slots=True)
class Probe:
    """What every tool did on every hostile root."""

    answers: dict[tuple[str, str], dict[str, Any]]
    """(attack, tool) -> how the tool ended and its peak RSS."""
    changed: dict[str, list[str]]
    """Per attack, the paths beside and under its root that the tools wrote, created or
    deleted (the export's own destination aside)."""
    stored_mb: dict[str, float]


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Probe:
    """Every hostile root built, and every tool run on it in a fresh process."""
    base = tmp_path_factory.mktemp("hostile")
    jobs, before = [], {}
    for name, attack in ATTACKS.items():
        home = base / name
        root = home / "root"
        other = ts.save(attack.companion(), root, step=0).id if attack.companion else None
        sid = attack.build(root)
        before[name] = _fingerprint(home, skip=home / "export")
        for tool in TOOLS:
            where = {"root": str(root), "snapshot": sid, "other": other or sid}
            jobs.append({"attack": name, "tool": tool, "out": str(home / "export"), **where})
    answers = _run_tools(jobs)
    changed = {}
    for name, prints in before.items():
        after = _fingerprint(base / name, skip=base / name / "export")
        changed[name] = sorted(
            k for k in prints.keys() | after.keys() if prints.get(k) != after.get(k)
        )
    return Probe(
        {(job["attack"], job["tool"]): answer for job, answer in zip(jobs, answers, strict=True)},
        changed,
        {name: _stored_mb(base / name / "root") for name in ATTACKS},
    )


@pytest.mark.parametrize("attack", ATTACKS)
def test_every_tool_answers_a_hostile_root_and_touches_nothing(probe: Probe, attack: str) -> None:
    """verify, diff, export, ts.read and ts.load answer every attack with a TrainsnapError (the
    CLI: status 1 or 2 and one message); show and gc --dry-run end cleanly; none is killed by a
    signal, hangs, raises a raw exception or writes, creates or deletes anything beside the
    export's destination. A tool the root is sound for must succeed."""
    readable = ATTACKS[attack].readable
    got = {tool: _verdict(probe.answers[attack, tool]) for tool in TOOLS}
    want = {
        tool: "ok" if tool in readable else "error" if tool in ANSWERING else got[tool]
        for tool in TOOLS
    }
    for tool in set(TOOLS) - ANSWERING - readable:
        if got[tool] not in ("ok", "error"):
            want[tool] = "ok or error"
    assert got == want
    assert probe.changed[attack] == []


@pytest.mark.parametrize("attack", ATTACKS)
def test_every_tool_stays_under_200_mb_on_a_hostile_root(probe: Probe, attack: str) -> None:
    """Findings 4, 8 and 11 among others: a tool's peak RSS above its start stays under 200 MB
    plus what the root really stores, however large the sizes it declares."""
    bound = PEAK_MB + probe.stored_mb[attack]
    peaks = {tool: probe.answers[attack, tool].get("peak_mb", float("inf")) for tool in TOOLS}
    assert all(peak < bound for peak in peaks.values()), (bound, peaks)


def _said(answer: dict[str, Any]) -> str:
    """How a tool ended, in a few words: its exception's kind, or its exit and first line."""
    if answer.get("raised"):
        return answer["raised"].rsplit(".", 1)[-1]
    verdict = _verdict(answer)
    if verdict not in ("ok", "error"):
        return verdict[:60]
    line = (answer["stderr"].strip() or answer["stdout"].strip() or "-").splitlines()[0]
    return f"{answer['exit']}: {line[:56]}"


def test_the_peak_memory_table(probe: Probe, capsys: pytest.CaptureFixture[str]) -> None:
    """The figures the two tests above check, printed to quote: each tool's peak RSS in MB
    above its start, and how diff, export and ts.read ended."""
    width = max(map(len, ATTACKS))
    head = f"{'attack':<{width}}" + "".join(f"{tool:>14}" for tool in TOOLS)
    peaks = [head, "-" * len(head)]
    answers = []
    for attack in ATTACKS:
        cells = (probe.answers[attack, tool].get("peak_mb", float("nan")) for tool in TOOLS)
        peaks.append(f"{attack:<{width}}" + "".join(f"{peak:>14.1f}" for peak in cells))
        for tool in ("diff", "export", "ts.read"):
            answers.append(f"{attack:<{width}}  {tool:<8}{_said(probe.answers[attack, tool])}")
    with capsys.disabled():
        print("\n\npeak RSS above each tool's start (MB), one fresh process per cell")
        print("\n".join(peaks))
        print("\nhow diff, export and ts.read ended (exit status and first line, or exception)")
        print("\n".join(answers))
    assert len(peaks) == len(ATTACKS) + 2


if __name__ == "__main__":
    _probe_main(*sys.argv[1:])


# -- export: exclusive creation, random temporary names, nothing left after a failure -----------


def test_export_never_writes_through_a_link_planted_at_its_temporary_name(tmp_path: Path) -> None:
    """Export opened ``.<name>.tmp-<pid>`` with open(..., "wb"): a link planted at that name
    (the pid is easy to guess) made it overwrite the file the link points to."""
    from trainsnap.tools.export import export_safetensors

    sid = ts.save({"model.w": torch.ones(4)}, tmp_path / "root", step=1).id
    out, victim = tmp_path / "out", tmp_path / "victim"
    out.mkdir()
    victim.write_bytes(b"precious")
    (out / f".model.safetensors.tmp-{os.getpid()}").symlink_to(victim)
    export_safetensors(tmp_path / "root", sid, out)
    assert victim.read_bytes() == b"precious"
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors").is_symlink()


def test_a_failed_export_removes_what_it_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainsnap.tools import export

    sid = ts.save({"model.w": torch.ones(4), "model.v": torch.ones(3)}, tmp_path / "r", step=1).id
    calls = []

    def failing(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "_stream_tensor", failing)
    with pytest.raises(OSError):
        export.export_safetensors(tmp_path / "r", sid, tmp_path / "new" / "out")
    assert calls and not (tmp_path / "new").exists()


# -- memory and time driven by numbers in the input, not by its size ---------------------------


def test_the_tree_check_builds_no_path_longer_than_the_keys() -> None:
    """The structure check built every leaf's full dotted path: 200 nested keys of 1,000
    characters over 500 leaves made 100 MB of paths from a tree of 0.2 MB (a 1.2 MB manifest
    reached 3.4 GB). It now joins a path only for a leaf no longer than the longest key."""
    import tracemalloc

    from trainsnap.format import tree

    node: Any = {"d": [[f"k{i}", 0] for i in range(500)]}
    for depth in range(200):
        node = {"d": [["x" * 1000 + str(depth), node]]}
    tracemalloc.start()
    found = tree.problems(node, {"a", "b"})
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert found and found[0].startswith("tree: ")
    assert peak < 10 * 2**20, peak


def test_a_per_rank_lookup_does_not_loop_over_the_claimed_world_size(tmp_path: Path) -> None:
    """rank_scoped looked up (key, r) for every r below the manifest's world_size (up to 2^20),
    for every key: minutes for a load of a few hundred keys."""
    from trainsnap.protocol.rank_load import rank_scoped

    sid = _hostile_root(tmp_path, lambda m: m.topology.update(world_size=(1 << 20) - 1))
    manifest = commit.open_snapshot(open_storage(tmp_path), sid)
    started = time.monotonic()
    answers = {rank_scoped(manifest, key) for key in ["w", "b", "c", "missing"] * 50}
    assert answers == {False}
    assert time.monotonic() - started < 1.0


def _tensor_of_2_40_elements(root: Path) -> str:
    """One int64 tensor declaring 2^40 elements (8 TiB) in one object declaring 2^43 bytes at
    block size 2^30: the manifest holds 8,192 digests and stays small."""
    sid = ts.save({"c": torch.arange(5)}, root, step=3).id
    storage = open_storage(root)
    manifest = commit.open_snapshot(storage, sid)
    size = 1 << 43
    manifest.block_size = 1 << 30
    manifest.tensor_shapes[0] = (1 << 40,)
    manifest.object_sizes[0] = manifest.chunk_length[0] = size
    if len(manifest.object_stored):
        manifest.object_stored[0] = size
    digest = manifest.hasher.digest_size
    manifest.blocks = manifest.blocks[:digest] + bytes(digest * (size // (1 << 30) - 1))
    manifest.shard_geo[:] = [0, 1 << 40]
    manifest._derived.clear()
    storage.delete(f"snapshots/{sid}/COMMITTED")
    commit.write_commit(storage, manifest, writer={})
    return sid


def test_a_tensor_claiming_2_40_elements_is_an_error_not_an_allocation(tmp_path: Path) -> None:
    sid = _tensor_of_2_40_elements(tmp_path)
    with pytest.raises(ts.TrainsnapError):
        ts.read(tmp_path, sid)


@pytest.mark.parametrize(
    "document",
    [
        b'{"$timedelta": [1e30, 0, 0]}',
        b'{"$timedelta": [99999999999, 0, 0]}',
        b'{"$size": [1e400]}',
        b'{"$size": [-1]}',
        b'{"$np": ["<f4", [1099511627776], ""]}',
        b'{"$path": [[1], 2]}',
        b'{"$np": ["<U999999999999", [1], "AAAA"]}',
        b'{"$bytes": 5}',
        b'{"$datetime": 5}',
    ],
)
def test_overflowing_or_malformed_value_tags_are_a_trainsnap_error(document: bytes) -> None:
    """Overflowing tags (a timedelta of 10^30 days, a Size of inf) raised OverflowError."""
    from trainsnap.format import values

    with pytest.raises(ts.TrainsnapError):
        values.decode(values.JSON, document, "cfg", allow_pickle=False, snapshot_id="s")


def test_a_marker_recording_a_huge_manifest_is_refused_before_reading(tmp_path: Path) -> None:
    """A marker may record any manifest size; the manifest was then read whole (a sparse file
    of 5 GiB read into memory). A size beyond the cap is now corrupt before any read."""
    from trainsnap.format.encoding import MAX_MANIFEST

    sid = ts.save(_state(), tmp_path, step=3).id
    _reseal_marker(tmp_path, sid, lambda doc: doc["manifest"].update(size=MAX_MANIFEST + 1))
    with pytest.raises(ts.CorruptError, match=r"manifest\.size"):
        commit.committed_marker(open_storage(tmp_path), sid)


# -- what is saved can be read --------------------------------------------------------------------


def _cyclic(items: list) -> list:
    items.append(items)
    return items


def _deep_state(depth: int) -> dict:
    node: dict = {"t": torch.ones(2)}
    for _ in range(depth):
        node = {"n": node}
    return node


@pytest.mark.parametrize(
    ("state", "key"),
    [
        (_deep_state(300), "n.n.n"),
        ({"cyc": _cyclic([])}, "cyc"),
        ({"cyc": _cyclic([torch.ones(1)])}, "cyc"),
        ({"big": 1 << 5000}, "big"),
        ({"cfg": {1 << 2000: 1}}, "cfg"),
    ],
    ids=["nested-300", "cyclic-value", "cyclic-with-tensor", "int-5000-bits", "key-2000-bits"],
)
def test_a_save_refuses_what_no_reader_reads_before_writing(
    tmp_path: Path, state: dict, key: str
) -> None:
    """A state nested beyond the reader's limit committed a snapshot no reader opens; a cyclic
    state or a huge integer failed with a raw RecursionError or ValueError."""
    with pytest.raises(ts.InvalidArgumentError, match=key):
        ts.save(state, tmp_path / "root", step=1)
    assert not (tmp_path / "root" / "objects").exists() or not any(
        (tmp_path / "root" / "objects").rglob("*")
    )
    assert ts.list_snapshots(tmp_path / "root") == []


# -- leftovers of the earlier suites (hostile suite 3) ---------------------------------------------


def test_a_value_nested_deeper_than_a_reader_reads_makes_restore_fall_back(tmp_path: Path) -> None:
    """A value of the newest snapshot nested deeper than the decoder accepts made
    CheckpointManager.restore raise instead of falling back (every other damage falls back)."""
    from trainsnap.format import values

    first = ts.save(_state(), tmp_path, step=1).id
    levels = 2 * values.MAX_DEPTH + 10  # deeper than a reader reads, shallow for json
    real = values.encode_plain

    def crafted(value: Any, path: str = "value") -> bytes:  # a writer that skips the check
        return b"[" * levels + b"]" * levels if value == "deep" else real(value, path)

    with mock.patch.object(values, "encode_plain", crafted):
        second = ts.save({**_state(), "cfg": "deep"}, tmp_path, step=2).id
    with pytest.raises(ts.CorruptError, match="nested deeper"):
        ts.read(tmp_path, second)
    with ts.CheckpointManager(tmp_path, options=ts.ManagerOptions(preemption_signals=())) as mgr:
        assert mgr.restore(_destination()).id == first


@pytest.mark.parametrize(
    "document",
    [
        {"$npscalar": ["<U1", "/////w=="]},
        {"$np": ["<U1", [2], "YQAAAP////8="]},
        {"$np": [">U1", [1], "ABEAAA=="]},
    ],
)
def test_numpy_text_beyond_the_last_code_point_is_corrupt(document: dict[str, Any]) -> None:
    """$npscalar / $np '<U1' holding 0xFFFFFFFF gave a raw SystemError or a value whose repr
    raised."""
    from trainsnap.format import values

    data = json.dumps(document).encode()
    with pytest.raises(ts.CorruptError, match="beyond U\\+10FFFF"):
        values.decode(values.JSON, data, "cfg", allow_pickle=False, snapshot_id="s")


def test_a_lease_directory_linked_out_of_the_root_is_a_trainsnap_error(tmp_path: Path) -> None:
    """`lease/` as a link outside gave a NotRegularFileError that was no TrainsnapError."""
    outside = _outside(tmp_path)
    before = _canaries(outside)
    root = tmp_path / "root"
    ts.save(_state(), root, step=1)
    (root / "lease").symlink_to(outside, target_is_directory=True)
    options = ts.ManagerOptions(preemption_signals=())
    with (
        pytest.raises(ts.TrainsnapError, match="symbolic link") as refused,
        ts.CheckpointManager(root, options=options) as mgr,
    ):
        mgr.save(_state(), step=2)
    assert refused.value.path == str(root / "lease")
    assert _canaries(outside) == before


def test_a_lightning_pointer_whose_root_holds_a_nul_byte_is_not_a_pointer(tmp_path: Path) -> None:
    """It raised a raw ValueError (embedded null byte)."""
    from trainsnap.integrations import _lightning_pointer

    pointer = tmp_path / "last.ckpt"
    doc = {"format": _lightning_pointer.POINTER_FORMAT, "root": "ro\0ot", "snapshot": "s"}
    pointer.write_text(json.dumps(doc))
    with pytest.raises(ts.IncompatibleError, match="NUL byte"):
        _lightning_pointer.read_pointer(str(pointer))


@pytest.mark.parametrize("shape", [(2**32, 2**32)])
def test_show_of_a_shape_whose_element_count_overflows_int64(
    tmp_path: Path, shape: tuple[int, ...]
) -> None:
    """`show` of such a shape: one error line (the manifest is refused); with a zero dimension
    (no element at all) the manifest may be shown instead; never a traceback."""

    def huge(manifest: Manifest) -> None:
        manifest.tensor_shapes[0] = shape

    sid = _hostile_root(tmp_path, huge)
    done = _cli("show", str(tmp_path), sid)
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-2000:]
    assert done.returncode in (0, 2), done.stderr[-2000:]
    if done.returncode == 2 or 0 not in shape:
        assert done.returncode == 2 and done.stderr.startswith("error: "), done.stderr
