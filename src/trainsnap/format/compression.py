"""Lossless compression of objects: byte grouping of floating-point data, then zstd, one
independent frame per block.

Floating-point bytes compress poorly as they are: the exponent and high mantissa bytes of
neighbouring values are alike, the low mantissa bytes are noise, and they are interleaved.
Byte grouping ("bg4" for 4-byte elements) stores all first bytes, then all second bytes, and so
on, so zstd sees the alike bytes together. Each block is compressed on its own, so a ranged read
still touches only the blocks it needs; each frame is verified by the checksum of its stored
bytes and, once decoded, by the checksum of the data.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

from trainsnap.errors import IncompatibleError
from trainsnap.format.manifest import OBJECT_CODECS

CODECS: Final = OBJECT_CODECS


LEVEL: Final = 3


def _zstd() -> object:
    try:
        import zstandard
    except ImportError as e:
        raise IncompatibleError(
            "this snapshot (or save) uses zstd compression, which needs the zstandard package: "
            "pip install zstandard"
        ) from e
    return zstandard


def for_dtype(itemsize: int) -> str:
    """The codec for tensor data of this element size."""
    return f"bg{itemsize}+zstd" if itemsize in (2, 4, 8) else "zstd"


def group_width(codec: str) -> int:
    return int(codec[2]) if codec.startswith("bg") else 1


def _group(block: memoryview, width: int) -> bytes:
    n = len(block) - len(block) % width
    a = np.frombuffer(block[:n], dtype=np.uint8).reshape(-1, width)
    return np.ascontiguousarray(a.T).tobytes() + bytes(block[n:])


def _ungroup(data: bytes, width: int, size: int) -> bytes:
    n = size - size % width
    a = np.frombuffer(data[:n], dtype=np.uint8).reshape(width, -1)
    return np.ascontiguousarray(a.T).tobytes() + data[n:]


def compress_block(block: memoryview, codec: str) -> bytes:
    zstandard = _zstd()
    width = group_width(codec)
    raw = _group(block, width) if width > 1 else bytes(block)
    return zstandard.ZstdCompressor(level=LEVEL).compress(raw)  # type: ignore[attr-defined, no-any-return]


def decompress_block(frame: bytes | memoryview, codec: str, size: int) -> bytes:
    """The ``size`` bytes a frame holds. Never produces more than ``size + 1`` bytes, whatever the
    frame declares (a small frame can claim gigabytes: the binding's ``max_output_size`` is
    ignored when a frame declares its size); ``ValueError`` for a frame that is malformed or does
    not decode to exactly ``size`` bytes."""
    zstandard: Any = _zstd()
    try:
        declared = zstandard.frame_content_size(bytes(frame[:18]))
        if declared > size:
            raise ValueError(f"frame declares {declared} bytes, its block holds {size}")
        data = _read_bounded(zstandard.ZstdDecompressor(), bytes(frame), size + 1)
    except zstandard.ZstdError as e:
        raise ValueError(f"malformed zstd frame ({e})") from e
    if len(data) != size:
        raise ValueError(f"frame decodes to {len(data)} bytes, expected {size}")
    width = group_width(codec)
    return _ungroup(data, width, size) if width > 1 else data


def _read_bounded(decompressor: Any, frame: bytes, limit: int) -> bytes:
    """Decode at most ``limit`` bytes of ``frame``, streaming."""
    parts: list[bytes] = []
    got = 0
    with decompressor.stream_reader(frame) as reader:
        while got < limit:
            part = reader.read(limit - got)
            if not part:
                break
            parts.append(part)
            got += len(part)
    return b"".join(parts)


def codec_for(compression: str | None, itemsize: int) -> str:
    """The object codec for a payload, given a save's compression setting."""
    if compression in (None, "none", "raw"):
        return "raw"
    if compression == "zstd":
        return "zstd"
    if compression == "bytegroup+zstd":
        return for_dtype(itemsize)
    raise IncompatibleError(
        f"unknown compression {compression!r}: use None, 'zstd' or 'bytegroup+zstd'"
    )
