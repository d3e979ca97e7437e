"""Azure Blob storage on loopback (Azurite, Microsoft's emulator), for tests of ``az://`` roots.

:class:`AzuriteBlob` runs Azurite's blob service (``azurite-blob``, a Node.js program from the
npm package ``azurite``) on a free port of 127.0.0.1, its data in memory (nothing is written to
disk; it is gone when the process stops), telemetry off, with one container. Clients reach it
through the emulator's well-known account (:data:`ACCOUNT`, :data:`ACCOUNT_KEY`) and a
connection string naming its endpoint:

    with AzuriteBlob() as az:
        ts.save(state, az.url("run-1"), step=1, storage_options=az.options)

``scripts/venv.sh`` installs the pinned :data:`AZURITE_VERSION` into ``.venv/azurite`` (beside
the interpreter's environment); :func:`azurite_binary` finds it there or on ``PATH``, or says
why there is none.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainsnap.testing.harness import free_port
from trainsnap.testing.seaweedfs import ServerUnavailable, _log_tail, stop

AZURITE_VERSION = "3.35.0"
"""The npm package's version: the newest whose engines accept Node.js 20 (3.36 asks for 21,
3.37 for 22). It predates the storage API version the Python SDK sends, hence
``--skipApiVersionCheck``."""

ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
"""The emulator's built-in account and its published key (not a secret)."""

CONTAINER = "trainsnap-test"

READY_TIMEOUT = 60.0
"""Seconds to wait for the blob service to answer (it usually does within a second or two)."""

STOP_TIMEOUT = 1.0
"""Seconds between SIGTERM and SIGKILL on exit. Azurite stops at once when idle, but waits for
clients' open keep-alive connections to close; its data is in memory and thrown away anyway."""


def azurite_binary() -> str:
    """The path of an ``azurite-blob`` that runs here (the project's ``.venv/azurite``, then
    ``PATH``); :class:`ServerUnavailable` naming the reason when there is none."""
    if shutil.which("node") is None:
        raise ServerUnavailable("no node on PATH: Azurite is a Node.js program (install node)")
    local = Path(sys.prefix) / "azurite" / "node_modules" / ".bin" / "azurite-blob"
    found = shutil.which("azurite-blob")
    for candidate in (local, Path(found) if found else None):
        if candidate is None or not os.access(candidate, os.X_OK):
            continue
        try:
            done = subprocess.run(
                [str(candidate), "--version"], capture_output=True, timeout=60, check=False
            )
        except OSError as e:
            raise ServerUnavailable(f"{candidate} does not run here: {e}") from e
        if done.returncode == 0:
            return str(candidate)
        raise ServerUnavailable(
            f"{candidate} --version exited with {done.returncode}: "
            f"{done.stderr.decode(errors='replace').strip()[-500:]}"
        )
    raise ServerUnavailable(
        f"no azurite-blob: npm install --prefix .venv/azurite azurite@{AZURITE_VERSION} "
        "(scripts/venv.sh does it)"
    )


def connection_string(endpoint: str) -> str:
    """The connection string of the emulator's account at ``endpoint`` (``http://host:port``)."""
    return (
        f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
        f"BlobEndpoint={endpoint}/{ACCOUNT};"
    )


class AzuriteBlob:
    """Azurite's blob service on loopback for the life of a ``with`` block; see the module's
    docstring."""

    def __init__(self, container: str = CONTAINER) -> None:
        self.container = container
        self.endpoint = ""
        self._process: subprocess.Popen[bytes] | None = None
        self._workdir: Path | None = None

    @property
    def connection_string(self) -> str:
        return connection_string(self.endpoint)

    @property
    def options(self) -> dict[str, str]:
        """The ``storage_options`` that send trainsnap's ``az://`` backend (adlfs) here."""
        return {"connection_string": self.connection_string}

    def url(self, prefix: str) -> str:
        return f"az://{self.container}/{prefix}"

    def __enter__(self) -> AzuriteBlob:
        binary = azurite_binary()
        self._workdir = Path(tempfile.mkdtemp(prefix="ts-azurite-"))
        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        command = [
            binary,
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(port),
            "--inMemoryPersistence",
            "--extentMemoryLimit",
            "2048",
            "--skipApiVersionCheck",
            "--disableTelemetry",
            "--silent",
        ]
        log_path = self._workdir / "azurite.log"
        try:
            with log_path.open("wb") as log:
                # cwd: anything it might still write lands in the directory removed on exit.
                self._process = subprocess.Popen(
                    command, stdout=log, stderr=subprocess.STDOUT, cwd=self._workdir
                )
            wait_for_container(self.connection_string, self.container, self._process, log_path)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        process, self._process = self._process, None
        if process is not None:
            stop(process, STOP_TIMEOUT)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None


def wait_for_container(
    conn: str, container: str, process: subprocess.Popen[bytes], log: Path
) -> None:
    """Wait until the blob service at ``conn`` creates ``container`` (or finds it there).
    Raises :class:`ServerUnavailable` if the process exits, ``TimeoutError`` after
    :data:`READY_TIMEOUT` seconds."""
    from azure.core.exceptions import ResourceExistsError
    from azure.storage.blob import BlobServiceClient

    client = BlobServiceClient.from_connection_string(
        conn, retry_total=0, connection_timeout=2, read_timeout=10
    )
    deadline = time.monotonic() + READY_TIMEOUT
    last: Exception | None = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerUnavailable(
                f"{process.args!r} exited with {process.returncode}:\n{_log_tail(log)}"
            )
        try:
            client.create_container(container)
            return
        except ResourceExistsError:
            return
        except Exception as e:  # not listening yet
            last = e
            time.sleep(0.1)
    raise TimeoutError(
        f"Azurite at {conn} not ready after {READY_TIMEOUT:.0f} s (last error: {last}):\n"
        f"{_log_tail(log)}"
    )
