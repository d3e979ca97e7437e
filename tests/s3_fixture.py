"""A real S3 API server on loopback (moto), for tests that exercise the ``s3://`` backend.

The server runs in a thread of the test process for the whole session, so that S3 tests talk
HTTP to an actual endpoint (signing, ranged GETs, listings) without any network access or real
credentials. Tests ask for :func:`s3_root` to get a fresh prefix each, and open it with
:func:`open_s3`.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from trainsnap.storage import Storage, open_storage

BUCKET = "trainsnap-test"

_FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
# Variables that would send the client elsewhere or override the fake credentials.
_CLEARED = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL")


@dataclass(frozen=True)
class S3Root:
    """A fresh prefix of the test bucket, and the endpoint that serves it."""

    url: str
    endpoint: str

    def open(self) -> Storage:
        return open_s3(self.url, self.endpoint)


def open_s3(url: str, endpoint: str) -> Storage:
    """``url`` as a Storage talking to the loopback server (never a real AWS endpoint)."""
    return open_storage(url, endpoint_url=endpoint)


def bucket_keys(endpoint: str) -> set[str]:
    """Every key in the test bucket, read with boto3 rather than the backend under test."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
    return {obj["Key"] for page in pages for obj in page.get("Contents", [])}


def _free_port() -> int:
    """A port the kernel considers free now; the server binds it right after."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """Start the loopback S3 server with fake credentials and one bucket; yield its URL."""
    pytest.importorskip("s3fs")
    boto3 = pytest.importorskip("boto3")
    server_mod = pytest.importorskip("moto.server")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in _FAKE_CREDENTIALS.items():
            mp.setenv(name, value)
        for name in _CLEARED:
            mp.delenv(name, raising=False)
        port = _free_port()
        server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        try:
            endpoint = f"http://127.0.0.1:{port}"
            client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
            client.create_bucket(Bucket=BUCKET)
            yield endpoint
        finally:
            server.stop()


@pytest.fixture
def s3_root(s3_endpoint: str) -> S3Root:
    """A unique ``s3://bucket/<prefix>`` per test, so tests never see each other's keys."""
    return S3Root(f"s3://{BUCKET}/t-{uuid.uuid4().hex[:12]}", s3_endpoint)
