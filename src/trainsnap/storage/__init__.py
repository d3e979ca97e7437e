"""Storage backends, registered lazily by URL scheme.

``open_storage("/data/run1")`` and ``open_storage("file:///data/run1")`` give a POSIX root,
``memory://name`` an in-process fsspec root, ``s3://bucket/prefix`` an S3 root (``pip install
trainsnap[s3]``; the endpoint comes from ``endpoint_url=`` or the ``AWS_ENDPOINT_URL``
environment variable, credentials the usual AWS way), ``gs://bucket/prefix`` a Google Cloud
Storage root through gcsfs (``trainsnap[gs]``) and ``az://container/prefix`` an Azure Blob root
through adlfs (``trainsnap[az]``; options such as ``account_name`` go to the file system).
:func:`register` adds a scheme.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

from trainsnap.errors import InvalidArgumentError
from trainsnap.storage import faulty
from trainsnap.storage.base import Storage, check_key
from trainsnap.storage.posix import PosixStorage
from trainsnap.storage.retry import RetryingStorage

__all__ = [
    "PosixStorage",
    "RetryingStorage",
    "Storage",
    "check_key",
    "open_storage",
    "register",
]

Factory = Callable[[str, dict[str, Any]], Storage]
_registry: dict[str, Factory] = {}


def register(scheme: str, factory: Factory) -> None:
    """Make ``scheme://...`` roots open with ``factory(url, options)``."""
    _registry[scheme] = factory


def _posix(url: str, options: dict[str, Any]) -> Storage:
    path = urlparse(url).path if url.startswith("file://") else url
    if os.path.lexists(path) and not os.path.isdir(path):
        raise InvalidArgumentError(
            f"root {url} is a file, not a directory: a root is the directory that holds "
            "snapshots/ and objects/; pass that directory, or a path where one may be created",
            path=url,
        )
    return PosixStorage(path, **options)


def _memory(url: str, options: dict[str, Any]) -> Storage:
    import fsspec

    from trainsnap.storage.fsspec import FsspecStorage

    fs = fsspec.filesystem("memory", **options)
    return FsspecStorage(fs, url, url)


def _s3(url: str, options: dict[str, Any]) -> Storage:
    try:
        import s3fs
    except ImportError as e:
        raise InvalidArgumentError(
            f"root {url!r} needs s3fs, which is not installed: pip install 'trainsnap[s3]'",
            path=url,
        ) from e
    from trainsnap.storage.fsspec import CLIENT_RETRIES, FsspecStorage, client_options

    opts = client_options(options)
    endpoint = opts.pop("endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL")
    client_kwargs = dict(opts.pop("client_kwargs", {}))
    if endpoint:
        client_kwargs.setdefault("endpoint_url", endpoint)
    fs = s3fs.S3FileSystem(
        client_kwargs=client_kwargs,
        use_listings_cache=False,
        skip_instance_cache=True,
        **opts,
    )
    fs.retries = CLIENT_RETRIES
    parsed = urlparse(url)
    if not parsed.netloc:
        raise InvalidArgumentError(f"S3 root {url!r} names no bucket (s3://bucket/prefix)")
    return FsspecStorage(fs, f"{parsed.netloc}{parsed.path}".rstrip("/"), url)


def _fsspec_scheme(module: str, extra: str, protocol: str) -> Factory:
    """A factory of roots on the fsspec file system ``protocol`` from ``module`` (the extra
    ``extra`` installs it); the first segment of the URL is the bucket or container."""

    def factory(url: str, options: dict[str, Any]) -> Storage:
        try:
            __import__(module)
        except ImportError as e:
            raise InvalidArgumentError(
                f"root {url!r} needs {module}, which is not installed: "
                f"pip install 'trainsnap[{extra}]'",
                path=url,
            ) from e
        import fsspec

        from trainsnap.storage.fsspec import FsspecStorage

        parsed = urlparse(url)
        if not parsed.netloc:
            raise InvalidArgumentError(
                f"root {url!r} names no bucket or container ({parsed.scheme}://name/prefix)",
                path=url,
            )
        fs = fsspec.filesystem(protocol, skip_instance_cache=True, **options)
        return FsspecStorage(fs, f"{parsed.netloc}{parsed.path}".rstrip("/"), url)

    return factory


register("", _posix)
register("file", _posix)
register("memory", _memory)
register("s3", _s3)
register("gs", _fsspec_scheme("gcsfs", "gs", "gcs"))
register("az", _fsspec_scheme("adlfs", "az", "az"))


Root = str | os.PathLike[str] | Storage
"""Where a run keeps its snapshots: a path, a URL (``file://``, ``s3://``, ``gs://``, ``az://``,
``memory://``) or a storage."""


def open_storage(root: Root, **options: Any) -> Storage:
    """The storage for a root given as a path, a URL or an already open :class:`Storage`,
    with bounded retries of transient errors (:class:`RetryingStorage`)."""
    if isinstance(root, Storage) and not isinstance(root, str | os.PathLike):
        if isinstance(root, RetryingStorage):
            return root
        return RetryingStorage(faulty.from_env(root))
    url = os.fspath(root)
    if not url:
        raise InvalidArgumentError("root is empty; give a directory or a URL like s3://b/prefix")
    scheme = urlparse(url).scheme if "://" in url else ""
    factory = _registry.get(scheme)
    if factory is None:
        raise InvalidArgumentError(
            f"no storage backend for scheme {scheme!r} in root {url!r}; known: "
            f"{sorted(s for s in _registry if s)}, or a plain path",
            path=url,
        )
    return RetryingStorage(faulty.from_env(factory(url, options)))
