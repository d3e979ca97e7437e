"""Save and retention policies (pure)."""

from __future__ import annotations

import pytest

import trainsnap as ts
from trainsnap.manager.policies import Candidate, StepInfo, parse_duration, to_delete


def test_daly_vectors_from_the_paper():
    # Daly 2006: 5 min cost with MTBF 24 h / 6 h / 15 min.
    for mtbf_min, want in [(24 * 60, 116.69), (6 * 60, 56.71), (15, 9.14)]:
        got = ts.daly_interval(5 * 60, mtbf_min * 60) / 60
        assert got == pytest.approx(want, abs=0.005), (mtbf_min, got)


def test_young_and_daly_limits():
    assert ts.young_interval(5 * 60, 24 * 3600) / 60 == pytest.approx(120.0)
    assert ts.daly_interval(100, 40) == 40  # cost beyond 2 MTBF: save every MTBF
    assert ts.daly_interval(1, 1e9) < ts.young_interval(1, 1e9)
    with pytest.raises(ts.InvalidArgumentError):
        ts.daly_interval(0, 10)


def test_durations():
    assert parse_duration("30s") == 30 and parse_duration("4h") == 14400
    assert parse_duration("1h30m") == 5400 and parse_duration("90") == 90
    with pytest.raises(ts.InvalidArgumentError):
        parse_duration("soon")


def _info(step, last=None, last_t=None, now=0.0, costs=(), times=()):
    return StepInfo(step, now, last, last_t, tuple(costs), tuple(times))


def test_every_steps_and_seconds():
    p = ts.Every(steps=10)
    assert [s for s in range(35) if p.should_save(_info(s))] == [0, 10, 20, 30]
    assert not p.shared
    q = ts.Every(seconds=60)
    assert q.shared
    assert not q.should_save(_info(5, 0, 100.0, now=150.0))
    assert q.should_save(_info(6, 0, 100.0, now=161.0))
    with pytest.raises(ts.InvalidArgumentError):
        ts.Every()
    with pytest.raises(ts.InvalidArgumentError):
        ts.Every(steps=0)


def test_young_daly_turns_measurements_into_steps():
    p = ts.YoungDaly(mtbf=6 * 3600, first_after_steps=7)
    # Nothing measured yet: the first save after first_after_steps.
    assert not p.should_save(_info(5)) and p.should_save(_info(6))
    # Save cost 300 s, step 10 s: Daly says 3402.8 s -> 340 steps.
    info = _info(1000, last=900, costs=[300.0] * 3, times=[10.0] * 20)
    assert p.interval_steps(info) == 340
    assert not p.should_save(_info(1239, 900, costs=[300.0], times=[10.0]))
    assert p.should_save(_info(1240, 900, costs=[300.0], times=[10.0]))
    # The observed MTBF is used when none is given.
    obs = StepInfo(10, 0, 0, 0, (300.0,), (10.0,), mtbf_observed=15 * 60)
    assert ts.YoungDaly().interval_steps(obs) == 55  # 548.5 s / 10 s


def test_retention_over_25_steps():
    # Loss falls steadily except a dip at step 7, the best of all.
    cands = [Candidate(f"s{i}", i, {"loss": 10.0 - i if i != 7 else -100.0}) for i in range(25)]
    policies = [ts.KeepLast(2), ts.KeepEvery(10), ts.KeepBest("loss", "min", 1)]
    kept = {c.step for c in cands} - {c.step for c in to_delete(cands, policies, set())}
    assert kept == {0, 10, 20, 23, 24, 7}


def test_retention_never_deletes_the_newest_pinned_or_protected():
    cands = [Candidate(f"s{i}", i, tags=("release",) if i == 3 else ()) for i in range(6)]
    gone = to_delete(cands, [ts.KeepEvery(100)], protected={"s4"})
    assert {c.step for c in gone} == {1, 2}  # 0: KeepEvery; 3: pinned; 4: in flight; 5: newest
    assert to_delete(cands, [], set()) == []  # no policy: keep everything


def test_keep_best_max_and_missing_metrics():
    cands = [
        Candidate("a", 1, {"acc": 0.5}),
        Candidate("b", 2, {}),
        Candidate("c", 3, {"acc": 0.9}),
    ]
    assert ts.KeepBest("acc", "max", 1).keep(cands) == {"c"}
    assert ts.KeepBest("acc", "min", 5).keep(cands) == {"a", "c"}
    with pytest.raises(ts.InvalidArgumentError):
        ts.KeepBest("acc", "median")
