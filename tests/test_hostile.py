"""Hostile roots: a crafted manifest, marker or object can neither crash, exhaust, escape nor
execute. Each test is one attack found by hand; every entry point must answer it with a
TrainsnapError kind (the CLI: one line, no traceback) and touch nothing outside the root."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import trainsnap as ts
from trainsnap.format import encoding, validation
from trainsnap.format.manifest import Manifest
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
    """ts.load, ts.verify and the CLI answer with TrainsnapError kinds, never a crash."""
    with pytest.raises(ts.TrainsnapError):
        ts.load(_destination(), root, snapshot=sid)
    with pytest.raises(ts.TrainsnapError):
        ts.verify(root)
    for args in (("verify", str(root)), ("show", str(root), sid), ("gc", str(root), "--dry-run")):
        out = _cli(*args)
        assert out.returncode in (0, 1, 2), (args, out.returncode, out.stderr[-2000:])
        assert "Traceback" not in out.stderr + out.stdout, (args, out.stderr[-2000:])
    assert _cli("verify", str(root)).returncode != 0


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


def test_a_value_chunk_of_2_63_bytes_is_corrupt_not_a_memory_error(tmp_path: Path) -> None:
    def mutate(manifest: Manifest) -> None:
        last = len(manifest.chunk_length) - 1  # values come after the shards' chunks
        manifest.chunk_offset[last], manifest.chunk_length[last] = 1, BIG

    sid = _hostile_root(tmp_path, mutate)
    _every_reader_refuses(tmp_path, sid)


def test_wrapped_chunk_counts_are_corrupt_not_an_index_error(tmp_path: Path) -> None:
    def mutate(manifest: Manifest) -> None:  # BIG + BIG wraps to -2: the total stays right
        counts = manifest.shard_nchunks
        counts[:] = [BIG, BIG, int(counts.sum()) + 2]
        manifest._derived.clear()

    sid = _hostile_root(tmp_path, mutate)
    _every_reader_refuses(tmp_path, sid)


def test_a_tensor_of_a_million_dimensions_is_refused_before_any_allocation(
    tmp_path: Path,
) -> None:
    """Finding 8: validation built a tensors x max-rank matrix; one tensor with 10^6 dimensions
    would ask for gigabytes."""

    def mutate(manifest: Manifest) -> None:
        manifest.tensor_shapes[0] = (1,) * 1_000_000

    sid = _hostile_root(tmp_path, mutate)
    with pytest.raises(ts.CorruptError, match="dimensions"):
        commit.open_snapshot(open_storage(tmp_path), sid)


def test_a_tensor_larger_than_2_58_elements_is_corrupt(tmp_path: Path) -> None:
    def mutate(manifest: Manifest) -> None:
        manifest.tensor_shapes[0] = (2**40, 2**40)

    sid = _hostile_root(tmp_path, mutate)
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


def test_gc_never_deletes_through_a_symlinked_objects_directory(tmp_path: Path) -> None:
    """Finding 3: with ROOT/objects a link to another directory, gc deleted every unreferenced
    file under that directory."""
    root, outside = tmp_path / "root", _outside(tmp_path)
    ts.save(_state(), root, step=1)
    real_objects = root / "objects"
    real_objects.rename(tmp_path / "moved-objects")
    real_objects.symlink_to(outside, target_is_directory=True)
    before = _canaries(outside)
    out = _cli("gc", str(root))
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    collection.collect(open_storage(root), grace=None)
    assert _canaries(outside) == before


def test_an_object_that_is_a_symlink_out_of_the_root_is_never_read(tmp_path: Path) -> None:
    """Finding 6: an object file linked to a file outside was read (verify printed the size of
    /etc/passwd) and loaded."""
    root, outside = tmp_path / "root", _outside(tmp_path)
    sid = ts.save(_state(), root, step=1).id
    victim = next(p for p in (root / "objects").rglob("*") if p.is_file())
    (outside / "copy").write_bytes(victim.read_bytes())  # the same bytes: only the link differs
    victim.unlink()
    victim.symlink_to(outside / "copy")
    with pytest.raises(ts.CorruptError, match="not a regular file"):
        ts.load(_destination(), root, snapshot=sid)
    with pytest.raises(ts.CorruptError, match="not a regular file"):
        ts.verify(root)
    assert (outside / "copy").exists()


def test_a_snapshot_directory_linked_out_of_the_root_is_not_listed(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    first = ts.save(_state(), root, step=1).id
    second = ts.save(_state(), root, step=2).id
    (root / "snapshots" / second).rename(elsewhere)
    (root / "snapshots" / second).symlink_to(elsewhere, target_is_directory=True)
    assert [s.id for s in ts.list_snapshots(root)] == [first]
    assert ts.load(_destination(), root).id == first
    with pytest.raises(ts.TrainsnapError):  # named explicitly, it is still not read
        ts.load(_destination(), root, snapshot=second)


def test_a_planted_symlink_directory_cannot_make_a_save_write_outside(tmp_path: Path) -> None:
    """Object names are predictable: a link planted at objects/<h2> must not redirect writes."""
    root, outside = tmp_path / "root", _outside(tmp_path)
    probe = tmp_path / "probe"
    ts.save(_state(), probe, step=1)
    for directory in (probe / "objects").iterdir():
        (root / "objects").mkdir(parents=True, exist_ok=True)
        (root / "objects" / directory.name).symlink_to(outside, target_is_directory=True)
    before = _canaries(outside)
    with pytest.raises((ts.TrainsnapError, OSError)):
        ts.save(_state(), root, step=1)
    assert _canaries(outside) == before
    assert ts.list_snapshots(root) == []


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_fifo_or_directory_where_an_object_should_be_is_corrupt(
    tmp_path: Path, kind: str
) -> None:
    """Finding 12: a FIFO hung ts.load; a directory gave a raw IsADirectoryError."""
    sid = ts.save(_state(), tmp_path, step=1).id
    victim = next(p for p in (tmp_path / "objects").rglob("*") if p.is_file())
    victim.unlink()
    if kind == "fifo":
        os.mkfifo(victim)
    else:
        victim.mkdir()
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


def test_a_marker_nested_100000_deep_breaks_only_its_own_snapshot(tmp_path: Path) -> None:
    """Finding 7: one such marker broke ls, verify, gc and load latest for the whole root
    with a RecursionError."""
    first, second = _two_snapshots(tmp_path)
    (tmp_path / "snapshots" / second / "COMMITTED").write_bytes(DEEP)
    _only_the_first_is_listed_and_loaded(tmp_path, first)
    with pytest.raises(ts.CorruptError, match="nested too deeply"):
        commit.committed_marker(open_storage(tmp_path), second)


def test_a_manifest_header_nested_100000_deep_is_corrupt(tmp_path: Path) -> None:
    first, second = _two_snapshots(tmp_path)
    manifest = next((tmp_path / "snapshots" / second).glob("manifest*"))
    manifest.write_bytes(encoding.MAGIC + len(DEEP).to_bytes(8, "little") + DEEP)
    _reseal_marker(tmp_path, second, lambda doc: None)
    with pytest.raises(ts.CorruptError, match="nested too deeply"):
        ts.load(_destination(), tmp_path, snapshot=second)
    with ts.CheckpointManager(tmp_path, options=ts.ManagerOptions(preemption_signals=())) as mgr:
        assert mgr.restore(_destination()).id == first  # falls back past it


def test_a_value_nested_100000_deep_is_an_error_of_that_value() -> None:
    from trainsnap.format import values

    with pytest.raises(ts.TrainsnapError, match="nested too deeply"):
        values.decode(values.JSON, DEEP, "cfg", allow_pickle=False, snapshot_id="s")


def test_a_gigantic_marker_is_refused_without_reading_it(tmp_path: Path) -> None:
    """Finding 11: a 1 GiB marker took ls to 2.28 GB and 9 s."""
    first, second = _two_snapshots(tmp_path)
    with (tmp_path / "snapshots" / second / "COMMITTED").open("wb") as f:
        f.truncate(1 << 30)  # sparse: costs no disk
    _only_the_first_is_listed_and_loaded(tmp_path, first)

    class Counting(PosixStorage):
        read = 0

        def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
            data = super().get(key, start, end)
            Counting.read += len(data)
            return data

    assert [s.id for s in ts.list_snapshots(Counting(tmp_path))] == [first]
    assert Counting.read < 1 << 20  # the huge marker was never read


@pytest.mark.parametrize(
    ("field", "value"),
    [("created", "0001-01-01T00:00:00-05:00"), ("nbytes", 10**400), ("created", "x" * 10**4)],
)
def test_a_marker_summary_a_listing_cannot_render_is_corrupt(
    tmp_path: Path, field: str, value: object
) -> None:
    """Finding 9: year 1 with an offset, or nbytes 10^400, passed the summary check and then
    overflowed when rendered, breaking `trainsnap ls` of the whole root."""
    first, second = _two_snapshots(tmp_path)
    _reseal_marker(tmp_path, second, lambda doc: doc["summary"].update({field: value}))
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


def test_a_value_larger_than_its_objects_is_corrupt_before_it_is_allocated(
    tmp_path: Path,
) -> None:
    """Finding 8: a value's declared size was allocated before it was read (a 17 KiB manifest
    allocated 1.29 GB). The value's chunks here all name one region many times over."""

    def mutate(manifest: Manifest) -> None:
        last = len(manifest.chunk_length) - 1
        copies = 2000
        for name in ("chunk_object", "chunk_offset", "chunk_length"):
            column = getattr(manifest, name)
            setattr(manifest, name, np.concatenate([column, np.repeat(column[last:], copies)]))
        manifest.value_nchunks[-1] += copies
        manifest._derived.clear()

    sid = _hostile_root(tmp_path, mutate)
    with pytest.raises(ts.CorruptError, match="overlapping"):
        ts.load(_destination(), tmp_path, snapshot=sid)


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


def test_a_strict_load_with_malformed_rng_state_applies_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 12: malformed RNG state raised a raw ValueError after the model and optimizer
    were already restored."""
    from trainsnap.state import rng

    def bad_capture() -> dict:
        state = real_capture()
        state["python"]["version"] = 99  # right shape, refused by random.setstate
        return state

    real_capture = rng.capture
    model = torch.nn.Linear(4, 3)
    monkeypatch.setattr(rng, "capture", bad_capture)
    ts.save(ts.TrainState(model=model), tmp_path, step=1)
    monkeypatch.setattr(rng, "capture", real_capture)
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
