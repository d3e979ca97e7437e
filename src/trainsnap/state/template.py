"""The state given to a load, walked once into typed nodes that every later step of the load reads.

A load needs the user's state at several steps: before the manifest is read, to say what this
rank wants of it (:mod:`trainsnap.protocol.manifest_share`); then to plan the load against the
saved tree (:mod:`trainsnap.protocol.tree_load`) or, for a snapshot without one, to list what to
fill (:func:`targets_of`); then to fill and apply. :class:`Walker` visits the state once: each
stateful object's ``state_dict()`` is called once, each tensor leaf is described once (a
:class:`~trainsnap.state.capture.TensorItem`: a DTensor's box worked out once), and the later
steps read the nodes, never the state. O(containers + leaves) for the walk.

The walk follows :func:`trainsnap.state.capture.capture`: mappings are always walked, a list or
tuple only when a tensor or a stateful object is under it (otherwise it is a plain value, walked
on demand as plain data when a saved tree has a container there). A failure to describe a leaf
or a stateful object is kept in its node and raised by the step that uses it, so a part of the
state the snapshot does not ask about fails no load.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, MutableSequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from trainsnap.errors import InvalidArgumentError, TrainsnapError
from trainsnap.format import tree
from trainsnap.state.capture import (
    DTensorBoxes,
    Exact,
    Sharded,
    Targets,
    TensorItem,
    ValueTarget,
    check_root,
    has_tensor,
    is_stateful,
    join_key,
    leaf_item,
    state_dict_of,
)


@dataclass(slots=True)
class TensorNode:
    """A tensor leaf (a tensor, a DTensor, a :class:`Sharded`), filled in place."""

    obj: Any
    item: TensorItem | None
    error: TrainsnapError | None = None
    """Why the leaf cannot be described (a DTensor placement that is no box...)."""

    def described(self) -> TensorItem:
        """Its item; its error raised when it has none."""
        if self.error is not None:
            raise self.error
        assert self.item is not None
        return self.item


@dataclass(slots=True)
class ValueNode:
    """Any other leaf: a plain value, or a placeholder a load replaces (None, ``[]``...)."""

    obj: Any
    deep: bool = False
    """A container past the deepest nesting a tree may have (which a cycle always is)."""


@dataclass(slots=True)
class MappingNode:
    obj: Mapping[Any, Any]
    children: list[tuple[Any, Node]]
    """(key, node) in the mapping's order."""
    exact: bool = False
    """An :class:`Exact` mapping: its keys (or ``allowed``) are all a load may fill."""
    allowed: frozenset[Any] | None = None


@dataclass(slots=True)
class SequenceNode:
    obj: list[Any] | tuple[Any, ...]
    children: list[Node]


@dataclass(slots=True)
class StatefulNode:
    """An object with ``state_dict``/``load_state_dict``: its state dict, walked."""

    obj: Any
    state: MappingNode | None
    error: TrainsnapError | None = None
    """Why its state dict cannot be had (not a mapping)."""

    def walked(self) -> MappingNode:
        if self.error is not None:
            raise self.error
        assert self.state is not None
        return self.state


Node = TensorNode | ValueNode | MappingNode | SequenceNode | StatefulNode


def path(prefix: str, key: Any) -> str:
    """A child's dotted key (a key no tree can keep shown by its ``repr``)."""
    return tree.join(prefix, key) if tree.is_key(key) else f"{prefix}.{key!r}"


@dataclass(slots=True)
class Walker:
    """One load's walk of the user's state. Walking the same tensor or stateful object again
    (a :class:`~trainsnap.TrainState` gives its model's tree to say what it wants, then again in
    the tree it plans) reuses its node: ``state_dict()`` is called once per object a load."""

    boxes: DTensorBoxes = field(default_factory=DTensorBoxes)
    _tensors: dict[tuple[int, str], TensorNode] = field(default_factory=dict)
    _stateful: dict[int, StatefulNode] = field(default_factory=dict)

    def walk(self, obj: Any, key: str = "", depth: int = 0) -> Node:
        """The node of ``obj`` at dotted ``key``, and of everything under it."""
        if isinstance(obj, torch.Tensor | Sharded):
            return self._tensor(obj, key)
        container = isinstance(obj, Mapping | list | tuple)
        if depth > tree.MAX_DEPTH and (container or is_stateful(obj)):
            return ValueNode(obj, deep=True)
        if is_stateful(obj):
            return self._stateful_node(obj, key, depth)
        if isinstance(obj, Mapping):
            return self._mapping(obj, key, depth)
        if isinstance(obj, list | tuple) and has_tensor(obj):
            return self.sequence(obj, key, depth)
        return ValueNode(obj)

    def sequence(self, obj: list[Any] | tuple[Any, ...], key: str, depth: int = 0) -> SequenceNode:
        """A list or tuple walked item by item (also a plain one, when a saved tree asks)."""
        items = [self.walk(v, path(key, i), depth + 1) for i, v in enumerate(obj)]
        return SequenceNode(obj, items)

    def _tensor(self, leaf: Any, key: str) -> TensorNode:
        memo = (id(leaf), key)
        found = self._tensors.get(memo)
        if found is None:
            try:
                found = TensorNode(leaf, leaf_item(key, leaf, self.boxes))
            except TrainsnapError as e:
                found = TensorNode(leaf, None, e)
            self._tensors[memo] = found
        return found

    def _stateful_node(self, obj: Any, key: str, depth: int) -> StatefulNode:
        found = self._stateful.get(id(obj))
        if found is None:
            try:
                sd = state_dict_of(obj, key)
            except TrainsnapError as e:
                found = StatefulNode(obj, None, e)
            else:
                found = StatefulNode(obj, self._mapping(sd, key, depth))
            self._stateful[id(obj)] = found
        return found

    def _mapping(self, obj: Mapping[Any, Any], key: str, depth: int) -> MappingNode:
        children = [(k, self.walk(v, path(key, k), depth + 1)) for k, v in obj.items()]
        if isinstance(obj, Exact):
            return MappingNode(obj, children, exact=True, allowed=obj.allowed)
        return MappingNode(obj, children)


def walk(state: Any) -> Node:
    """The node of a load's whole ``state`` (a mapping, or an object with ``state_dict``);
    :class:`InvalidArgumentError` for anything else."""
    check_root(state)
    return Walker().walk(state)


def root_mapping(root: Node) -> MappingNode:
    """The mapping at the top of a walked state (a stateful root's state dict)."""
    if isinstance(root, StatefulNode):
        return root.walked()
    assert isinstance(root, MappingNode), "walk() refuses any other root"
    return root


def tensor_nodes(root: Node) -> list[TensorNode]:
    """Every tensor leaf under ``root``, in walk order. O(nodes)."""
    out: list[TensorNode] = []
    pending: list[Node] = [root]
    while pending:
        node = pending.pop()
        if isinstance(node, TensorNode):
            out.append(node)
        elif isinstance(node, MappingNode):
            pending.extend(child for _, child in reversed(node.children))
        elif isinstance(node, SequenceNode):
            pending.extend(reversed(node.children))
        elif isinstance(node, StatefulNode) and node.state is not None:
            pending.append(node.state)
    return out


def failed(root: Node) -> TrainsnapError | None:
    """The first failure kept in a node under ``root`` (None when every node was described)."""
    pending: list[Node] = [root]
    while pending:
        node = pending.pop()
        if isinstance(node, TensorNode | StatefulNode) and node.error is not None:
            return node.error
        if isinstance(node, MappingNode):
            pending.extend(child for _, child in node.children)
        elif isinstance(node, SequenceNode):
            pending.extend(node.children)
        elif isinstance(node, StatefulNode) and node.state is not None:
            pending.append(node.state)
    return None


def targets_of(root: Node) -> Targets:
    """What loading must fill in the walked state, for a snapshot without a saved tree: tensors
    to fill in place, containers to put plain values into, and each stateful object's
    ``load_state_dict`` (innermost first). O(nodes)."""
    out = Targets()
    _targets(root, "", None, None, out)
    return out


def _targets(node: Node, key: str, parent: Any, index: Any, out: Targets) -> None:
    if isinstance(node, TensorNode):
        out.tensors.append(node.described())
        return
    if isinstance(node, ValueNode):
        if node.deep:
            raise InvalidArgumentError(
                f"cannot load {key[:80]!r}: the state is nested deeper than {tree.MAX_DEPTH} "
                "containers there (or holds itself), which no reader reads back; flatten it or "
                "break the cycle",
                key=key[:200],
            )
        if isinstance(parent, tuple):
            raise InvalidArgumentError(
                f"cannot load the plain value {key!r}: it sits in a tuple, which cannot be "
                "changed in place; use a list",
                key=key,
            )
        target: MutableMapping[Any, Any] | MutableSequence[Any] | None = parent
        out.values.append(ValueTarget(key, target, index))
        return
    if isinstance(node, StatefulNode):
        state = node.walked()
        _targets(state, key, None, None, out)
        out.finishers.append(partial(node.obj.load_state_dict, state.obj))
        return
    if isinstance(node, MappingNode):
        for k, child in node.children:
            _targets(child, join_key(key, k), node.obj, k, out)
        return
    for i, child in enumerate(node.children):
        _targets(child, join_key(key, i), node.obj, i, out)


def targets(state: Any) -> Targets:
    """What loading must fill in ``state`` (:func:`targets_of` its walk)."""
    return targets_of(walk(state))


__all__ = [
    "MappingNode",
    "Node",
    "SequenceNode",
    "StatefulNode",
    "TensorNode",
    "ValueNode",
    "Walker",
    "failed",
    "path",
    "root_mapping",
    "targets",
    "targets_of",
    "tensor_nodes",
    "walk",
]
