"""Replicas share their reads: 4 real gloo ranks, bytes read from storage counted per process
(by the storage backend), every value bitwise, and a replica that dies mid-exchange named by
the others."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

import trainsnap as ts
from trainsnap.protocol.replica_reads import Replicas, split, top_of
from trainsnap.testing import assert_all_ok, run_ranks

KEYS = {"emb": (256, 256), "w1": (192, 160), "w2": (160, 192), "bias": (192,), "head": (64, 256)}


def _full(key: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(KEYS[key], generator=g)


def _ddp_state(rank: int, blank: bool) -> dict[str, Any]:
    """Every rank holds every tensor whole (data-parallel replicas), and a per-rank counter."""
    state: dict[str, Any] = {k: torch.zeros(s) if blank else _full(k) for k, s in KEYS.items()}
    state["seen"] = torch.zeros(1) if blank else torch.full((1,), float(rank))
    return state


def _mesh_state(rank: int, blank: bool) -> dict[str, Any]:
    """(dp=2, tp=2): rows split over tp = rank % 2, replicated over dp."""
    tp = rank % 2
    state: dict[str, Any] = {}
    for key, shape in KEYS.items():
        rows = shape[0] // 2
        local = _full(key)[tp * rows : (tp + 1) * rows].clone()
        if blank:
            local.zero_()
        offsets = (tp * rows,) + (0,) * (len(shape) - 1)
        state[key] = ts.Sharded(local, global_shape=shape, offsets=offsets)
    return state


LAYOUTS = {"ddp": _ddp_state, "mesh": _mesh_state}


def _count_reads() -> list[int]:
    """Bytes this process reads from the snapshot's storage, counted by the backend."""
    from trainsnap.storage.posix import PosixStorage

    counted = [0]
    get, read_into = PosixStorage.get, PosixStorage.read_into

    def counting_get(self: Any, key: str, start: int = 0, end: int | None = None) -> bytes:
        data: bytes = get(self, key, start, end)
        counted[0] += len(data)
        return data

    def counting_read_into(self: Any, key: str, start: int, out: memoryview) -> None:
        read_into(self, key, start, out)
        counted[0] += len(out)

    PosixStorage.get = counting_get  # type: ignore[method-assign]
    PosixStorage.read_into = counting_read_into  # type: ignore[method-assign]
    return counted


def _save(rank: int, world: int, root: str, layout: str) -> None:
    ts.save(LAYOUTS[layout](rank, blank=False), root, step=5, timeout=60)


def _load(rank: int, world: int, root: str, layout: str) -> int:
    ts.load(LAYOUTS[layout](rank, blank=True), root, timeout=60)  # imports, warm-up
    state = LAYOUTS[layout](rank, blank=True)
    counted = _count_reads()
    ts.load(state, root, timeout=60)
    read = counted[0]
    want = LAYOUTS[layout](rank, blank=False)
    for key, value in want.items():
        got = state[key].local if isinstance(value, ts.Sharded) else state[key]
        expected = value.local if isinstance(value, ts.Sharded) else value
        assert torch.equal(got, expected), key
    return read


def _stored(root: str) -> int:
    return ts.list_snapshots(root)[-1].nbytes


@pytest.mark.parametrize("layout", ["ddp", "mesh"])
@pytest.mark.parametrize("mode", ["2", "1", "0"])
def test_replicas_read_each_stored_byte_about_once(tmp_path: Any, layout: str, mode: str) -> None:
    """2: always shared; 1 (the default): shared when it helps, which on one host reading a
    local file system it does not (the page cache is already shared); 0: never."""
    root = str(tmp_path)
    assert_all_ok(run_ranks(_save, 4, args=(root, layout), timeout=90))
    env = {"TRAINSNAP_REPLICA_READS": mode}
    reads = assert_all_ok(run_ranks(_load, 4, args=(root, layout), timeout=120, env=env))
    ratio = sum(reads) / _stored(root)
    replicas = 4 if layout == "ddp" else 2
    if mode == "2":
        assert ratio <= 1.3, (ratio, reads)
    else:  # every replica reads everything it needs itself
        assert ratio >= 0.9 * replicas, (ratio, reads)


def _data_groups(rank: int, world: int) -> tuple[bool, bool, bool, list[int]]:
    import torch.distributed as dist

    from trainsnap.protocol import data_group, replica_reads

    first = replica_reads.data_group()
    again = data_group.group()
    owned = data_group.job().data_group() is first
    data_group.forget()  # as after a failed exchange
    fresh = replica_reads.data_group()
    ranks = torch.tensor([rank])
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, ranks, group=fresh)  # the fresh group carries data
    return first is again, owned, fresh is not first, [int(t) for t in gathered]


def test_the_data_group_is_the_jobs_made_once_and_afresh_after_a_failure() -> None:
    results = assert_all_ok(run_ranks(_data_groups, 2, timeout=120))
    assert results == [(True, True, True, [0, 1])] * 2


def test_the_split_cuts_the_stored_order_into_even_runs_never_inside_a_block() -> None:
    sizes = [5, 100, 90, 50, 40, 30, 10, 20, 60]  # k0, stored last, shares a block
    # One object, blocks of 10 bytes, tensors stored back to back in reverse key order.
    places, offset = {}, 0
    for i in reversed(range(len(sizes))):
        places[f"k{i}"] = ("obj", offset, "obj", offset + sizes[i])
        offset += sizes[i]
    work = [(k, torch.zeros(sizes[int(k[1:])], dtype=torch.uint8), p) for k, p in places.items()]
    owners = [split((0, 1, 2), order, 10) for order in (work, work[::-1], work[3:] + work[:3])]
    assert owners[0] == owners[1] == owners[2]  # whatever order each member lists them in
    stored = sorted(places, key=lambda k: places[k])
    runs = [owners[0][k] for k in stored]
    assert runs == sorted(runs) and len(set(runs)) == 3, runs  # one contiguous run each
    blocks: dict[int, set[int]] = {}
    for k in stored:
        _, start, _, end = places[k]
        for block in range(start // 10, (end - 1) // 10 + 1):
            blocks.setdefault(block, set()).add(owners[0][k])
    assert all(len(readers) == 1 for readers in blocks.values()), blocks
    one_block = split((0, 1), [(k, t, ("obj", 0, "obj", 8)) for k, t, _ in work], 100)
    assert set(one_block.values()) == {0}  # all in one block: one reader


def test_sharing_is_by_top_level_key() -> None:
    replicas = Replicas([((0, 2), ("emb", "w1")), ((0, 1, 2, 3), ("norm",))], 0, None)
    assert replicas.members_of("w1") == (0, 2)
    assert replicas.members_of("norm.weight") == (0, 1, 2, 3)
    assert replicas.members_of("normal") is None and replicas.members_of("head") is None
    assert replicas.peers == [1, 2, 3]
    assert top_of("a.b.c", {"a.b"}) == "a.b" and top_of("ab.c", {"a"}) is None


def _load_with_a_death(rank: int, world: int, root: str) -> str:
    state = _ddp_state(rank, blank=True)
    started = time.monotonic()
    try:
        ts.load(state, root, timeout=60)
    except ts.TrainsnapError as e:
        return f"failed after {time.monotonic() - started:.1f}s: {type(e).__name__}: {e}"
    return "loaded"


def test_a_replica_killed_during_the_exchange_is_named_by_every_survivor(tmp_path: Any) -> None:
    root = str(tmp_path)
    assert_all_ok(run_ranks(_save, 4, args=(root, "ddp"), timeout=90))
    env = {"TRAINSNAP_HEARTBEAT_SECONDS": "5", "TRAINSNAP_REPLICA_READS": "2"}
    rank_env = {2: {"TRAINSNAP_FAULTS": "replica_exchange=crash"}}
    results = run_ranks(
        _load_with_a_death, 4, args=(root,), timeout=120, env=env, rank_env=rank_env
    )
    assert results[2].killed
    for r in (0, 1, 3):
        text = results[r].value
        assert text is not None and text.startswith("failed"), (r, results[r])
        assert "rank 2" in text, text
        seconds = float(text.split()[2].rstrip("s:"))
        assert seconds < 30, text


def _flip_a_byte_of(root: str, key: str) -> None:
    """Flip the first stored byte of ``key`` in its object: one replica's share is corrupt."""
    from trainsnap.format.manifest import object_key
    from trainsnap.protocol import commit
    from trainsnap.storage.posix import PosixStorage

    storage = PosixStorage(root)
    m = commit.open_snapshot(storage, ts.list_snapshots(root)[-1].id)
    tensor = m.tensor_keys.index(key)
    chunk = m.chunks_of(int(m.shard_start()[tensor]))[0]
    path = Path(root) / object_key(m.object_names[int(m.chunk_object[chunk])])
    data = bytearray(path.read_bytes())
    data[int(m.chunk_offset[chunk])] ^= 0x01
    path.write_bytes(bytes(data))


def _load_corrupt(rank: int, world: int, root: str) -> tuple[str, str, list[int]]:
    try:
        ts.load(_ddp_state(rank, blank=True), root, timeout=60)
    except ts.CorruptError as e:
        return ("corrupt", str(e), [])
    except ts.LoadFailedError as e:
        return ("named", str(e), sorted(e.rank_errors))
    return ("loaded", "", [])


def test_a_replica_whose_share_is_corrupt_fails_every_rank_naming_it(tmp_path: Any) -> None:
    """The corrupt block is found by the replica(s) that read it (its block may also hold a
    rank's own tensor); they still send the rest of their share, so nobody waits, and every
    other replica raises naming them."""
    root = str(tmp_path)
    assert_all_ok(run_ranks(_save, 4, args=(root, "ddp"), timeout=90))
    _flip_a_byte_of(root, "w2")
    env = {"TRAINSNAP_REPLICA_READS": "2"}
    started = time.monotonic()
    outcomes = assert_all_ok(run_ranks(_load_corrupt, 4, args=(root,), timeout=120, env=env))
    assert time.monotonic() - started < 60  # nobody waited out the 60 s heartbeat
    readers = {r for r, (kind, _, _) in enumerate(outcomes) if kind == "corrupt"}
    assert 0 < len(readers) < 4, outcomes
    for rank, (kind, text, named) in enumerate(outcomes):
        if rank in readers:
            assert "fails its checksum" in text, text
        else:
            assert kind == "named" and named and set(named) <= readers, (rank, outcomes[rank])
            assert all(f"rank {r}" in text for r in named), text
