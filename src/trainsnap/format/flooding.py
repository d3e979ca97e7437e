"""A guard against hash flooding in what a reader builds from stored bytes.

Python's sets and dicts are O(1) per insertion only while keys' hashes differ. Strings and bytes
hash with a per-process random key, so nobody can make many of them collide; integers, floats,
``None`` and booleans hash to a fixed function of their value (an integer ``k * (2**61 - 1)``
hashes to 0 for every ``k``), so a crafted snapshot can hold thousands of keys that all land on one
slot, and building the container costs O(n^2) probes. A reader that builds a set, a dict or a
tree node from stored keys first calls :func:`check_spread`: more than :data:`MAX_SHARED_HASH`
keys of one hash is refused, which keeps every insertion O(:data:`MAX_SHARED_HASH`). A writer
calls it too, so a save never makes what a reader refuses (no real data has even two integers of
one hash that are not equal, bar ``-1`` and ``-2``). Pure: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

MAX_SHARED_HASH: Final = 32
"""Most keys of one container that may share one hash value."""


class FloodError(ValueError):
    """A container whose keys share one hash beyond :data:`MAX_SHARED_HASH` (a ValueError, so
    every decoder's "malformed" path reports it)."""


def check_spread(keys: Iterable[Any], what: str) -> None:
    """Raise :class:`FloodError` naming ``what`` when more than :data:`MAX_SHARED_HASH` of
    ``keys`` share one hash value. Strings and bytes are skipped (their hashes are randomised).

    O(len(keys)) time: the counts are kept in a dict keyed by the hash values, and two distinct
    hash values never collide there beyond what the perturbed probing of a dict makes constant."""
    counts: dict[int, int] = {}
    for key in keys:
        if type(key) is str or type(key) is bytes:
            continue
        value = hash(key)
        seen = counts.get(value, 0) + 1
        if seen > MAX_SHARED_HASH:
            raise FloodError(
                f"{what} holds more than {MAX_SHARED_HASH} keys of one hash value (one is "
                f"{_short(key)}): a crafted container that would take quadratic time to build"
            )
        counts[value] = seen


def _short(obj: object) -> str:
    text = repr(obj)
    return text if len(text) <= 40 else text[:37] + "..."


__all__ = ["MAX_SHARED_HASH", "FloodError", "check_spread"]
