"""A file system that loses power on command, for crash-consistency tests.

A SIGKILL never loses what is in the page cache, so killing processes cannot show that an fsync
is missing or out of order. :class:`PowerCutFS` mounts a FUSE pass-through (mfusepy over
libfuse 3, in a daemon process) that models what a power cut keeps under the strict POSIX rule
(:mod:`trainsnap.testing.powercut_fs`): file data only after an ``fsync`` of the file, a name
only after an ``fsync`` of its directory. ::

    with PowerCutFS(tmp_path) as fs:
        ts.save(state, fs.mount / "root", step=1)
        returned = fs.ops()             # the save is durable from here on
        ts.save(state, fs.mount / "root", step=2)
        for n, where in fs.cuts(tmp_path / "after", points=range(fs.ops() + 1)):
            ...                          # `where` holds what a cut after event n leaves

``cuts`` replays one recorded run at many cut points (each a plain directory: what a fresh mount
shows after that cut). Live, :meth:`cut_after` and :meth:`cut_now` make every later operation
fail with EIO, and :meth:`power_cycle` unmounts, keeps only the durable state (optionally torn:
a random prefix of the unsynced changes survives too) and mounts it again. :meth:`fail` injects
an error (EIO by default) into an operation, such as a directory fsync.

:func:`unavailable` says why no such file system can be mounted here (no ``/dev/fuse``, not
root, no libfuse 3, no mfusepy); tests skip with that reason.
"""

from __future__ import annotations

import ctypes.util
import errno
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from multiprocessing.connection import Client, Connection
from pathlib import Path
from types import TracebackType
from typing import Any

from trainsnap.errors import TrainsnapError
from trainsnap.testing import powercut_fs
from trainsnap.testing.powercut_fs import Event, Model

_MOUNT_WAIT_S = 20.0
"""How long a mount may take to appear before the daemon counts as failed."""


def unavailable() -> str | None:
    """Why a power-cut file system cannot be mounted on this machine; None when it can."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (FUSE is not available in this kernel or container)"
    if os.geteuid() != 0 and shutil.which("fusermount3") is None:
        return "not root and no fusermount3 (apt-get install fuse3)"
    if ctypes.util.find_library("fuse3") is None:
        return "no libfuse 3 (apt-get install -y fuse3 libfuse3-3)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:
        return f"mfusepy cannot load ({e}); pip install the test extra"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    return None


class PowerCutFS:
    """A power-cut file system mounted at ``self.mount`` over ``self.disk``, both under
    ``workdir``; a context manager that unmounts and removes them, also on failure."""

    def __init__(self, workdir: str | os.PathLike[str]) -> None:
        self.workdir = Path(workdir).absolute()
        self.mount = self.workdir / "mnt"
        self.disk = self.workdir / "disk"
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._authkey = secrets.token_bytes(16)
        self.mounts = 0

    def __enter__(self) -> PowerCutFS:
        reason = unavailable()
        if reason is not None:
            raise TrainsnapError(f"cannot mount a power-cut file system: {reason}")
        self.mount.mkdir(parents=True, exist_ok=True)
        self.disk.mkdir(parents=True, exist_ok=True)
        try:
            self._start()
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop()
        shutil.rmtree(self.workdir / "disk", ignore_errors=True)

    # -- the daemon ---------------------------------------------------------------------------

    def _start(self) -> None:
        self.mounts += 1
        address = str(self.workdir / f".control-{self.mounts}")
        log = open(self.workdir / f"daemon-{self.mounts}.log", "wb")  # noqa: SIM115
        script = powercut_fs.__file__
        self._proc = subprocess.Popen(
            [sys.executable, script, str(self.disk), str(self.mount), address, self._authkey.hex()],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + _MOUNT_WAIT_S
        while not (_mounted(self.mount) and os.path.exists(address)):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                text = (self.workdir / f"daemon-{self.mounts}.log").read_text(errors="replace")
                raise TrainsnapError(
                    f"the power-cut file system did not mount at {self.mount}: {text[-2000:]}"
                )
            time.sleep(0.01)
        self._conn = Client(address, family="AF_UNIX", authkey=self._authkey)

    def _stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if _mounted(self.mount):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mount)], check=False)
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def _ask(self, *request: Any) -> Any:
        if self._conn is None:
            raise TrainsnapError("the power-cut file system is not mounted")
        self._conn.send(request)
        status, value = self._conn.recv()
        if status != "ok":
            raise TrainsnapError(f"power-cut file system request {request!r} failed: {value}")
        return value

    # -- control ------------------------------------------------------------------------------

    def ops(self) -> int:
        """Events recorded so far (mutating operations the daemon served)."""
        return int(self._ask("count"))

    def cut_after(self, n: int) -> None:
        """Lose power once ``n`` events have been recorded: every later operation fails (EIO)."""
        self._ask("arm", n)

    def cut_now(self) -> int:
        """Lose power now; the number of events before the cut."""
        return int(self._ask("cut"))

    def fail(self, op: str, match: str = "", *, error: int = errno.EIO, times: int = -1) -> None:
        """Make ``op`` (a FUSE operation name: ``fsyncdir``, ``fsync``, ``write``, ``rename``
        ...) fail with ``error`` on paths containing ``match``, ``times`` times (-1: always)."""
        self._ask("fail", {"op": op, "match": match, "errno": error, "times": times})

    def hits(self) -> list[int]:
        """How often each :meth:`fail` rule has fired."""
        return list(self._ask("hits"))

    def trace(self) -> tuple[Model, list[Event]]:
        """The state at mount time and every event since."""
        initial, events = self._ask("trace")
        return Model.from_wire(initial), events

    def power_cycle(self, *, torn: int | None = None) -> int:
        """Cut the power (if not cut yet), unmount, keep only what was durable (with ``torn``, a
        seed: and a random prefix of the unsynced changes) and mount it again. The number of
        events the cut kept."""
        initial, events = self.trace()
        self._stop()
        (_, nodes) = next(powercut_fs.replay(initial, events, [len(events)], torn=torn))
        shutil.rmtree(self.disk)
        self.disk.mkdir()
        powercut_fs.materialize(nodes, self.disk)
        self._start()
        return len(events)

    def cuts(
        self, where: str | os.PathLike[str], points: Iterable[int], *, torn: int | None = None
    ) -> Iterator[tuple[int, Path]]:
        """For each cut point ``n`` (ascending), ``where`` holding what a cut after the first
        ``n`` events of this mount leaves (emptied and refilled for each)."""
        initial, events = self.trace()
        yield from cut_states(initial, events, Path(where), points, torn=torn)


def _mounted(path: Path) -> bool:
    """Whether a file system is mounted at ``path`` (from the mount table: a stat of a mount
    that lost power fails, so ``os.path.ismount`` cannot tell)."""
    with open("/proc/self/mounts") as table:
        return any(line.split()[1] == str(path) for line in table if line.strip())


def cut_states(
    initial: Model,
    events: list[Event],
    where: Path,
    points: Iterable[int],
    *,
    torn: int | None = None,
) -> Iterator[tuple[int, Path]]:
    """:meth:`PowerCutFS.cuts` of a recorded trace."""
    for n, nodes in powercut_fs.replay(initial, events, points, torn=torn):
        if where.exists():
            shutil.rmtree(where)
        where.mkdir(parents=True)
        powercut_fs.materialize(nodes, where)
        yield n, where
