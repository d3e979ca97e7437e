"""Strict resume: a run killed and restarted continues the same trajectory, bitwise on one
process and sample-exact across data-parallel sizes; missing pieces refuse strict loudly."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import trainsnap as ts
from tinytrain import TinyLM, elastic_run, single_process_run
from trainsnap.testing import assert_all_ok, run_ranks

TOTAL, SAVE_EVERY, KILL_AFTER = 40, 4, 21


def _losses(out: Path) -> dict[int, tuple[str, str]]:
    rows = {}
    for line in (out / "losses.txt").read_text().splitlines():
        step, loss, scale = line.split()
        rows[int(step)] = (loss, scale)  # a restarted run rewrites steps after its snapshot
    return rows


def test_killed_and_restarted_run_continues_bitwise(tmp_path):
    ref, crash = tmp_path / "ref", tmp_path / "crash"
    for d in (ref, crash):
        d.mkdir()
    args = (TOTAL, SAVE_EVERY)
    assert_all_ok(
        run_ranks(
            single_process_run,
            1,
            args=(str(ref / "ckpt"), str(ref), *args, None),
            init_pg=False,
            timeout=240,
        )
    )
    killed = run_ranks(
        single_process_run,
        1,
        args=(str(crash / "ckpt"), str(crash), *args, KILL_AFTER),
        init_pg=False,
        timeout=240,
    )
    assert killed[0].killed and not killed[0].timed_out
    assert max(_losses(crash)) == KILL_AFTER
    assert_all_ok(
        run_ranks(
            single_process_run,
            1,
            args=(str(crash / "ckpt"), str(crash), *args, None),
            init_pg=False,
            timeout=240,
        )
    )

    want, got = _losses(ref), _losses(crash)
    restored = max(s for s in range(KILL_AFTER + 1) if s % SAVE_EVERY == 0)
    assert restored == 20
    for step in range(restored + 1, TOTAL):
        assert got[step] == want[step], f"step {step}: {got[step]} != {want[step]}"
    scales = {want[s][1] for s in range(TOTAL)}
    assert len(scales) > 3, "the loss scale must change during the run"
    assert (crash / "scale.txt").read_text() == (ref / "scale.txt").read_text()
    a, b = torch.load(ref / "final.pt"), torch.load(crash / "final.pt")
    for k in a:
        assert torch.equal(a[k], b[k]), k


SAVE_AT, TOTAL_DP = 5, 12


@pytest.mark.parametrize("resume_world", [1, 4])
def test_elastic_resume_on_another_data_parallel_size(tmp_path, resume_world):
    """2 ranks train and save at step 5; resumed on 1 or 4 ranks with the same global batch,
    the run sees the same global sample ids in the same order, and the same losses up to
    floating-point summation order (the batch mean and the gradient all-reduce add in a
    different order on another number of ranks: ~1e-7 relative per step, far below 1e-4)."""
    ref_root, root = str(tmp_path / "ref"), str(tmp_path / "run")
    ref = assert_all_ok(
        run_ranks(elastic_run, 2, args=(ref_root, str(tmp_path), (0, TOTAL_DP), -1), timeout=240)
    )[0]
    first = assert_all_ok(
        run_ranks(
            elastic_run, 2, args=(root, str(tmp_path), (0, SAVE_AT + 1), SAVE_AT), timeout=240
        )
    )[0]
    assert first == ref[: SAVE_AT + 1]
    if resume_world == 1:
        resumed = assert_all_ok(
            run_ranks(
                elastic_run,
                1,
                args=(root, str(tmp_path), (0, TOTAL_DP), -1),
                init_pg=False,
                timeout=240,
            )
        )[0]
    else:
        resumed = assert_all_ok(
            run_ranks(elastic_run, 4, args=(root, str(tmp_path), (0, TOTAL_DP), -1), timeout=240)
        )[0]
    assert [r[0] for r in resumed] == list(range(SAVE_AT + 1, TOTAL_DP))
    want = {r[0]: r for r in ref}
    worst = 0.0
    for step, ids, loss in resumed:
        assert ids == want[step][1], f"step {step}: sample ids differ"
        a, b = float.fromhex(loss), float.fromhex(want[step][2])
        worst = max(worst, abs(a - b) / abs(b))
        assert abs(a - b) <= 1e-4 * abs(b), (step, a, b)
    print(f"resumed on {resume_world} ranks: largest relative loss difference {worst:.2e}")


# -- levels ----------------------------------------------------------------------------------------


def _state(**kw):
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, ts.TrainState(model, opt, **kw)


def _train_one(model, opt):
    batch = torch.randint(0, 61, (2, 13))
    from tinytrain import lm_loss

    lm_loss(model, batch).backward()
    opt.step()


def test_a_snapshot_without_rng_refuses_strict_and_says_why(tmp_path, caplog):
    model, opt, st = _state(rng=False)
    _train_one(model, opt)
    info = ts.save(st, tmp_path, step=3)
    assert info.level == "training"
    _, _, fresh = _state()
    with pytest.raises(ts.IncompatibleError, match="no rng state") as e:
        ts.load(fresh, tmp_path)
    assert "allow_downgrade" in str(e.value)
    got = ts.load(fresh, tmp_path, allow_downgrade=True)
    assert got.level == "training"
    assert any(
        "level=training" in r.getMessage()
        for r in caplog.records
        if r.name == "trainsnap.api.snapshots"
    )
    assert any("instead of 'strict'" in r.getMessage() for r in caplog.records)


def test_a_snapshot_without_data_state_refuses_strict(tmp_path):
    _model, _opt, st = _state()
    ts.save(st, tmp_path, step=1)
    sampler = ts.ElasticSampler(64, global_batch_size=8)
    _, _, fresh = _state(dataloader=sampler)
    with pytest.raises(ts.IncompatibleError, match="no data state"):
        ts.load(fresh, tmp_path)
    assert ts.load(fresh, tmp_path, level="training").level == "training"


def test_a_changed_model_version_refuses_strict(tmp_path, caplog):
    _model, _opt, st = _state(versions={"model": "v1", "code": "abc"})
    ts.save(st, tmp_path, step=1)
    _, _, fresh = _state(versions={"model": "v2", "code": "abc"})
    with pytest.raises(ts.IncompatibleError, match="model version changed from 'v1' to 'v2'"):
        ts.load(fresh, tmp_path)
    assert ts.load(fresh, tmp_path, level="training").level == "training"
    assert any(
        "model version changed" in r.getMessage()
        for r in caplog.records
        if r.levelname == "WARNING"
    )


def test_weights_level_restores_only_the_model(tmp_path):
    model, opt, st = _state()
    _train_one(model, opt)
    ts.save(st, tmp_path, step=1)
    m2, o2, fresh = _state()
    info = ts.load(fresh, tmp_path, level="weights")
    assert info.level == "weights"
    for (k, a), b in zip(model.state_dict().items(), m2.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert not o2.state  # optimizer untouched


def test_parameters_without_gradients_keep_no_optimizer_state(tmp_path):
    model, opt, st = _state()
    _train_one(model, opt)
    assert model.unused.weight not in opt.state
    ts.save(st, tmp_path, step=1)
    m2, o2, fresh = _state()
    ts.load(fresh, tmp_path)
    assert m2.unused.weight not in o2.state
    for p, q in zip(model.parameters(), m2.parameters(), strict=True):
        if p in opt.state:
            for k, v in opt.state[p].items():
                assert torch.equal(v, o2.state[q][k]), k


def test_mid_accumulation_save_restores_gradients(tmp_path):
    model, _opt, st = _state(grads=True, extra={"micro_batch": 0})
    from tinytrain import lm_loss

    lm_loss(model, torch.randint(0, 61, (2, 13))).backward()
    st.extra["micro_batch"] = 1
    ts.save(st, tmp_path, step=7)
    m2, _, fresh = _state(grads=True, extra={"micro_batch": 0})
    ts.load(fresh, tmp_path)
    assert fresh.extra["micro_batch"] == 1
    for (n, p), q in zip(model.named_parameters(), m2.parameters(), strict=True):
        if p.grad is None:
            assert q.grad is None, n
        else:
            assert torch.equal(p.grad, q.grad), n


def test_a_plain_dict_restores_at_strict_from_any_snapshot(tmp_path):
    model, _opt, st = _state(rng=False)
    ts.save(st, tmp_path, step=1)
    dst = {"model": {"head.bias": torch.zeros(61)}}
    assert ts.load(dst, tmp_path).level == "strict"
    assert torch.equal(dst["model"]["head.bias"], model.head.bias.detach())


class FP8Meta(torch.nn.Module):
    """Like Transformer Engine's FP8 modules: amax history and scales as module extra state."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.amax_history = torch.zeros(16, 2)
        self.scale = torch.ones(2)

    def get_extra_state(self):
        return {"amax_history": self.amax_history, "scale": self.scale, "recipe": "delayed"}

    def set_extra_state(self, state):
        self.amax_history.copy_(state["amax_history"])
        self.scale.copy_(state["scale"])


def test_fp8_amax_history_travels_as_module_extra_state(tmp_path):
    m = FP8Meta()
    m.amax_history.copy_(torch.rand(16, 2))
    m.scale.fill_(0.125)
    ts.save(ts.TrainState(m), tmp_path, step=1)
    m2 = FP8Meta()
    ts.load(ts.TrainState(m2), tmp_path)
    assert torch.equal(m2.amax_history, m.amax_history) and torch.equal(m2.scale, m.scale)


def test_a_fresh_optimizer_of_another_kind_is_refused_before_it_is_changed(tmp_path) -> None:
    """A saved AdamW loaded into a fresh SGD: the SGD has no state to compare moments with, so
    its hyper-parameters tell; torch would take ``betas`` silently and fail at the next step."""
    model = torch.nn.Linear(4, 2)
    adamw = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    adamw.step()
    ts.save(ts.TrainState(model, adamw, no_data_order=True), tmp_path, step=1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = [dict(g) for g in sgd.param_groups]
    with pytest.raises(ts.IncompatibleError, match="betas"):
        ts.load(ts.TrainState(model, sgd, no_data_order=True), tmp_path)
    assert [dict(g) for g in sgd.param_groups] == before
    again = torch.optim.AdamW(model.parameters())
    assert ts.load(ts.TrainState(model, again, no_data_order=True), tmp_path).level == "strict"
    assert again.state_dict()["state"][0]["step"] == adamw.state_dict()["state"][0]["step"]


# -- a downgrade keeps what is still valid -------------------------------------------------------

DOWN_BATCH, DOWN_SAMPLES, DOWN_SAVE_AT, DOWN_TOTAL = 4, 24, 7, 11  # 6 steps an epoch


def _downgrade_objects(rank: int, world: int) -> tuple[torch.nn.Module, Any, Any, ts.TrainState]:
    random.seed(rank)  # Python's and NumPy's streams differ per rank: saved per rank
    np.random.seed(rank)
    torch.manual_seed(0)  # torch's is alike on every rank: stored once
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = ts.ElasticSampler(
        DOWN_SAMPLES, global_batch_size=DOWN_BATCH, seed=3, rank=rank, world_size=world
    )
    loader = torch.utils.data.DataLoader(
        range(DOWN_SAMPLES), batch_size=DOWN_BATCH // world, sampler=sampler
    )
    return model, sampler, loader, ts.TrainState(model, opt, dataloader=loader)


def _downgrade_steps(objs: Any, start: int, world: int, root: str | None) -> list[list[int]]:
    """Steps ``start``..DOWN_TOTAL-1: the global sample ids of each (every rank's, in rank
    order); saved to ``root`` after step DOWN_SAVE_AT when given."""
    _model, sampler, loader, state = objs
    rows = []
    it = iter(loader)
    for step in range(start, DOWN_TOTAL):
        try:
            ids = next(it)
        except StopIteration:
            it = iter(loader)
            ids = next(it)
        every = [ids]
        if world > 1:
            every = [torch.zeros_like(ids) for _ in range(world)]
            torch.distributed.all_gather(every, ids)
        rows.append([int(i) for part in every for i in part])
        sampler.step()
        if root is not None and step == DOWN_SAVE_AT:
            ts.save(state, root, step=step, timeout=60)
    return rows


def _two_ranks_save(rank: int, world: int, root: str) -> list[list[int]]:
    return _downgrade_steps(_downgrade_objects(rank, world), 0, world, root)


def test_a_downgrade_to_one_process_keeps_the_global_data_cursor_and_says_what_it_dropped(
    tmp_path, caplog
):
    """2 ranks with per-rank Python and NumPy RNG and an ElasticSampler, resumed on one process
    with allow_downgrade: the same global samples in the same order, level 'training', and
    each component listed -- the data cursor and torch's generator restored, Python's and
    NumPy's not, because they were per rank."""
    root = str(tmp_path)
    reference = assert_all_ok(run_ranks(_two_ranks_save, 2, args=(root,), timeout=240))[0]
    with pytest.raises(ts.IncompatibleError, match="python RNG state is per rank"):
        ts.load(_downgrade_objects(0, 1)[3], root)
    _model, sampler, _loader, state = objs = _downgrade_objects(0, 1)
    info = ts.load(state, root, allow_downgrade=True)
    assert info.level == "training"
    components = {c.name: (c.restored, c.why) for c in info.components}
    assert components["data"] == (True, "")
    assert components["rng.torch"] == (True, "")
    for gen in ("python", "numpy"):
        restored, why = components[f"rng.{gen}"]
        assert not restored
        assert f"the {gen} RNG state is per rank" in why and "from 2 to 1 ranks" in why, why
    assert {"model", "optimizer"} <= {n for n, (done, _) in components.items() if done}
    assert any("per rank" in r for r in info.reasons), info.reasons
    assert sampler.consumed == (DOWN_SAVE_AT + 1) * DOWN_BATCH
    rows = _downgrade_steps(objs, DOWN_SAVE_AT + 1, 1, None)
    assert rows == reference[DOWN_SAVE_AT + 1 :]
    lines = [r.getMessage() for r in caplog.records if r.name == "trainsnap.api.snapshots"]
    assert any("restored=model,optimizer,rng.torch,data" in line for line in lines), lines
    assert any("not_restored='rng.python: the python RNG" in line for line in lines), lines
