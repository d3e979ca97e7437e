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

import contextlib
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from trainsnap.testing._server import Server, ServerUnavailable, find_binary

__all__ = [
    "ACCOUNT",
    "ACCOUNT_KEY",
    "AZURITE_VERSION",
    "CONTAINER",
    "AzuriteBlob",
    "ServerUnavailable",
    "azurite_binary",
    "connection_string",
]

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

STOP_TIMEOUT = 1.0
"""Seconds between SIGTERM and SIGKILL on exit. Azurite stops at once when idle, but waits for
clients' open keep-alive connections to close; its data is in memory and thrown away anyway."""


def azurite_binary() -> str:
    """The path of an ``azurite-blob`` that runs here (the project's ``.venv/azurite``, then
    ``PATH``); :class:`ServerUnavailable` naming the reason when there is none."""
    if shutil.which("node") is None:
        raise ServerUnavailable("no node on PATH: Azurite is a Node.js program (install node)")
    local = Path(sys.prefix) / "azurite" / "node_modules" / ".bin" / "azurite-blob"
    return find_binary(
        [local, shutil.which("azurite-blob")],
        ["--version"],
        f"no azurite-blob: npm install --prefix .venv/azurite azurite@{AZURITE_VERSION} "
        "(scripts/venv.sh does it)",
        timeout=60,
    )


def connection_string(endpoint: str) -> str:
    """The connection string of the emulator's account at ``endpoint`` (``http://host:port``)."""
    return (
        f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
        f"BlobEndpoint={endpoint}/{ACCOUNT};"
    )


class AzuriteBlob(Server):
    """Azurite's blob service on loopback for the life of a ``with`` block; see the module's
    docstring."""

    name = "azurite"
    title = "Azurite"
    stop_timeout = STOP_TIMEOUT

    def __init__(self, container: str = CONTAINER) -> None:
        super().__init__()
        self.container = container

    @property
    def connection_string(self) -> str:
        return connection_string(self.endpoint)

    @property
    def options(self) -> dict[str, str]:
        """The ``storage_options`` that send trainsnap's ``az://`` backend (adlfs) here."""
        return {"connection_string": self.connection_string}

    def url(self, prefix: str) -> str:
        return f"az://{self.container}/{prefix}"

    def _binary(self) -> str:
        return azurite_binary()

    def _command(self, binary: str, workdir: Path) -> list[str]:
        port = self._listen()
        return [
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

    def _probe(self) -> Callable[[], None]:
        """Create the container (or find it there)."""
        from azure.core.exceptions import ResourceExistsError
        from azure.storage.blob import BlobServiceClient

        client = BlobServiceClient.from_connection_string(
            self.connection_string, retry_total=0, connection_timeout=2, read_timeout=10
        )

        def probe() -> None:
            with contextlib.suppress(ResourceExistsError):
                client.create_container(self.container)

        return probe
