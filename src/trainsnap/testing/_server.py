"""What every test server launcher shares: a server program run on loopback for the life of a
``with`` block.

:class:`Server` does the process's life: a fresh temporary directory (its working directory,
where its output goes as ``<name>.log``, removed on exit), the start, the wait until a probe
request succeeds (:class:`ServerUnavailable` with the log's tail if the process exits first,
``TimeoutError`` after :attr:`Server.ready_timeout` seconds), and the stop (:func:`stop`:
SIGTERM, then SIGKILL). A launcher (:mod:`~trainsnap.testing.seaweedfs`,
:mod:`~trainsnap.testing.rclone`, :mod:`~trainsnap.testing.azurite`,
:mod:`~trainsnap.testing.gcs`) says only which binary, which command line, and which request
proves the server is up. :func:`find_binary` finds a binary that runs here, or says why there is
none (a test then skips, naming the reason).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import ClassVar, TypeVar

from trainsnap.testing.harness import free_port

READY_TIMEOUT = 60.0
"""Seconds to wait for a server to answer (they usually do within a few)."""

STOP_TIMEOUT = 5.0
"""Seconds between SIGTERM and SIGKILL on exit, unless a launcher says otherwise."""


_S = TypeVar("_S", bound="Server")


class ServerUnavailable(RuntimeError):
    """No server binary that runs here (a test then skips, naming this reason)."""


def find_binary(
    candidates: Iterable[Path | str | None],
    version_args: Sequence[str],
    missing: str,
    *,
    timeout: float = 30.0,
) -> str:
    """The first executable of ``candidates`` (None: not there), checked by running it with
    ``version_args``; :class:`ServerUnavailable` when that fails (naming the candidate) or when
    there is none (saying ``missing``: how to install one)."""
    for candidate in candidates:
        if candidate is None or not os.access(candidate, os.X_OK):
            continue
        command = [str(candidate), *version_args]
        try:
            done = subprocess.run(command, capture_output=True, timeout=timeout, check=False)
        except OSError as e:  # an exec format error: a binary for another platform
            raise ServerUnavailable(f"{candidate} does not run here: {e}") from e
        if done.returncode == 0:
            return str(candidate)
        said = done.stderr.decode(errors="replace").strip()[-500:]
        raise ServerUnavailable(
            f"{' '.join(command)} exited with {done.returncode}" + (f": {said}" if said else "")
        )
    raise ServerUnavailable(missing)


def log_tail(log: Path, lines: int = 30) -> str:
    """The end of a server's log (for a failure message)."""
    if not log.exists():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def stop(process: subprocess.Popen[bytes], timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds; returns once it exited."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Server:
    """A server program on loopback for the life of a ``with`` block; see the module's
    docstring. A launcher sets :attr:`name` and :attr:`title` and implements :meth:`_binary`,
    :meth:`_command` (its port from :meth:`_listen`, which sets :attr:`endpoint`) and
    :meth:`_probe`; :meth:`_setup` and :meth:`_cleanup` are for what it changes outside its
    directory."""

    name: ClassVar[str]
    """Names the temporary directory (``ts-<name>-...``) and the log (``<name>.log``)."""
    title: ClassVar[str]
    """The server, as a failure message names it."""
    ready_timeout: ClassVar[float] = READY_TIMEOUT
    stop_timeout: ClassVar[float] = STOP_TIMEOUT
    poll_seconds: ClassVar[float] = 0.1
    """Pause between probes."""
    not_ready: ClassVar[tuple[type[Exception], ...]] = (Exception,)
    """What a probe raises while the server is not up yet (anything else is raised)."""

    def __init__(self) -> None:
        self.endpoint = ""
        self._process: subprocess.Popen[bytes] | None = None
        self._workdir: Path | None = None

    def _binary(self) -> str:
        """The binary to run; :class:`ServerUnavailable` when there is none."""
        raise NotImplementedError

    def _command(self, binary: str, workdir: Path) -> list[str]:
        """The command line, listening on a port of 127.0.0.1 given by :meth:`_listen`."""
        raise NotImplementedError

    def _probe(self) -> Callable[[], None]:
        """A request that succeeds once the server is up (called until it does; it raises one
        of :attr:`not_ready` before); made once per start, so that a client is set up once."""
        raise NotImplementedError

    def _listen(self, port: int | None = None) -> int:
        """``port`` of 127.0.0.1 (None: a free one) as the server's :attr:`endpoint`; returns it."""
        port = free_port() if port is None else port
        self.endpoint = f"http://127.0.0.1:{port}"
        return port

    def _setup(self) -> None:
        """Before the start: what the server needs outside its directory (credentials)."""

    def _cleanup(self) -> None:
        """After the stop: undo :meth:`_setup`, remove what the server left outside its
        directory. Called after a failed start too."""

    def __enter__(self: _S) -> _S:
        binary = self._binary()
        self._workdir = workdir = Path(tempfile.mkdtemp(prefix=f"ts-{self.name}-"))
        log = workdir / f"{self.name}.log"
        try:
            self._setup()
            command = self._command(binary, workdir)
            with log.open("wb") as out:
                self._process = subprocess.Popen(
                    command, stdout=out, stderr=subprocess.STDOUT, cwd=workdir
                )
            self._wait_until_ready(self._process, log)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        process, self._process = self._process, None
        if process is not None:
            stop(process, self.stop_timeout)
        self._cleanup()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)  # data, log and socket files
            self._workdir = None

    def _wait_until_ready(self, process: subprocess.Popen[bytes], log: Path) -> None:
        probe = self._probe()
        deadline = time.monotonic() + self.ready_timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise ServerUnavailable(
                    f"{process.args!r} exited with {process.returncode}:\n{log_tail(log)}"
                )
            try:
                probe()
                return
            except self.not_ready as e:
                last = e
                time.sleep(self.poll_seconds)
        raise TimeoutError(
            f"{self.title} at {self.endpoint} not ready after {self.ready_timeout:.0f} s "
            f"(last error: {last}):\n{log_tail(log)}"
        )
