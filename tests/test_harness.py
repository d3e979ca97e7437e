"""The multi-rank harness reports every way a rank can end: a value, an exception, a SIGKILL,
a hang past the deadline; and gives each rank its own process group and environment.

The rank functions are module-level so that spawned children can import them by reference.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from trainsnap.testing import RankResult, assert_all_ok, errors_by_rank, run_ranks

# --- rank functions ----------------------------------------------------------------------------


def _all_reduce_sum(rank: int, world_size: int, scale: float, *, offset: float = 0.0) -> dict:
    t = torch.tensor([rank * scale + offset, 1.0])
    dist.all_reduce(t)
    return {
        "sum": t.tolist(),
        "pg_rank": dist.get_rank(),
        "pg_world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "threads": torch.get_num_threads(),
        "env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TRAINSNAP_RANK")},
    }


def _tcp_store_round(rank: int, world_size: int) -> dict:
    """An all-reduce and a store round trip over the tcp rendezvous, and the store's kind."""
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    store = dist.distributed_c10d._get_default_store()
    store.set(f"from/{rank}", str(rank))
    store.wait([f"from/{r}" for r in range(world_size)])
    clone = store.clone()  # what the control plane connects per session
    return {
        "sum": t.item(),
        "seen": [store.get(f"from/{r}").decode() for r in range(world_size)],
        "store": type(getattr(store, "underlying_store", store)).__name__,
        "clone_sees": clone.get(f"from/{(rank + 1) % world_size}").decode(),
    }


def _raise_on_rank(rank: int, world_size: int, bad_rank: int) -> int:
    if rank == bad_rank:
        raise ValueError(f"rank {rank} refuses")
    return rank * 10


def _sigkill_on_rank(rank: int, world_size: int, bad_rank: int) -> int:
    if rank == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def _hang_on_rank(rank: int, world_size: int, bad_rank: int) -> int:
    if rank == bad_rank:
        while True:
            time.sleep(60)
    return rank


def _no_process_group(rank: int, world_size: int) -> tuple[bool, int]:
    return dist.is_initialized(), rank


def _read_env(rank: int, world_size: int, names: list[str]) -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in names}


def _unpicklable(rank: int, world_size: int) -> object:
    return lambda: rank


# --- tests -------------------------------------------------------------------------------------


def test_four_ranks_all_reduce_and_return_their_values():
    results = run_ranks(_all_reduce_sum, world_size=4, args=(2.0,), kwargs={"offset": 0.5})
    values = assert_all_ok(results)
    assert [r.rank for r in results] == [0, 1, 2, 3]
    for rank, v in enumerate(values):
        # (0 + 2 + 4 + 6) + 4 * 0.5 on every rank, and a count of 4 ranks.
        assert v["sum"] == [14.0, 4.0]
        assert (v["pg_rank"], v["pg_world"], v["backend"]) == (rank, 4, "gloo")
        assert v["threads"] == 1
        assert v["env"] == {
            "RANK": str(rank),
            "WORLD_SIZE": "4",
            "LOCAL_RANK": str(rank),
            "TRAINSNAP_RANK": str(rank),
        }
    assert all(r.exitcode == 0 and not r.killed and not r.timed_out for r in results)
    assert errors_by_rank(results) == {}


def test_a_tcp_rendezvous_hosts_a_tcp_store_every_rank_and_its_clones_reach():
    values = assert_all_ok(run_ranks(_tcp_store_round, world_size=3, rendezvous="tcp"))
    for rank, v in enumerate(values):
        assert v["sum"] == 3.0 and v["seen"] == ["0", "1", "2"]
        assert v["store"] == "TCPStore" and v["clone_sees"] == str((rank + 1) % 3)


def test_an_exception_is_reported_with_message_and_traceback():
    results = run_ranks(_raise_on_rank, world_size=3, args=(1,), init_pg=False, timeout=60)
    bad = results[1]
    assert bad.value is None and bad.exitcode == 1 and not bad.killed and not bad.timed_out
    assert bad.error is not None
    assert "ValueError: rank 1 refuses" in bad.error
    assert "Traceback (most recent call last)" in bad.error
    assert "_raise_on_rank" in bad.error  # the frame that raised
    assert [(r.value, r.error, r.exitcode) for r in (results[0], results[2])] == [
        (0, None, 0),
        (20, None, 0),
    ]
    errors = errors_by_rank(results)
    assert list(errors) == [1] and "rank 1 refuses" in errors[1]
    with pytest.raises(AssertionError, match=r"1 of 3 ranks failed(.|\n)*rank 1 refuses"):
        assert_all_ok(results)


def test_a_sigkilled_rank_is_reported_killed_and_the_others_succeed():
    results = run_ranks(_sigkill_on_rank, world_size=2, args=(0,), init_pg=False, timeout=60)
    assert results[0] == RankResult(rank=0, value=None, error=None, exitcode=-9, killed=True)
    assert (results[1].value, results[1].ok, results[1].killed) == (1, True, False)
    assert list(errors_by_rank(results)) == [0] and "SIGKILL" in errors_by_rank(results)[0]


def test_a_hung_rank_is_killed_at_the_deadline_and_reported_timed_out():
    start = time.monotonic()
    results = run_ranks(_hang_on_rank, world_size=2, args=(0,), init_pg=False, timeout=10)
    elapsed = time.monotonic() - start
    assert 10 <= elapsed < 20
    hung, fine = results
    assert hung.timed_out and hung.killed and hung.exitcode == -9 and hung.value is None
    assert fine.ok and fine.value == 1 and not fine.timed_out
    assert "timed out" in errors_by_rank(results)[0]


def test_without_init_pg_there_is_no_process_group():
    results = run_ranks(_no_process_group, world_size=2, init_pg=False, timeout=60)
    assert assert_all_ok(results) == [(False, 0), (False, 1)]


def test_rank_env_reaches_only_its_rank_and_env_reaches_all(monkeypatch):
    monkeypatch.delenv("TRAINSNAP_FAULTS", raising=False)
    names = ["TRAINSNAP_FAULTS", "HARNESS_COMMON"]
    results = run_ranks(
        _read_env,
        world_size=2,
        args=(names,),
        env={"HARNESS_COMMON": "yes"},
        rank_env={1: {"TRAINSNAP_FAULTS": "mid_write=crash"}},
        init_pg=False,
        timeout=60,
    )
    assert assert_all_ok(results) == [
        {"TRAINSNAP_FAULTS": None, "HARNESS_COMMON": "yes"},
        {"TRAINSNAP_FAULTS": "mid_write=crash", "HARNESS_COMMON": "yes"},
    ]


def test_an_unpicklable_return_value_is_an_error_not_a_hang():
    (result,) = run_ranks(_unpicklable, world_size=1, init_pg=False, timeout=60)
    assert result.exitcode == 1 and result.value is None
    assert result.error is not None and "not picklable" in result.error


def test_bad_arguments_fail_in_the_parent_before_any_spawn():
    with pytest.raises(TypeError, match="module-level"):
        run_ranks(lambda rank, world_size: None, world_size=1)
    with pytest.raises(ValueError, match="outside"):
        run_ranks(_read_env, world_size=2, args=([],), rank_env={2: {}})
