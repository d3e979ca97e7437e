"""Block checksums and content-addressed object names.

Every object is cut into blocks of ``block_size`` bytes (the last one may be shorter) and each
block's digest is recorded in the manifest. An object's name is the digest of its size and its
block digests, so the name is a function of the bytes alone: the same name always means the same
bytes, and a retried or concurrent write of one object can never change its content.

``xxh3-128`` is the default (it hashes well beyond disk speed and releases the GIL);
``sha256`` is there for those who want a cryptographic hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Final

import xxhash

from trainsnap.errors import IncompatibleError

_Buffer = bytes | bytearray | memoryview

_OBJECT_DOMAIN: Final = b"trainsnap.object.v1\0"


def _xxh3_128(data: _Buffer) -> bytes:
    return xxhash.xxh3_128_digest(data)


def _sha256(data: _Buffer) -> bytes:
    return hashlib.sha256(data).digest()


_ALGORITHMS: Final[dict[str, tuple[Callable[[_Buffer], bytes], int]]] = {
    "xxh3-128": (_xxh3_128, 16),
    "sha256": (_sha256, 32),
}

_INCREMENTAL: Final[dict[str, Callable[[], Any]]] = {
    "xxh3-128": xxhash.xxh3_128,
    "sha256": hashlib.sha256,
}
"""Hash objects of the same algorithms, fed piece by piece (the same digest as one call)."""

DEFAULT_ALGORITHM: Final = "xxh3-128"


class Hasher:
    """One checksum algorithm at one block size."""

    __slots__ = ("_fn", "algorithm", "block_size", "digest_size")

    def __init__(self, algorithm: str = DEFAULT_ALGORITHM, block_size: int = 1 << 20) -> None:
        try:
            self._fn, self.digest_size = _ALGORITHMS[algorithm]
        except KeyError:
            raise IncompatibleError(
                f"unknown checksum algorithm {algorithm!r}; this trainsnap knows "
                f"{sorted(_ALGORITHMS)}. Upgrade trainsnap to read snapshots that use it."
            ) from None
        if block_size <= 0:
            raise IncompatibleError(f"block size must be positive, got {block_size}")
        self.algorithm = algorithm
        self.block_size = block_size

    def digest(self, data: _Buffer) -> bytes:
        return self._fn(data)

    def digest_parts(self, parts: Sequence[_Buffer]) -> bytes:
        """The digest of the concatenation of ``parts``, without concatenating them (a block
        read straight into several destination rows)."""
        if len(parts) == 1:
            return self._fn(parts[0])
        state = _INCREMENTAL[self.algorithm]()
        for part in parts:
            state.update(part)
        digest: bytes = state.digest()
        return digest

    def nblocks(self, size: int) -> int:
        return -(-size // self.block_size)

    def block_digests(self, data: memoryview) -> bytes:
        """Concatenated digests of every block of ``data`` (a 1-D byte memoryview)."""
        b = self.block_size
        fn = self._fn
        return b"".join(fn(data[i : i + b]) for i in range(0, len(data), b))

    def object_name(self, size: int, digests: bytes) -> str:
        """The content address of an object of ``size`` bytes with these block digests."""
        return self._fn(_OBJECT_DOMAIN + size.to_bytes(8, "little") + digests).hex()

    def name_length(self) -> int:
        return 2 * self.digest_size


def algorithms() -> list[str]:
    return sorted(_ALGORITHMS)
