"""The memory tier's safety pieces on a shared host: directories walked with openat/O_NOFOLLOW
and checked for owner and mode (storage/private_dirs), and the job secret kept with the durable
root's writer record (manager/job_secret). A co-tenant's part runs as ``nobody`` (tests run as
root in CI): a subprocess drops to that uid before planting anything."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import trainsnap as ts
from trainsnap.manager import job_secret
from trainsnap.storage import open_storage
from trainsnap.storage.private_dirs import (
    UnsafeDirectoryError,
    default_memory_root,
    open_private_dir,
)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every user may reach and write, like /dev/shm (sticky, mode 1777); not under
    pytest's own temporary directory, which other users cannot enter."""
    base = Path(tempfile.mkdtemp(prefix="trainsnap-shm-"))
    base.chmod(0o1777)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _as_nobody(code: str) -> None:
    """Run ``code`` in a subprocess as the user ``nobody`` (the co-tenant)."""
    if os.geteuid() != 0:
        pytest.skip("planting as another user needs root (CI runs as root)")
    nobody = pwd.getpwnam("nobody").pw_uid
    prelude = f"import os; os.setgid({nobody}); os.setuid({nobody}); os.umask(0)\n"
    subprocess.run([sys.executable, "-c", prelude + code], check=True, timeout=60)


def test_missing_directories_are_created_private_and_found_again(shared: Path) -> None:
    base = shared
    fd = open_private_dir(base, "trainsnap-0/job/node-0")
    try:
        info = os.fstat(fd)
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
    finally:
        os.close(fd)
    for part in ("trainsnap-0", "trainsnap-0/job"):
        assert stat.S_IMODE((base / part).stat().st_mode) == 0o700
    os.close(open_private_dir(base, ["trainsnap-0", "job", "node-0"]))  # found, checked


def test_a_link_anywhere_on_the_way_is_refused(shared: Path, tmp_path: Path) -> None:
    """Hostile suite 3: <tmpfs>/<job>/node-0 as a link to another root made the tier's
    retention delete that root's snapshots; the tier root as a link wrote the tier elsewhere."""
    base, elsewhere = shared, tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.close(open_private_dir(base, "tier/job"))
    (base / "tier" / "job" / "node-0").symlink_to(elsewhere)
    with pytest.raises(UnsafeDirectoryError, match="node-0 is a symbolic link") as refused:
        open_private_dir(base, "tier/job/node-0")
    assert refused.value.path == str(base / "tier" / "job" / "node-0")
    (base / "root-link").symlink_to(elsewhere)
    with pytest.raises(ts.TrainsnapError, match="symbolic link"):
        open_private_dir(base, "root-link/job")
    assert list(elsewhere.iterdir()) == []


def test_a_directory_another_user_made_first_is_refused(shared: Path) -> None:
    """Hostile suite 3: directories created first by another uid with mode 0777, holding a
    marker that names this job, were restored from."""
    base = shared
    _as_nobody(f"os.makedirs({str(base / 'trainsnap-0' / 'job')!r}, mode=0o777)")
    with pytest.raises(UnsafeDirectoryError, match="belongs to user"):
        open_private_dir(base, "trainsnap-0/job")


def test_our_own_directory_writable_by_others_is_refused(shared: Path) -> None:
    base = shared
    os.close(open_private_dir(base, "tier"))
    (base / "tier").chmod(0o777)
    with pytest.raises(UnsafeDirectoryError, match="writable by group or others"):
        open_private_dir(base, "tier/job")


@pytest.mark.parametrize("kind", ["file", "fifo"])
def test_a_file_or_fifo_where_a_directory_should_be_is_refused(shared: Path, kind: str) -> None:
    """Hostile suite 3: a tier path that was a file or a FIFO gave raw FileExistsError /
    NotADirectoryError."""
    base = shared
    planted = base / "tier"
    if kind == "file":
        planted.write_text("x")
    else:
        os.mkfifo(planted)
    with pytest.raises(
        UnsafeDirectoryError, match=f"is a {kind.upper() if kind == 'fifo' else kind}"
    ):
        open_private_dir(base, "tier/job")


def test_the_default_memory_root_is_per_user() -> None:
    assert default_memory_root() == Path(f"/dev/shm/trainsnap-{os.getuid()}")
    assert default_memory_root("/run/shm").parent == Path("/run/shm")


# -- the job secret --------------------------------------------------------------------------------


def test_the_secret_is_created_once_and_read_back(tmp_path: Path) -> None:
    storage = open_storage(tmp_path / "root")
    assert job_secret.read_secret(storage) is None
    secret = job_secret.job_secret(storage)
    assert len(secret) == 64 and job_secret.job_secret(storage) == secret
    assert job_secret.marker_matches({"secret": secret, "job": "j"}, secret)
    assert not job_secret.marker_matches({"job": "j", "generation": 1}, secret)  # forged
    assert not job_secret.marker_matches({"secret": "0" * 64}, secret)


def test_a_deleted_root_gets_a_new_secret(tmp_path: Path) -> None:
    """Hostile suite 3: run B on a deleted run A's URL trusted run A's memory tier."""
    import shutil

    root = tmp_path / "root"
    first = job_secret.job_secret(open_storage(root))
    old_marker = {"secret": first}
    shutil.rmtree(root)
    second = job_secret.job_secret(open_storage(root))
    assert second != first and not job_secret.marker_matches(old_marker, second)


@pytest.mark.parametrize("content", [b"not hex at all", b"g" * 64, b"a" * 65, b""])
def test_a_damaged_secret_is_a_corrupt_error(tmp_path: Path, content: bytes) -> None:
    """Hostile suite 3: a crafted writer record stopped the manager with raw ValueError,
    TypeError, OverflowError, IsADirectoryError or MemoryError (a 5 GiB sparse record)."""
    storage = open_storage(tmp_path / "root")
    storage.put(job_secret.SECRET_KEY, content)
    with pytest.raises(ts.CorruptError, match="lease/secret is damaged"):
        job_secret.job_secret(storage)


def test_a_sparse_or_fifo_secret_is_refused_unread(tmp_path: Path) -> None:
    storage = open_storage(tmp_path / "root")
    job_secret.job_secret(storage)
    path = tmp_path / "root" / job_secret.SECRET_KEY
    with path.open("wb") as f:
        f.truncate(5 << 30)  # sparse: costs no disk
    with pytest.raises(ts.CorruptError, match="5368709120 bytes"):
        job_secret.read_secret(storage)
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(ts.CorruptError, match="not a regular file"):
        job_secret.read_secret(storage)
