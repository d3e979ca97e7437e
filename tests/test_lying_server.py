"""Object-store reads bounded in bytes and time against a server that lies
(:mod:`trainsnap.testing.lying_s3`): every answer of ``list_snapshots``, ``ts.read`` and
``CheckpointManager.restore`` comes within a stated deadline, as a TrainsnapError, with peak memory
under twice the largest cap beyond what the library takes once imported and warmed up (an
honest list, read and restore against the same server).

The probes run in one subprocess (a fresh interpreter's peak RSS is what is measured), with the
store's limits turned down by their environment variables so that each answer comes in seconds:
a request may take 1.5 s, retries 3 s in all, a whole read 16 MiB, a listing 5,000 keys. A
listing skips a snapshot whose marker cannot be read (with a warning), as for other damage: its
answer is then a shorter list, in time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import trainsnap

pytest.importorskip("s3fs")

CAP = 16 << 20
LIMITS = {
    "TRAINSNAP_STORE_REQUEST_SECONDS": "1.5",
    "TRAINSNAP_STORE_RETRY_SECONDS": "3",
    "TRAINSNAP_STORE_WHOLE_READ": str(CAP),
    "TRAINSNAP_STORE_LIST_KEYS": "5000",
}
DEADLINE = 30.0
"""Seconds within which every answer comes (with the limits above)."""

PROBE = r"""
import json, resource, sys, time
import torch, trainsnap as ts
from trainsnap.testing.lying_s3 import LyingS3

def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10

answers = []
with LyingS3() as s3:
    s3.drip_seconds = 0.2
    url, opts = s3.url("run"), s3.options
    for step in (1, 2):
        ts.save({"w": torch.ones(4) * step}, url, step=step, storage_options=opts)
    manager = ts.ManagerOptions(preemption_signals=())
    ops = {
        "list": lambda: ts.list_snapshots(url, storage_options=opts),
        "read": lambda: ts.read(url, storage_options=opts),
        "restore": lambda: ts.CheckpointManager(url, storage_options=opts, options=manager)
        .__enter__().restore({"w": torch.zeros(4)}),
    }
    for op in ops.values():  # honest: the library and its S3 client imported, warmed up
        op()
    imported = rss()
    for lie, op in json.loads(sys.argv[1]):
        s3.lie = lie
        began = time.perf_counter()
        try:
            ops[op]()
            kind = None
        except ts.TrainsnapError as e:
            kind = f"{type(e).__name__}: {str(e)[:200]}"
        except Exception as e:
            kind = f"RAW {type(e).__module__}.{type(e).__name__}: {str(e)[:200]}"
        answers.append([lie, op, time.perf_counter() - began, kind, rss() - imported])
        s3.lie = None
print(json.dumps(answers))
"""


def _probe(cases: list[tuple[str, str]]) -> list[list[Any]]:
    env = {**os.environ, **LIMITS}
    src = str(Path(trainsnap.__file__).resolve().parents[1])  # the trainsnap under test
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=DEADLINE * len(cases) + 120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answers: list[list[Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return answers


CASES = [
    ("oversized", "list"),
    ("oversized", "restore"),
    ("storm", "read"),
    ("endless", "read"),
    ("bomb", "read"),
    ("truncated", "restore"),
    ("drip", "restore"),
]


def test_every_answer_of_a_lying_store_is_a_trainsnap_error_in_time_and_memory() -> None:
    """Hostile suite 3: HEAD answering a marker's size while GET streams 1.5 GiB took
    list_snapshots to 1.8 GB and MemoryError; a dripped body held a reader as long as the server
    liked; an endless listing grew without bound; 503 to every request failed after 77-82 s with
    a raw OSError; a truncated body was a raw OSError; an entity bomb came back as "Internal
    Server Error"."""
    answers = _probe(CASES)
    for lie, op, seconds, kind, grown in answers:
        where = f"{lie}/{op}"
        if not (lie in ("oversized", "drip", "truncated") and op == "list"):
            assert kind is not None and not kind.startswith("RAW"), (where, kind)
        assert seconds < DEADLINE, (where, seconds)
        assert grown < 2 * CAP, (where, grown >> 20)
    kinds = {(lie, op): str(kind) for lie, op, _, kind, _ in answers}
    assert "StoreRefusedError" in kinds[("oversized", "restore")]
    assert "StoreUnavailableError" in kinds[("storm", "read")]
    assert "SlowDown" in kinds[("storm", "read")] or "reduce" in kinds[("storm", "read")]
    assert "does not end" in kinds[("endless", "read")]


@pytest.mark.slow
def test_every_lie_against_every_entry_point() -> None:
    from trainsnap.testing.lying_s3 import LIES

    answers = _probe([(lie, op) for lie in LIES for op in ("list", "read", "restore")])
    for lie, op, seconds, kind, grown in answers:
        assert seconds < DEADLINE and grown < 2 * CAP, (lie, op, seconds, grown)
        assert kind is None or not kind.startswith("RAW"), (lie, op, kind)
