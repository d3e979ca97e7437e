"""The structure of a saved state tree (format 4), so that a snapshot reads back with no template.

Entries are keyed by dotted paths (``optim.state.0.exp_avg``); the dotted path alone cannot say
that ``0`` was an int key, that ``state`` was an ``OrderedDict``, that a list was a tuple or that
an empty dict was there at all. The tree says it. A node is JSON:

* ``0``: a leaf, the tensor or value entry whose key is the node's dotted path;
* ``{"d": [[key, node], ...]}``: a dict, in order (``"o"``: an ``OrderedDict``);
* ``{"l": [node, ...]}``: a list (``"t"``: a tuple).

Keys are JSON scalars and keep their type (str, int, float, bool, null). A leaf's dotted path is
its keys joined by ``.`` (``str(key)`` for non-strings); two leaves with the same path are
refused when saving. Pure: no torch, no I/O.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Final

from trainsnap.format.flooding import check_spread

LEAF: Final = 0
MAPPINGS: Final = ("d", "o")
SEQUENCES: Final = ("l", "t")
_KINDS: Final = frozenset(MAPPINGS + SEQUENCES)
MAX_DEPTH: Final = 256
"""Deepest nesting a tree may have (a crafted tree must not exhaust the stack)."""

Key = str | int | float | bool | None


MAX_INT: Final = 1 << 1024
"""Integers (keys and plain values) lie in ``(-MAX_INT, MAX_INT)``: a reader parses no longer
number (JSON readers refuse integers of thousands of digits), so a save refuses one."""


def is_key(key: object) -> bool:
    """True for a key the tree can keep: a JSON scalar (floats finite, integers within
    :data:`MAX_INT`)."""
    if type(key) is str or key is None or type(key) is bool:
        return True
    if isinstance(key, int):
        return -MAX_INT < key < MAX_INT
    return isinstance(key, float) and math.isfinite(key)


def part(key: Key) -> str:
    """A key's part of a dotted path."""
    return key if isinstance(key, str) else str(key)


def join(prefix: str, key: Key) -> str:
    p = part(key)
    return f"{prefix}.{p}" if prefix else p


def kind(node: Any) -> str:
    """``"leaf"``, or the container kind of a node (``d``, ``o``, ``l``, ``t``)."""
    if type(node) is int and node == LEAF:
        return "leaf"
    if type(node) is dict and len(node) == 1:
        k = next(iter(node))
        if k in _KINDS:
            return str(k)
    raise ValueError(f"not a tree node: {_short(node)}")


def items(node: dict[str, Any]) -> list[tuple[Key, Any]]:
    """(key, child) of a container node; list indices are the keys of a sequence."""
    ((k, body),) = node.items()
    if k in SEQUENCES:
        return list(enumerate(body))
    return [(key, child) for key, child in body]


def mapping(kind_: str, pairs: Sequence[tuple[Key, Any]]) -> dict[str, Any]:
    return {kind_: [[k, child] for k, child in pairs]}


def sequence(kind_: str, children: Sequence[Any]) -> dict[str, Any]:
    return {kind_: list(children)}


def container_kind(obj: object) -> str:
    """The kind a Python container is saved as."""
    if isinstance(obj, OrderedDict):
        return "o"
    if isinstance(obj, tuple):
        return "t"
    if isinstance(obj, list):
        return "l"
    return "d"


def children(node: Any) -> dict[tuple[str, Key], Any]:
    """A mapping node's children by (key type name, key): each found in O(1)."""
    return {(type(k).__name__, k): c for k, c in items(node)}


def select(node: Any, prefixes: Sequence[str], prefix: str = "") -> Any:
    """The part of a mapping tree under the dotted ``prefixes`` (a prefix selects the key it
    names and everything below it); None when nothing matches."""
    if any(prefix == p or prefix.startswith(p + ".") for p in prefixes) and prefix:
        return node
    if kind(node) == "leaf":
        return None
    kept = []
    for k, c in items(node):
        path = join(prefix, k)
        if any(p == path or p.startswith(path + ".") or path.startswith(p + ".") for p in prefixes):
            sub = select(c, prefixes, path)
            if sub is not None:
                kept.append((k, sub))
    if not kept:
        return None
    k = kind(node)
    return sequence(k, [c for _, c in kept]) if k in SEQUENCES else mapping(k, kept)


def merge(a: Any, b: Any, path: str = "") -> Any:
    """One tree holding both (the ranks of a job may hold different keys: pipeline stages).
    Mapping keys are united in order of first appearance; a sequence takes the longer one's
    length. Raises ValueError naming the path where the two disagree on a kind."""
    if a is None:
        return b
    if b is None or a == b:
        return a
    ka, kb = kind(a), kind(b)
    if ka != kb:
        where = repr(path or "the root")
        raise ValueError(f"{where} is a {_NAMES[ka]} on one rank, a {_NAMES[kb]} on another")
    if ka in SEQUENCES:
        xs, ys = a[ka], b[kb]
        n = max(len(xs), len(ys))
        return sequence(
            ka,
            [
                merge(xs[i] if i < len(xs) else None, ys[i] if i < len(ys) else None, join(path, i))
                for i in range(n)
            ],
        )
    merged: dict[tuple[str, Key], Any] = {}
    for key, c in items(a):
        merged[(type(key).__name__, key)] = c
    for key, c in items(b):
        tk = (type(key).__name__, key)
        merged[tk] = merge(merged.get(tk), c, join(path, key))
    return mapping(ka, [(k, c) for (_, k), c in merged.items()])


_NAMES: Final = {
    "leaf": "tensor or value",
    "d": "dict",
    "o": "OrderedDict",
    "l": "list",
    "t": "tuple",
}


def name(kind_: str) -> str:
    return _NAMES[kind_]


PATH_BUDGET: Final = 16
"""The dotted paths of all a tree's nodes may add up to at most this many times the length of
the entries' keys (plus :data:`PATH_SLACK`): a reader builds each node's path, and a crafted
tree of long keys nested deep would otherwise make it build gigabytes from a small manifest."""
PATH_SLACK: Final = 1 << 24


def problems(tree: Any, keys: set[str]) -> list[str]:
    """What is wrong with a decoded tree, given the keys of the manifest's entries: every leaf
    must name an entry and every entry be reached by a leaf; nesting is bounded; keys are
    scalars, distinct within their container, of spread hashes
    (:mod:`~trainsnap.format.flooding`); the nodes' paths add up to a bounded length.

    O(nodes + the keys' total length) time and memory: a path is joined only for a leaf, and
    only when it is no longer than the longest key (it must then name an entry)."""
    try:
        if kind(tree) not in MAPPINGS:
            return ["tree: the root is not a mapping"]
        found = _check(tree, keys)
    except (ValueError, TypeError) as e:
        return [f"tree: {e}"]
    unreached = len(keys) - found
    if unreached:
        example = next(iter(sorted(keys)))
        return [f"tree: {unreached} entry/entries have no leaf (the keys include {example!r})"]
    return []


_Link = tuple[Any, str] | None
"""A node's dotted path as a linked list (parent's link, own part): O(1) per node to extend."""


def _joined(link: _Link) -> str:
    parts = []
    while link is not None:
        link, piece = link
        parts.append(piece)
    return ".".join(reversed(parts))


def _check(root: Any, keys: set[str]) -> int:
    """How many leaves a well-formed tree has, each naming one of ``keys``; ValueError naming
    what is malformed (the first leaf naming no entry, a repeated leaf, a path longer than
    any key, a total path length beyond the budget)."""
    longest = max(map(len, keys), default=0)
    budget = PATH_BUDGET * sum(map(len, keys)) + PATH_SLACK
    found: set[str] = set()
    stack: list[tuple[Any, _Link, int, int]] = [(root, None, 0, -1)]
    while stack:
        n, link, d, length = stack.pop()
        budget -= max(length, 0)
        if budget < 0:
            raise ValueError("its paths add up to more than its keys can account for")
        if type(n) is int and n == LEAF:  # most nodes: inline, this runs on every decode
            if length > longest:
                raise ValueError(f"a leaf's path of {length} characters names no entry")
            path = _joined(link)
            if path not in keys:
                raise ValueError(f"a leaf names no entry: {_short(path)}")
            if path in found:
                raise ValueError(f"two leaves share the key {_short(path)}")
            found.add(path)
            continue
        if d > MAX_DEPTH:
            raise ValueError(f"nested deeper than {MAX_DEPTH}")
        k = kind(n)
        body = n[k]
        if not isinstance(body, list):
            raise ValueError(f"a {_NAMES[k]} node holds a {type(body).__name__}")
        if k in SEQUENCES:
            for i, c in enumerate(body):
                piece = str(i)
                stack.append((c, (link, piece), d + 1, length + 1 + len(piece)))
            continue
        for pair in body:
            if not (type(pair) is list and len(pair) == 2 and is_key(pair[0])):
                raise ValueError(f"bad {_NAMES[k]} item {_short(pair)}")
        check_spread((pair[0] for pair in body), f"a {_NAMES[k]} node")
        seen = set()
        for pair in body:
            key = pair[0]
            tk = (type(key), key)
            if tk in seen:
                raise ValueError(f"a {_NAMES[k]} repeats the key {_short(key)}")
            seen.add(tk)
            piece = key if type(key) is str else str(key)
            stack.append((pair[1], (link, piece), d + 1, length + 1 + len(piece)))
    return len(found)


def _short(obj: object) -> str:
    text = repr(obj)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = [
    "LEAF",
    "MAX_DEPTH",
    "MAX_INT",
    "container_kind",
    "is_key",
    "items",
    "join",
    "kind",
    "mapping",
    "merge",
    "name",
    "part",
    "problems",
    "select",
    "sequence",
]
