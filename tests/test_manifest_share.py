"""The manifest is read from storage once per load, and each rank is handed only its part:
the pure cutting (format/manifest_part) and 4 real ranks counting their manifest reads."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import trainsnap as ts
from trainsnap import tunables
from trainsnap.format.manifest import ManifestBuilder
from trainsnap.format.manifest_part import PartIndex, Wants, merge
from trainsnap.format.regions import Box, Flat
from trainsnap.protocol import commit
from trainsnap.protocol.manifest_share import MAX_CLASSES, classes_of, digest_of
from trainsnap.testing import assert_all_ok, run_ranks

# -- cutting a part -------------------------------------------------------------------------------


def _manifest() -> Any:
    """A (8, 4) tensor in four row shards, one per object; a per-rank tensor on 3 ranks; a
    global and a per-rank value; a tensor under another top-level key."""
    b = ManifestBuilder(
        snapshot_id="step-000000000001-abcd",
        created="2026-01-01T00:00:00Z",
        step=1,
        level="training",
        algorithm="xxh3-128",
        block_size=1 << 20,
        topology={"world_size": 3},
    )
    objs = [b.add_object(f"{i:02x}" * 32, 32, bytes(16)) for i in range(8)]
    t = b.add_tensor("w.big", -1, "float32", (8, 4))
    for i in range(4):
        b.add_shard(t, Box((2 * i, 0), (2, 4)), [(objs[i], 0, 32)])
    for r in range(3):
        t = b.add_tensor("w.mine", r, "float32", (2,))
        b.add_shard(t, Box((0,), (2,)), [(objs[4], 8 * r, 8)])
    t = b.add_tensor("other", -1, "float32", (2,))
    b.add_shard(t, Box((0,), (2,)), [(objs[5], 0, 8)])
    b.add_value("cfg.lr", -1, "json", [(objs[6], 0, 4)])
    for r in range(3):
        b.add_value("cfg.rank", r, "json", [(objs[7], 4 * r, 4)])
    m = b.build()
    m.tree = {"d": [["w", {"d": [["big", 0], ["mine", 0]]}], ["cfg", 0], ["other", 0]]}
    return m


def _entries(part: Any) -> list[tuple[str, int, int]]:
    """(key, rank, shards) of each tensor of a part."""
    ns = part.tensor_nshards.tolist()
    return list(zip(part.tensor_keys, part.tensor_ranks.tolist(), ns, strict=True))


def test_a_shared_part_holds_the_global_entries_and_only_the_shards_that_meet_the_regions() -> None:
    m = _manifest()
    part = PartIndex(m).shared(Wants(("w",), {"w.big": (Box((3, 0), (2, 4)),)}))
    assert _entries(part) == [("w.big", -1, 2)]  # per-rank "w.mine" is in each rank's own part
    assert [part.shard_region(s, (8, 4)) for s in range(2)] == [
        Box((2, 0), (2, 4)),
        Box((4, 0), (2, 4)),
    ]
    # Objects renumbered, names and checksums kept: the chunks still name the right bytes.
    obj = int(part.chunk_object[part.chunks_of(0)[0]])
    assert part.object_names[obj] == m.object_names[1]
    assert part.object_blocks(obj) == m.object_blocks(1)
    assert part.value_keys == []  # "cfg" was not asked for
    assert part.tree == {"d": [["w", {"d": [["big", 0], ["mine", 0]]}]]}
    assert part.nbytes == m.nbytes  # the snapshot's size, not the part's
    assert part.step == m.step and part.topology == m.topology


def test_an_own_part_holds_only_that_ranks_entries() -> None:
    index = PartIndex(_manifest())
    own = index.own([Wants(("w",), {}), Wants(("cfg",), {})], rank=2)
    assert _entries(own) == [("w.mine", 2, 1)]
    assert list(zip(own.value_keys, own.value_ranks.tolist(), strict=True)) == [("cfg.rank", 2)]
    assert own.tree is None


def test_merged_parts_are_one_manifest_in_the_saved_order_with_each_object_once() -> None:
    m = _manifest()
    index = PartIndex(m)
    cfg, w = Wants(("cfg",), {}), Wants(("w",), {})
    merged = merge([index.shared(w), index.shared(cfg), index.own([cfg, w], 0)])
    assert _entries(merged) == [("w.big", -1, 4), ("w.mine", 0, 1)]
    assert list(zip(merged.value_keys, merged.value_ranks.tolist(), strict=True)) == [
        ("cfg.lr", -1),
        ("cfg.rank", 0),
    ]
    assert merged.tree == {"d": [["w", {"d": [["big", 0], ["mine", 0]]}], ["cfg", 0]]}
    assert sorted(merged.object_names) == sorted({m.object_names[i] for i in (0, 1, 2, 3, 4, 6, 7)})
    assert merged.nbytes == m.nbytes
    # What a rank plans against is what the whole manifest says about these entries.
    for t, key in enumerate(merged.tensor_keys):
        (row,) = [
            r
            for r, k in enumerate(m.tensor_keys)
            if k == key and m.tensor_ranks[r] == merged.tensor_ranks[t]
        ]
        assert merged.tensor_shapes[t] == m.tensor_shapes[row]
        assert merged.tensor_dtypes[t] == m.tensor_dtypes[row]


def test_a_rank_the_snapshot_has_no_entries_for_gets_the_lowest_ranks() -> None:
    """On another world size rank 5 has no per-rank entry: its part keeps rank 0's so that the
    load is refused as rank-bound, not as a missing key."""
    own = PartIndex(_manifest()).own([Wants(("w.mine",), {})], rank=5)
    assert _entries(own) == [("w.mine", 0, 1)]


def test_flat_regions_keep_the_shards_their_row_major_span_meets() -> None:
    part = PartIndex(_manifest()).shared(Wants(("w",), {"w.big": (Flat(9, 8),)}))
    assert _entries(part)[0] == ("w.big", -1, 2)  # elements 9..16 lie in rows 2..4


def test_a_top_key_selects_itself_and_what_is_under_it_not_its_namesakes() -> None:
    part = PartIndex(_manifest()).shared(Wants(("w.big", "oth"), {}))
    assert _entries(part) == [("w.big", -1, 4)]


def test_wants_are_classed_by_top_level_key_so_replicas_share_all_but_their_own_slices() -> None:
    """Two data-parallel ranks of a ZeRO layout: the same model shard, each its own optimizer
    slice. They share the model's class and differ only in the optimizer's."""
    model = {"model.w": (Box((0, 0), (4, 8)),)}
    rank0 = Wants(("model", "optim"), {**model, "optim.w": (Flat(0, 16),)})
    rank1 = Wants(("model", "optim"), {**model, "optim.w": (Flat(16, 16),)})
    d0 = [digest_of(c) for c in classes_of(rank0)]
    d1 = [digest_of(c) for c in classes_of(rank1)]
    assert d0[0] == d1[0] and d0[1] != d1[1]
    assert classes_of(rank0)[1] == Wants(("optim",), {"optim.w": (Flat(0, 16),)})
    many = Wants(tuple(f"k{i}" for i in range(MAX_CLASSES + 1)), {})
    assert classes_of(many) == [many]  # a flat dict of many tensors is one class


def test_replicas_share_reads_in_groups_of_bounded_size_split_by_key() -> None:
    """Six ranks: one class for "model" (all six), "optim" their own (ZeRO), "rng" all six.
    With groups of at most 4, ranks 0-3 share, and 4-5; nobody shares its own slice."""
    from trainsnap.protocol.manifest_share import _Plan

    tunables.set_for_testing(tunables.Tunables(replica_group_max=4))
    said = [(["model", f"optim{r}", "rng"], "host") for r in range(6)]
    plan = _Plan(said)  # type: ignore[arg-type]
    assert plan.speakers == [[0, 1, 2], [1], [1], [1], [1], [1]]  # rank 0 speaks for "model", "rng"
    wants = {digest: Wants((digest.rstrip("0123456789"),), {}) for digest in plan.members}
    sharing = [plan._sharing(r, wants, mode=2, local=True) for r in range(6)]
    assert sharing[0] == [((0, 1, 2, 3), ("model", "rng"))]
    assert sharing[3] == sharing[0]
    assert sharing[5] == [((4, 5), ("model", "rng"))]
    assert [plan._sharing(r, wants, mode=1, local=True) for r in range(6)] == [[]] * 6  # one host
    assert plan._sharing(0, wants, mode=0, local=False) == []


def test_classes_of_the_same_ranks_are_one_part_and_merge_back_in_the_tree_order() -> None:
    """One part per distinct set of ranks, not per class: replicas that want the same under
    every key (a reshard to fewer ranks) fetch one part; ranks whose keys alternate between
    shared ones and their own (a ZeRO slice, a tensor-parallel column slice) fetch two, and the
    merge puts the keys back in the saved tree's and tables' order."""
    from trainsnap.protocol.manifest_share import _Plan

    position = {"a": 0, "b": 1, "c": 2, "d": 3}
    replicas = _Plan([(["a", "b", "c", "d"], "host")] * 3)  # type: ignore[arg-type]
    wants = {top: Wants((top,), {}) for top in position}
    assert replicas._bundles(wants, position) == [["a", "b", "c", "d"]]

    # "b" is each rank's own (a ZeRO slice); "a" and "c", "d" are shared.
    said = [(["a", f"b{r}", "c", "d"], "host") for r in range(2)]
    zero = _Plan(said)  # type: ignore[arg-type]
    wants = {d: Wants((d[0],), {}) for d in zero.members}
    assert zero._bundles(wants, position) == [["a", "c", "d"], ["b0"], ["b1"]]

    # Merged from parts cut that way, in any order, a rank's manifest is in the saved order.
    m = _manifest()  # top-level keys w (w.big, w.mine), cfg, other
    index = PartIndex(m)
    shared = index.shared(Wants(("w", "other"), {}))
    own = index.shared(Wants(("cfg",), {}))
    mine = index.own([Wants(("w",), {}), Wants(("cfg",), {})], 1)
    for parts in ([shared, own, mine], [mine, own, shared], [own, mine, shared]):
        merged = merge(parts)
        assert _entries(merged) == [("w.big", -1, 4), ("w.mine", 1, 1), ("other", -1, 1)]
        assert list(zip(merged.value_keys, merged.value_ranks.tolist(), strict=True)) == [
            ("cfg.lr", -1),
            ("cfg.rank", 1),
        ]
        assert [k for k, _ in merged.tree["d"]] == ["w", "cfg", "other"]


# -- four real ranks ------------------------------------------------------------------------------

ROWS, COLS = 8, 6


def _full(key: str) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + ord(key)


def _state(rank: int, world: int, blank: bool) -> dict[str, Any]:
    """Four tensors split in rows over the tensor-parallel pair (tp = rank % 2), replicated
    over the data-parallel pair; a per-rank counter."""
    tp = rank % 2
    rows = ROWS // 2
    out: dict[str, Any] = {}
    for key in ("a", "b", "c", "d"):
        local = _full(key)[tp * rows : (tp + 1) * rows].clone()
        if blank:
            local.zero_()
        out[key] = ts.Sharded(local, global_shape=(ROWS, COLS), offsets=(tp * rows, 0))
    out["count"] = torch.zeros(1) if blank else torch.full((1,), float(rank))
    return out


def _save(rank: int, world: int, root: str) -> None:
    ts.save(_state(rank, world, blank=False), root, step=3, timeout=60)


def _counted_load(rank: int, world: int, root: str) -> dict[str, Any]:
    from trainsnap.protocol import manifest_share
    from trainsnap.storage.posix import PosixStorage

    reads: list[int] = []
    parts: list[Any] = []
    get, share = PosixStorage.get, manifest_share.manifest_for

    def counting_get(self: Any, key: str, *args: Any, **kwargs: Any) -> bytes:
        data: bytes = get(self, key, *args, **kwargs)
        if "/manifest" in key:
            reads.append(len(data))
        return data

    def recording_share(*args: Any, **kwargs: Any) -> Any:
        result = share(*args, **kwargs)
        parts.append(result[0])
        return result

    PosixStorage.get = counting_get  # type: ignore[method-assign]
    manifest_share.manifest_for = recording_share
    state = _state(rank, world, blank=True)
    ts.load(state, root, timeout=60)
    tp = rank % 2
    for key in ("a", "b", "c", "d"):
        want = _full(key)[tp * 4 : (tp + 1) * 4]
        assert torch.equal(state[key].local, want), key
    assert float(state["count"]) == float(rank)
    (part,) = parts
    return {
        "manifest_reads": reads,
        "shards": int(part.tensor_nshards.sum()),
        "tensor_ranks": sorted(set(part.tensor_ranks.tolist())),
    }


def test_a_load_on_four_ranks_reads_the_manifest_once_and_hands_each_rank_its_part(
    tmp_path: Any,
) -> None:
    root = str(tmp_path)
    assert_all_ok(run_ranks(_save, 4, args=(root,), timeout=90))
    sid = commit.resolve(ts.open_storage(root), "latest")
    whole = commit.open_snapshot(ts.open_storage(root), sid)
    assert int(whole.tensor_nshards.sum()) == 4 * 2 + 4  # 4 keys x 2 row shards, 4 counters
    out = assert_all_ok(run_ranks(_counted_load, 4, args=(root,), timeout=120))
    reads = [len(o["manifest_reads"]) for o in out]
    assert reads == [1, 0, 0, 0], reads  # the coordinator's read, nobody else's
    # Each rank's part: its row shard of each key (shared with its replica: ranks 0 and 2, 1
    # and 3), not the other one, and its own counter, not the other ranks'.
    assert [o["shards"] for o in out] == [4 + 1] * 4
    assert [o["tensor_ranks"] for o in out] == [[-1, r] for r in range(4)]


def _save_one(rank: int, world: int, root: str) -> None:
    ts.save({"w": torch.full((4,), 7.0)}, root, step=1)


def _load_one_or_nothing(rank: int, world: int, root: str) -> Any:
    state: dict[str, Any] = {"w": torch.zeros(4)} if rank == 0 else {}
    ts.load(state, root)
    return state["w"].tolist() if state else None


def test_a_rank_whose_state_asks_for_nothing_fetches_no_part(tmp_path: Any) -> None:
    """A rank loading an empty state has no classes: it fetches nothing (not the whole
    manifest, which no rank asked for), and the others load as usual."""
    assert_all_ok(run_ranks(_save_one, 2, args=(str(tmp_path),)))
    loaded = assert_all_ok(run_ranks(_load_one_or_nothing, 2, args=(str(tmp_path),)))
    assert loaded == [[7.0] * 4, None]


def _load_counting_lists(rank: int, world: int, root: str, snapshot: str) -> Any:
    """Load ``snapshot``; (the error raised or None, how often this rank listed the root)."""
    from trainsnap.storage.posix import PosixStorage

    lists = []
    listing = PosixStorage.list

    def counting_list(self: Any, prefix: str = "") -> Any:
        lists.append(prefix)
        return listing(self, prefix)

    PosixStorage.list = counting_list  # type: ignore[method-assign]
    state = {"w": torch.zeros(4)}
    try:
        ts.load(state, root, snapshot=snapshot, timeout=60)
    except ts.TrainsnapError as e:
        return type(e).__name__, str(e), len(lists)
    return None, state["w"].tolist(), len(lists)


@pytest.mark.parametrize("saved", [False, True])
def test_the_coordinator_alone_resolves_and_its_failure_is_every_ranks(
    tmp_path: Any, saved: bool
) -> None:
    """Only the coordinator lists the root to resolve "latest"; when there is nothing to
    resolve, or the id names no snapshot, every rank raises the coordinator's error (the
    others saying it was found there), and no rank waits for another."""
    root = str(tmp_path)
    if saved:
        assert_all_ok(run_ranks(_save_one, 2, args=(root,)))
    latest = assert_all_ok(run_ranks(_load_counting_lists, 3, args=(root, "latest"), timeout=90))
    assert [lists for *_, lists in latest][1:] == [0, 0]
    assert latest[0][2] >= 1
    if saved:
        assert [(error, w) for error, w, _ in latest] == [(None, [7.0] * 4)] * 3
    else:
        why = f"no committed snapshot in {root}; save one first, or check the root"
        told = f"{why} (found by the coordinator, rank 0)"
        assert [(e, w) for e, w, _ in latest] == [("NotFoundError", why)] + [
            ("NotFoundError", told)
        ] * 2
    missing = "step-000000000099-0123abcd"
    named = assert_all_ok(run_ranks(_load_counting_lists, 3, args=(root, missing), timeout=90))
    assert {error for error, _, _ in named} == {"NotFoundError"}
    assert all(missing in why for _, why, _ in named)
    assert [why.endswith("(found by the coordinator, rank 0)") for _, why, _ in named] == [
        False,
        True,
        True,
    ]
