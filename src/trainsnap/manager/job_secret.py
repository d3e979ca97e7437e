"""The job secret: what ties a memory-tier snapshot to the durable root it belongs to.

A memory tier lives on a host's tmpfs, where its directory names can be computed by anyone, and a
marker's ``job`` and ``generation`` are written by whoever can write the directory. So the first
writer of a durable root creates ``lease/secret`` beside the root's writer generations
(``lease/gen-<N>``, :mod:`~trainsnap.manager.lease`): 32 random bytes, hex, created once with a
create-if-absent (two jobs starting at once read the one that won). Every memory marker carries
it; a memory snapshot is restored, promoted or deleted only when :func:`marker_matches` says its
secret is the root's. Deleting the durable root deletes the secret, so a tier left by a deleted
run never matches the next run on the same URL: it is stale, set aside, never restored.

A crafted or damaged secret (not 64 hex digits, too large, not a regular file) is a
:class:`~trainsnap.errors.CorruptError` naming the key and the fix. O(1) requests.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Mapping
from typing import Any, Final

from trainsnap.errors import CorruptError
from trainsnap.storage.base import NotRegularFileError, Storage

SECRET_KEY: Final = "lease/secret"
SECRET_FIELD: Final = "secret"
"""The field of a memory marker that carries the secret."""
_LENGTH: Final = 64
_HEX: Final = frozenset("0123456789abcdef")


def job_secret(storage: Storage) -> str:
    """The secret of the durable root ``storage``, created when it has none yet (call it when
    taking the root for writing, beside the writer generation)."""
    found = read_secret(storage)
    if found is not None:
        return found
    storage.put_if_absent(SECRET_KEY, secrets.token_hex(_LENGTH // 2).encode())
    found = read_secret(storage)  # ours, or the one a job starting at once created first
    if found is None:
        raise CorruptError(
            f"{storage.url}/{SECRET_KEY} disappeared just after it was created: another "
            "process is deleting this root's lease; stop it and start again",
            path=SECRET_KEY,
        )
    return found


def read_secret(storage: Storage) -> str | None:
    """The root's secret, or None when it has none (a fresh or deleted root). Reads at most
    :data:`_LENGTH` + 1 bytes, after a stat."""
    try:
        size = storage.stat(SECRET_KEY)
        data = bytes(storage.get(SECRET_KEY, 0, min(size, _LENGTH + 1))) if size else b""
    except NotRegularFileError as e:
        raise _damaged(storage, f"not a regular file ({e.strerror})") from None
    except FileNotFoundError:
        return None
    text = data.decode("ascii", "replace")
    if size != _LENGTH or len(text) != _LENGTH or not set(text) <= _HEX:
        raise _damaged(storage, f"{size} bytes, not {_LENGTH} hexadecimal digits")
    return text


def _damaged(storage: Storage, why: str) -> CorruptError:
    return CorruptError(
        f"{storage.url}/{SECRET_KEY} is damaged ({why}). Delete it to start a new secret: the "
        "memory-tier snapshots of this root are then set aside, never restored",
        path=SECRET_KEY,
    )


def marker_matches(marker: Mapping[str, Any], secret: str) -> bool:
    """Whether a memory marker carries ``secret`` (compared in constant time): False for a
    marker without one, or with another."""
    carried = marker.get(SECRET_FIELD)
    if not isinstance(carried, str) or len(carried) != _LENGTH:
        return False
    return hmac.compare_digest(carried.encode("ascii", "replace"), secret.encode("ascii"))


__all__ = ["SECRET_FIELD", "SECRET_KEY", "job_secret", "marker_matches", "read_secret"]
