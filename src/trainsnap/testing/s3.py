"""A real S3 API server on loopback (moto), for tests and benchmarks of the ``s3://`` backend.

:class:`LoopbackS3` serves moto's S3 on 127.0.0.1, on a free port, in a thread of this process,
with fake credentials and one bucket, and counts the bytes of the object bodies it serves: what
a restore pulls from the store. Processes started while it runs (ranks of
:func:`trainsnap.testing.run_ranks`) inherit the credentials, reach it at :attr:`endpoint`, and
read the count at :attr:`served_url`. Needs ``moto[server]`` (a test dependency).

    with LoopbackS3() as s3:
        ts.save(state, s3.url("run-1"), step=1, storage_options=s3.options)

The S3 servers run as processes (:mod:`~trainsnap.testing.seaweedfs`,
:mod:`~trainsnap.testing.rclone`) are :class:`S3Server` launchers: the same credentials, one
bucket, ready once an object can be stored and deleted there.
"""

from __future__ import annotations

import os
import threading
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

from trainsnap.testing._server import Server
from trainsnap.testing.harness import free_port

BUCKET = "trainsnap-test"

FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
CLEARED = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL")
"""Variables that would send a client elsewhere or override the fake credentials."""

SERVED_PATH = "/_trainsnap/served"
"""Answers the count of body bytes served so far (this path is not S3's)."""


class _Counting:
    """WSGI middleware: counts the body bytes of every response to a GET."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.served = 0
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == SERVED_PATH:
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [str(self.served).encode()]
        body = self.app(environ, start_response)
        if environ.get("REQUEST_METHOD") != "GET":
            return body  # type: ignore[no-any-return]
        return self._counted(body)

    def _counted(self, body: Iterable[bytes]) -> Iterator[bytes]:
        try:
            for chunk in body:
                with self._lock:
                    self.served += len(chunk)
                yield chunk
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()


class LoopbackS3:
    """moto's S3 on loopback for the life of a ``with`` block; see the module's docstring."""

    def __init__(self, bucket: str = BUCKET) -> None:
        self.bucket = bucket
        self.endpoint = ""
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._app: _Counting | None = None
        self._saved_env: dict[str, str | None] = {}

    @property
    def options(self) -> dict[str, str]:
        """The ``storage_options`` that send trainsnap's ``s3://`` backend here."""
        return {"endpoint_url": self.endpoint}

    @property
    def served_url(self) -> str:
        return self.endpoint + SERVED_PATH

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def served(self) -> int:
        """Body bytes served so far (from this process)."""
        assert self._app is not None, "not started"
        return self._app.served

    def __enter__(self) -> LoopbackS3:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        self._saved_env = use_test_credentials()

        class Quiet(MotoRequestHandler):
            def log_request(self, *args: Any) -> None:
                """Not every request: a load makes thousands."""

        port = free_port()
        self._app = _Counting(DomainDispatcherApplication(create_backend_app))
        self._server = make_server(
            "127.0.0.1", port, self._app, threaded=True, request_handler=Quiet
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="loopback-s3", daemon=True
        )
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{port}"
        try:
            import boto3

            client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")
            client.create_bucket(Bucket=self.bucket)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join()
        self._server = self._thread = None
        restore_environment(self._saved_env)
        self._saved_env = {}


class S3Server(Server):
    """An S3 server process on loopback (a :class:`~trainsnap.testing._server.Server`) with the
    test credentials in this process's environment while it runs, and one bucket."""

    create_bucket: ClassVar[bool] = True
    """Whether the probe creates the bucket (False: the server has it from the start)."""
    poll_seconds: ClassVar[float] = 0.2

    def __init__(self, bucket: str = BUCKET) -> None:
        super().__init__()
        self.bucket = bucket
        self._saved_env: dict[str, str | None] = {}

    @property
    def options(self) -> dict[str, str]:
        """The ``storage_options`` that send trainsnap's ``s3://`` backend here."""
        return {"endpoint_url": self.endpoint}

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def _setup(self) -> None:
        self._saved_env = use_test_credentials()

    def _cleanup(self) -> None:
        restore_environment(self._saved_env)
        self._saved_env = {}

    def _probe(self) -> Callable[[], None]:
        """Store and delete an object in the bucket (creating it first when
        :attr:`create_bucket`): a gateway may answer while what stores its data is not up."""
        import boto3
        from botocore.config import Config

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10),
        )

        def probe() -> None:
            if self.create_bucket:
                client.create_bucket(Bucket=self.bucket)
            client.put_object(Bucket=self.bucket, Key="ready-probe", Body=b"")
            client.delete_object(Bucket=self.bucket, Key="ready-probe")

        return probe


def use_test_credentials() -> dict[str, str | None]:
    """Put the fake credentials in this process's environment (its children inherit them) and
    clear what would override them; returns what was there, for :func:`restore_environment`."""
    saved = {name: os.environ.get(name) for name in (*FAKE_CREDENTIALS, *CLEARED)}
    os.environ.update(FAKE_CREDENTIALS)
    for name in CLEARED:
        os.environ.pop(name, None)
    return saved


def restore_environment(saved: dict[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def served(served_url: str) -> int:
    """Body bytes a :class:`LoopbackS3` has served so far, asked from any process."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
    with direct.open(served_url, timeout=30) as answer:
        return int(answer.read())
