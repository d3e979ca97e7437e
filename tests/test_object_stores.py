"""trainsnap on real object stores: writer fencing under contention on a real S3 server
(SeaweedFS), on Azure Blob (Azurite, Microsoft's emulator) and on Google Cloud Storage
(fake-gcs-server), delete-then-load there, and the conditional-create probe that refuses a store
which ignores preconditions (``rclone serve s3``, and a wrapper store that does the same) and
accepts Azure's and GCS's."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import trainsnap as ts
from s3_fixture import AzRoot, GcsRoot, S3Root
from trainsnap.errors import CommitFailedError, InvalidArgumentError, NotFoundError
from trainsnap.manager.lease import Lease, check_fencing
from trainsnap.storage import Storage, open_storage
from trainsnap.storage.base import Buffer
from trainsnap.testing import assert_all_ok, run_ranks

TAKERS = 4
ROUNDS = 40


def _take_rounds(
    rank: int, world: int, roots: list[tuple[str, dict[str, str]]], rounds: int
) -> list[list[Any]]:
    """On each root in turn, each round: every rank takes the root at the same moment, then
    asks whether it may commit. Returns, per root and round, (generation taken, may commit) or
    the error it got."""
    import torch.distributed as dist

    per_root: list[list[Any]] = []
    for url, options in roots:
        storage = open_storage(url, **options)
        out: list[Any] = []
        for _ in range(rounds):
            dist.barrier()
            try:
                lease = Lease.take(storage)
            except Exception as e:  # recorded, not raised: the test names every one
                out.append(("error", f"{type(e).__name__}: {e}"))
                dist.barrier()
                continue
            dist.barrier()  # every take of this round is done before anyone checks
            try:
                lease.check()
                out.append((lease.generation, True))
            except CommitFailedError:
                out.append((lease.generation, False))
        per_root.append(out)
    return per_root


def _stored_generations(storage: Storage) -> set[int]:
    """The generations whose lease files the root still lists."""
    prefix = "lease/gen-"
    return {int(k.removeprefix(prefix)) for k in storage.list("lease/") if k.startswith(prefix)}


@pytest.mark.s3
@pytest.mark.slow
def test_concurrent_takes_on_seaweedfs_fence_one_writer(seaweed_root: S3Root) -> None:
    """4 processes take one root at once, 40 rounds: every take wins a generation of its own
    (a lost create moves on to the next number, never raises), and exactly one taker per round
    -- the newest -- may commit."""
    _check_concurrent_takes(
        [(seaweed_root.url, {"endpoint_url": seaweed_root.endpoint}, seaweed_root.open())], ROUNDS
    )


CLOUD_ROUNDS = 10
"""Rounds on the Azure and GCS emulators: fewer than on SeaweedFS (its 40 run in the slow
suite), so that every run checks the fence there in seconds."""


@pytest.fixture(
    params=[pytest.param("az", marks=pytest.mark.az), pytest.param("gcs", marks=pytest.mark.gcs)]
)
def cloud_root(request: pytest.FixtureRequest) -> AzRoot | GcsRoot:
    """A fresh root on Azure Blob (Azurite) or on Google Cloud Storage (fake-gcs-server)."""
    root: AzRoot | GcsRoot = request.getfixturevalue(f"{request.param}_root")
    return root


@pytest.mark.az
@pytest.mark.gcs
def test_concurrent_takes_on_azure_and_gcs_fence_one_writer(request: pytest.FixtureRequest) -> None:
    """The same on Azure Blob (``If-None-Match: *`` refused with 409 ``BlobAlreadyExists``,
    which adlfs makes a ``FileExistsError``) and on GCS (``ifGenerationMatch=0`` refused with
    412, which gcsfs makes a ``FileExistsError``), in one set of processes (starting them is
    most of the time); a store whose emulator is not there is left out, and named."""
    roots: list[tuple[str, dict[str, str], Storage]] = []
    missing = []
    for name in ("az_root", "gcs_root"):
        try:
            root: AzRoot | GcsRoot = request.getfixturevalue(name)
        except pytest.skip.Exception as e:
            missing.append(str(e))
            continue
        roots.append((root.url, root.options, root.open()))
    if not roots:
        pytest.skip("; ".join(missing))
    _check_concurrent_takes(roots, CLOUD_ROUNDS)
    if missing:  # checked where it could be; said in the summary where it could not
        warnings.warn(f"fencing checked on {roots[0][0]} only: {'; '.join(missing)}", stacklevel=1)


def _check_concurrent_takes(roots: list[tuple[str, dict[str, str], Storage]], rounds: int) -> None:
    results = assert_all_ok(
        run_ranks(
            _take_rounds,
            TAKERS,
            args=([(url, options) for url, options, _ in roots], rounds),
            timeout=280,
        )
    )
    for index, (url, _, storage) in enumerate(roots):
        _check_one_writer_per_round([results[rank][index] for rank in range(TAKERS)], rounds, url)
        # The generations still stored are ones the takers won, no others (listed only: the
        # test's own client, opened before the takers ran, is not asked to read again).
        taken = {g for rank in range(TAKERS) for g, _ in results[rank][index] if g != "error"}
        stored = _stored_generations(storage)
        assert stored and stored <= taken, (url, sorted(stored), sorted(taken))
        assert list(storage.list("lease/probe-")) == []


def _check_one_writer_per_round(results: list[list[Any]], rounds: int, url: str) -> None:
    errors = [(rank, r) for rank, done in enumerate(results) for r in done if r[0] == "error"]
    assert errors == [], f"{url}: {len(errors)} of {TAKERS * rounds} takes raised: {errors[:5]}"
    taken: list[int] = []
    for round_ in range(rounds):
        gens = [results[rank][round_][0] for rank in range(TAKERS)]
        committers = [rank for rank in range(TAKERS) if results[rank][round_][1]]
        assert len(set(gens)) == TAKERS, f"{url} round {round_}: a generation taken twice: {gens}"
        assert len(committers) == 1, f"{url} round {round_}: may commit: {committers} of {gens}"
        assert gens[committers[0]] == max(gens)
        taken += gens
    assert len(set(taken)) == TAKERS * rounds


@pytest.mark.s3
def test_delete_then_load_is_not_found_on_seaweedfs(seaweed_root: S3Root) -> None:
    """SeaweedFS keeps listing ``snapshots/<id>/`` after its last object is gone; the deleted
    snapshot must be gone, not "interrupted"."""
    storage = seaweed_root.open()
    state = {"w": torch.arange(12.0).reshape(3, 4)}
    info = ts.save(state, storage, step=5)
    ts.delete(storage, info.id)
    assert ts.list_snapshots(storage) == []
    with pytest.raises(NotFoundError, match=info.id):
        ts.load({"w": torch.zeros(3, 4)}, storage, snapshot=info.id)
    with pytest.raises(NotFoundError):
        ts.delete(storage, info.id)


def test_save_load_verify_delete_on_azure_and_gcs(cloud_root: AzRoot | GcsRoot) -> None:
    """A whole round trip on an ``az://`` or ``gs://`` root given as a URL and options, the way
    users give
    one (``verify`` takes the opened root): save two steps, list, load each exactly, verify,
    delete one, load it: NotFoundError."""
    torch.manual_seed(0)
    states = {
        step: {"w": torch.randn(64, 33), "b": torch.randn(7), "meta": {"step": step}}
        for step in (1, 2)
    }
    infos = {
        step: ts.save(state, cloud_root.url, step=step, storage_options=cloud_root.options)
        for step, state in states.items()
    }
    listed = ts.list_snapshots(cloud_root.url, storage_options=cloud_root.options)
    assert [(s.id, s.step) for s in listed] == [(infos[1].id, 1), (infos[2].id, 2)]
    for step, state in states.items():
        dst = {"w": torch.zeros(64, 33), "b": torch.zeros(7), "meta": {"step": -1}}
        ts.load(dst, cloud_root.url, snapshot=infos[step].id, storage_options=cloud_root.options)
        assert torch.equal(dst["w"], state["w"]) and torch.equal(dst["b"], state["b"])
        assert dst["meta"] == {"step": step}
    report = ts.verify(cloud_root.open())
    assert report.ok
    assert sorted(s.id for s in report.snapshots) == sorted(i.id for i in infos.values())
    ts.delete(cloud_root.url, infos[1].id, storage_options=cloud_root.options)
    assert [
        s.step for s in ts.list_snapshots(cloud_root.url, storage_options=cloud_root.options)
    ] == [2]
    with pytest.raises(NotFoundError, match=infos[1].id):
        ts.load(
            {"w": torch.zeros(64, 33), "b": torch.zeros(7), "meta": {}},
            cloud_root.url,
            snapshot=infos[1].id,
            storage_options=cloud_root.options,
        )


# -- the conditional-create probe --------------------------------------------------------------


class IgnoresPreconditions:
    """A store whose conditional create is a plain overwrite that reports success: what an
    S3 gateway without ``If-None-Match`` support does."""

    def __init__(self, inner: Storage) -> None:
        self.inner, self.url = inner, inner.url
        self.readinto_is_zero_copy = inner.readinto_is_zero_copy

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        self.inner.put(key, data)
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
def rclone_root() -> Iterator[Storage]:
    """A fresh root on ``rclone serve s3`` (which ignores preconditions)."""
    pytest.importorskip("s3fs")
    from trainsnap.testing.rclone import RcloneS3, ServerUnavailable, rclone_binary

    try:
        rclone_binary()
    except ServerUnavailable as e:
        pytest.skip(f"rclone S3 server unavailable: {e}")
    with RcloneS3() as server:
        yield open_storage(server.url("run"), **server.options)


def _refused(storage: Storage) -> InvalidArgumentError:
    with pytest.raises(InvalidArgumentError) as caught:
        Lease.take(storage)
    error = caught.value
    assert storage.url in str(error)
    assert "single_writer=True" in str(error)
    assert error.path == storage.url
    assert [k for k in storage.list("lease/") if k.startswith("lease/gen-")] == []
    return error


@pytest.mark.s3
def test_probe_refuses_rclone_s3(rclone_root: Storage, caplog: pytest.LogCaptureFixture) -> None:
    assert rclone_root.put_if_absent("probe-check", b"1") is True
    assert rclone_root.put_if_absent("probe-check", b"2") is True  # the store ignores it
    rclone_root.delete("probe-check")
    _refused(rclone_root)
    with caplog.at_level(logging.WARNING, logger="trainsnap"):
        lease = Lease.take(rclone_root, single_writer=True)
    assert lease.generation == 1
    assert "does not honour conditional creates" in caplog.text
    assert [k for k in rclone_root.list("lease/") if k.startswith("lease/probe-")] == []


def test_probe_refuses_a_store_that_ignores_preconditions(tmp_path: Any) -> None:
    storage = open_storage(IgnoresPreconditions(open_storage(tmp_path / "root")))
    _refused(storage)
    with pytest.raises(InvalidArgumentError, match="does not honour"):
        ts.CheckpointManager(storage, interval=ts.Every(steps=1), async_save=False)
    manager = ts.CheckpointManager(
        storage,
        interval=ts.Every(steps=1),
        async_save=False,
        options=ts.ManagerOptions(single_writer=True, preemption_signals=()),
    )
    state = {"w": torch.ones(2)}
    manager.step(0, state)
    manager.close()
    assert [s.step for s in ts.list_snapshots(storage)] == [0]


@pytest.mark.parametrize("kind", ["posix", "memory"])
def test_probe_accepts_stores_that_honour_preconditions(tmp_path: Any, kind: str) -> None:
    url = str(tmp_path / "root") if kind == "posix" else f"memory://probe-{os.getpid()}-{kind}"
    storage = open_storage(url)
    check_fencing(storage)
    assert Lease.take(storage).generation == 1
    assert Lease.take(storage).generation == 2
    assert sorted(storage.list("lease/")) == [
        "lease/gen-000000000001",
        "lease/gen-000000000002",
    ]


def test_probe_accepts_azure_and_gcs(cloud_root: AzRoot | GcsRoot) -> None:
    """Azure Blob and GCS honour conditional creates: the probe passes, a writer takes the
    root, a manager saves there, and no probe key is left behind."""
    storage = cloud_root.open()
    check_fencing(storage)
    assert Lease.take(storage).generation == 1
    manager = ts.CheckpointManager(
        storage,
        interval=ts.Every(steps=1),
        async_save=False,
        options=ts.ManagerOptions(preemption_signals=()),
    )
    manager.step(0, {"w": torch.ones(3)})
    manager.close()
    assert [s.step for s in ts.list_snapshots(storage)] == [0]
    assert [k for k in storage.list("lease/") if k.startswith("lease/probe-")] == []
    assert [k for k in storage.list("lease/") if k.startswith("lease/gen-")] == [
        "lease/gen-000000000001",
        "lease/gen-000000000002",
    ]
