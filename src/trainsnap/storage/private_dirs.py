"""Directories only this user can steer, on a file system every user of the host can write
(``/dev/shm``): where the memory tier keeps its roots.

A path string is resolved again by every call that takes it, and any user can plant a link, a
directory of their own or a FIFO at a name others will use (``/dev/shm/trainsnap`` is a name
anyone can create first). :func:`open_private_dir` therefore walks from a trusted base down with
``openat`` relative to the parent's descriptor and ``O_NOFOLLOW``, creating each missing
directory with mode 0700, and checks each one with ``fstat`` on the descriptor it holds: owned
by this process's user, no write bit for group or others, a directory and not a link, a file or a
FIFO. What fails is :class:`UnsafeDirectoryError`, naming the path and the fix. The caller keeps
the descriptor of the last directory and works relative to it (or at least re-checks it).

O(depth) system calls. POSIX only.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from trainsnap.errors import InvalidArgumentError

MODE: Final = 0o700
"""Mode of every directory created."""
_OPEN: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class UnsafeDirectoryError(InvalidArgumentError):
    """A directory on the way to a private root that another user could steer."""


def default_memory_root(base: str | Path = "/dev/shm") -> Path:
    """The memory tier's default root for this user: ``<base>/trainsnap-<uid>`` (one per user,
    so that no user can take another's name first)."""
    return Path(base) / f"trainsnap-{os.getuid()}"


def open_private_dir(base: str | Path, parts: str | Sequence[str]) -> int:
    """A descriptor of ``base/parts...``, each part created (mode 0700) or checked to be this
    user's own directory, walked relative to its parent's descriptor without following a link.

    ``base`` (the tmpfs, e.g. ``/dev/shm``) is trusted as a path: it may be shared (sticky,
    world-writable), but must be a directory. ``parts`` are single names (no ``/``, ``.``,
    ``..``), or one relative path that is split into them. Raises :class:`UnsafeDirectoryError`
    for a link, another user's directory, group or other write bits, a file, a FIFO or a
    device anywhere below ``base``. The caller closes the descriptor."""
    names = [p for p in parts.split("/") if p] if isinstance(parts, str) else list(parts)
    for name in names:
        if name in (".", "..") or "/" in name or "\0" in name or not name:
            raise InvalidArgumentError(f"{name!r} is not one directory name (under {base})")
    try:
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise UnsafeDirectoryError(
            f"{base} cannot be opened as a directory ({e.strerror}); give the memory tier a "
            "tmpfs directory that exists",
            path=str(base),
        ) from e
    path = Path(base)
    try:
        for name in names:
            path = path / name
            child = _open_or_create(fd, name, path)
            os.close(fd)
            fd = child
            check_private(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_or_create(parent: int, name: str, path: Path) -> int:
    for _ in range(2):  # created by someone between our open and mkdir: checked as found
        try:
            return os.open(name, _OPEN, dir_fd=parent)
        except FileNotFoundError:
            try:
                os.mkdir(name, MODE, dir_fd=parent)
            except FileExistsError:
                continue
        except OSError as e:
            raise _refusal(path, parent, name, e) from e
    try:
        return os.open(name, _OPEN, dir_fd=parent)
    except OSError as e:
        raise _refusal(path, parent, name, e) from e


def _refusal(path: Path, parent: int, name: str, error: OSError) -> UnsafeDirectoryError:
    """Why ``name`` under ``parent`` is not a directory we may use (it was not opened)."""
    what = "not a directory"
    try:
        info = os.lstat(name, dir_fd=parent)
        if stat.S_ISLNK(info.st_mode):
            what = "a symbolic link"
        elif stat.S_ISFIFO(info.st_mode):
            what = "a FIFO"
        elif stat.S_ISREG(info.st_mode):
            what = "a file"
        elif not stat.S_ISDIR(info.st_mode):
            what = "a device or socket"
    except OSError:
        pass
    if error.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        what = f"not openable ({error.strerror})"
    return UnsafeDirectoryError(
        f"{path} is {what}; trainsnap keeps its memory tier only in directories of its own "
        f"user. Remove it (another user may have planted it), or give the tier another root",
        path=str(path),
    )


def check_private(fd: int, path: str | Path) -> None:
    """Raise :class:`UnsafeDirectoryError` unless the directory open at ``fd`` is owned by this
    process's user and not writable by group or others."""
    info = os.fstat(fd)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectoryError(f"{path} is not a directory", path=str(path))
    if info.st_uid != os.geteuid():
        raise UnsafeDirectoryError(
            f"{path} belongs to user {info.st_uid}, not to this process's user "
            f"{os.geteuid()}: another user made it first, and could read or plant snapshots "
            "there. Remove it, or give the memory tier a root of your own",
            path=str(path),
        )
    if info.st_mode & 0o022:
        raise UnsafeDirectoryError(
            f"{path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o}); "
            f"`chmod 700 {path}` or remove it",
            path=str(path),
        )


__all__ = [
    "MODE",
    "UnsafeDirectoryError",
    "check_private",
    "default_memory_root",
    "open_private_dir",
]
