"""The load rule, driven by the saved tree (format 4), and template-free reads.

The top-level keys of the state given to a load say what to restore; under each of them the
snapshot's tree decides what comes back, exactly as saved:

* a tensor in the state is filled in place (its layout may differ from the saved one);
* a placeholder (None, ``{}``, ``[]``, a dict with fewer keys, a shorter list, a plain value) is
  replaced or completed from the snapshot: plain values decoded, containers rebuilt with their
  saved kind, key types and order, unsharded tensors created on CPU;
* an object with ``load_state_dict`` gets its saved subtree (its current state dict is the
  template: tensors there are filled in place, the rest is filled as above);
* a module's state dict, and a :class:`~trainsnap.state.capture.Exact` mapping (a
  ``TrainState``'s model, optimizer state -- its parameters' names -- and gradients), is
  exact: saved keys it does not admit are left out (in a job of pipeline stages every stage
  saved its own layers into one tree, and a stage holds only its own); a saved key that no
  rank admits is refused: in a load of one process here, in a load of several at the outcome
  agreement (:mod:`trainsnap.protocol.load_protocol`);
* a saved tensor that was sharded (several shards) with no destination tensor is refused --
  never a hidden full materialisation on every rank;
* a key the state holds that the snapshot lacks, and a container the state holds with more items
  than the snapshot's, are errors.

Everything is planned before the first byte is read; values are assigned only once every read
succeeded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any, cast

import torch

from trainsnap.errors import (
    CorruptError,
    IncompatibleError,
    InvalidArgumentError,
    NotFoundError,
)
from trainsnap.format import tree, values
from trainsnap.format.manifest import Manifest, keys_summary
from trainsnap.format.regions import Box
from trainsnap.protocol.rank_load import rank_scoped, refuse_rank_bound
from trainsnap.state.capture import Targets, TensorItem, ValueTarget
from trainsnap.state.template import (
    MappingNode,
    Node,
    SequenceNode,
    StatefulNode,
    TensorNode,
    ValueNode,
    Walker,
    path,
    root_mapping,
)

Realize = Callable[[dict[str, Any]], Any]
"""Builds a node's final object once the values are decoded (by key); ``_SAME`` for a node
filled in place."""
_SAME: Realize = cast(Realize, object())
"""What a node filled in place builds: the template's own object stays where it is."""
_ABSENT: Any = object()
"""What a read builds for a leaf that only other ranks hold (left out of its container)."""


class _Planner:
    def __init__(
        self,
        manifest: Manifest,
        rank: int,
        *,
        lenient: bool = False,
        alone: bool = False,
        skip: tuple[str, ...] = (),
    ) -> None:
        """``lenient``: a read (sharded tensors are assembled whole; another rank's entries
        are left out) rather than a load. ``alone``: a load of one process (no other rank
        can hold the saved keys an exact mapping lacks). ``skip``: saved keys (dotted
        prefixes) an exact mapping leaves out on purpose: neither a problem nor left out."""
        self.m, self.rank, self.lenient, self.alone = manifest, rank, lenient, alone
        self.skip = skip
        self.targets = Targets()
        self.missing: list[str] = []
        self.problems: list[tuple[str, str]] = []
        self.stateful: list[Callable[[], None]] = []

    # -- leaves ------------------------------------------------------------------------------

    def _tensor_into(self, tmpl: TensorNode) -> Realize:
        # Whether the snapshot holds this tensor is checked by rank_load.match, with the rest.
        self.targets.tensors.append(tmpl.described())
        return _SAME

    def _created_tensor(self, t: int, key: str) -> Realize:
        shape = self.m.tensor_shapes[t]
        shards = self.m.tensor_shards(t)
        if not self.lenient and (len(shards) != 1 or shards[0][1] != Box.full(shape)):
            self.problems.append(
                (
                    key,
                    f"saved sharded ({len(shards)} shards of shape {list(shape)}) and the state "
                    "holds no tensor there to load into: put a tensor of this rank's layout "
                    "(a DTensor or ts.Sharded) at this key; trainsnap never assembles a sharded "
                    "tensor whole on every rank unasked (ts.read does it on request)",
                )
            )
            return lambda _d: None
        try:  # pages untouched until read: what a read fills is what the objects hold
            local = torch.empty(shape, dtype=values.dtype_from_name(self.m.tensor_dtypes[t]))
        except (RuntimeError, MemoryError) as e:
            raise CorruptError(
                f"snapshot {self.m.snapshot_id}: tensor {key!r} of shape {list(shape)} cannot "
                f"be allocated ({type(e).__name__}); its manifest declares more than this host "
                "holds, or is damaged",
                snapshot_id=self.m.snapshot_id,
                key=key,
            ) from None
        self.targets.tensors.append(TensorItem(key, local, shape, Box.full(shape)))
        return lambda _d: local

    def _saved_leaf(self, key: str) -> Realize:
        t = self.m.find_tensor(key, self.rank)
        if t is not None:
            return self._created_tensor(t, key)
        if self.m.find_value(key, self.rank) is not None:
            self.targets.values.append(ValueTarget(key, None, None))
            return lambda d: d[key]
        if self.lenient:  # a read: another rank's entry, not this rank's
            return lambda _d: _ABSENT
        self.missing.append(key)
        return lambda _d: None

    # -- nodes -------------------------------------------------------------------------------

    def node(self, tmpl: Node | None, saved: Any, key: str, exact: bool = False) -> Realize:
        """How the saved ``saved`` comes back where the walked state has ``tmpl`` (None: the
        state has nothing there)."""
        if isinstance(tmpl, TensorNode):
            if saved is None or tree.kind(saved) == "leaf":
                return self._tensor_into(tmpl)
            self.problems.append(
                (key, f"the state holds a tensor, the snapshot a {tree.name(tree.kind(saved))}")
            )
            return _SAME
        if isinstance(tmpl, StatefulNode):
            return self._stateful(tmpl, saved, key)
        if saved is None:
            self.missing.append(key)
            obj = None if tmpl is None else tmpl.obj
            return lambda _d: obj
        kind = tree.kind(saved)
        if kind == "leaf":
            return self._saved_leaf(key)
        if kind in tree.MAPPINGS:
            is_exact = isinstance(tmpl, MappingNode) and tmpl.exact
            return self._mapping(tmpl, saved, key, exact or is_exact)
        return self._sequence(tmpl, saved, key)

    def _stateful(self, node: StatefulNode, saved: Any, key: str) -> Realize:
        obj = node.obj
        build = self.node(node.walked(), saved, key, exact=isinstance(obj, torch.nn.Module))
        stateful = self.stateful  # not self: see plan()

        def realize(decoded: dict[str, Any]) -> Any:
            new = build(decoded)
            stateful.append(lambda: obj.load_state_dict(new))
            return obj

        return realize

    def _mapping(self, tmpl: Node | None, saved: Any, key: str, exact: bool) -> Realize:
        kind = tree.kind(saved)
        pairs = tree.items(saved)
        saved_keys = {(type(k), k) for k, _ in pairs}
        node = tmpl if isinstance(tmpl, MappingNode) else None
        given = dict(node.children) if node is not None else {}
        for k in given:
            if (type(k), k) not in saved_keys:
                self.missing.append(_path(key, k))
        if exact:
            allowed = node.allowed if node is not None else None
            held = {(type(k), k) for k in (given if allowed is None else allowed)}
            lacked = [_path(key, k) for k, _ in pairs if (type(k), k) not in held]
            lacked = [k for k in lacked if not _under(k, self.skip)]
            if lacked and self.alone:
                self.problems.append(
                    (
                        key,
                        f"the snapshot holds {len(lacked)} key(s) here that the state lacks "
                        f"({keys_summary(lacked)}): load into the configuration that was "
                        "saved, or take what you need with ts.read",
                    )
                )
            pairs = [(k, c) for k, c in pairs if (type(k), k) in held]
            self.targets.left_out += lacked
            self.targets.admitted += [_path(key, k) for k, _ in pairs]
        children = []
        for k, c in pairs:
            old = given.get(k)
            children.append((k, old, self.node(old, c, tree.join(key, k))))
        wanted = OrderedDict if kind == "o" else dict
        container = node.obj if node is not None else None
        in_place = isinstance(container, MutableMapping) and type(container) is wanted
        held_keys = [k for k, _ in node.children] if node is not None else []

        def realize(decoded: dict[str, Any]) -> Any:
            built = [
                (k, v)
                for k, old, build in children
                if (v := _built(build, old, decoded)) is not _ABSENT
            ]
            if not in_place:
                return wanted(built)
            assert isinstance(container, MutableMapping)
            if held_keys == [k for k, _ in built]:
                for k, v in built:
                    container[k] = v
            else:
                container.clear()
                container.update(built)
            return container

        return realize

    def _sequence(self, tmpl: Node | None, saved: Any, key: str) -> Realize:
        kind = tree.kind(saved)
        body = saved[kind]
        if isinstance(tmpl, ValueNode) and isinstance(tmpl.obj, list | tuple) and not tmpl.deep:
            tmpl = Walker().sequence(tmpl.obj, key)  # plain data: nothing under it to call
        given: list[Node] = tmpl.children if isinstance(tmpl, SequenceNode) else []
        if len(given) > len(body):
            self.problems.append(
                (key, f"the state holds {len(given)} items, the snapshot {len(body)}")
            )
        olds = [given[i] if i < len(given) else None for i in range(len(body))]
        children = [
            (old, self.node(old, c, tree.join(key, i)))
            for i, (old, c) in enumerate(zip(olds, body, strict=True))
        ]
        container = tmpl.obj if isinstance(tmpl, SequenceNode) else None
        in_place = kind == "l" and type(container) is list

        def realize(decoded: dict[str, Any]) -> Any:
            built = [
                None if (v := _built(build, old, decoded)) is _ABSENT else v
                for old, build in children
            ]
            if kind == "t":
                return tuple(built)
            if not in_place:
                return built
            assert isinstance(container, list)
            container[:] = built
            return container

        return realize


_path = path


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(f"{p}.") for p in prefixes)


def _built(build: Any, old: Node | None, decoded: dict[str, Any]) -> Any:
    if build is _SAME:
        return None if old is None else old.obj
    return build(decoded)


def plan(
    state: Node,
    manifest: Manifest,
    rank: int,
    same_world: bool = True,
    *,
    alone: bool = False,
    skip: tuple[str, ...] = (),
) -> Targets:
    """What loading the walked ``state`` (:mod:`trainsnap.state.template`) from ``manifest``
    (which has a tree) reads, and how the results are put in place (``Targets.assign``); raises
    before reading anything when the state and the snapshot do not fit. ``alone``: this is a
    load of one process; ``skip``: saved keys its exact mappings leave out on purpose (a
    generator a restore keeps as it is). O(nodes + saved tree); reads the nodes, never the
    state."""
    assert manifest.tree is not None
    planner = _Planner(manifest, rank, alone=alone, skip=skip)
    root = root_mapping(state)
    root_obj = root.obj
    saved = tree.children(manifest.tree)
    builds = [
        (k, planner.node(v, saved.get((type(k).__name__, k)), _top_key(k)))
        for k, v in root.children
    ]
    if not same_world:  # per-rank entries, whether this rank has its own or not
        asked = [t.key for t in planner.targets.tensors] + [v.key for v in planner.targets.values]
        bound = dict.fromkeys(k for k in asked + planner.missing if rank_scoped(manifest, k))
        refuse_rank_bound(manifest, list(bound))
    _raise_unfit(manifest, planner)
    # The closures below hold the planner's list of finishers, never the planner (which holds
    # the targets that hold them): no reference cycle keeps the state's objects alive after
    # the load, so they are freed when the caller drops them, not by a later cyclic
    # collection (one that finds a DataLoader iterator there stops its queues' feeder
    # threads before the iterator's own shutdown, whose workers then wait out their join
    # timeout).
    stateful = planner.stateful
    owner = state.obj if isinstance(state, StatefulNode) else None

    def assign(decoded: dict[str, Any]) -> None:
        assert isinstance(root_obj, MutableMapping)
        for k, build in builds:
            if build is _SAME:
                continue  # a tensor, filled in place
            new = build(decoded)
            if root_obj[k] is not new:
                root_obj[k] = new
        if owner is not None:
            stateful.append(lambda: owner.load_state_dict(root_obj))

    out = planner.targets
    out.assign = assign
    out.finishers = planner.stateful
    return out


def _top_key(key: Any) -> str:
    if not tree.is_key(key):
        raise InvalidArgumentError(
            f"state key {key!r} is a {type(key).__name__}; keys must be str, int, float, bool "
            "or None"
        )
    return tree.join("", key)


def _raise_unfit(manifest: Manifest, planner: _Planner) -> None:
    sid = manifest.snapshot_id
    if planner.missing:
        raise NotFoundError(
            f"snapshot {sid} lacks {len(planner.missing)} key(s) the state asks for: "
            f"{keys_summary(planner.missing)}. Load into a state that matches the one saved, or "
            "remove those keys from the state you load into.",
            snapshot_id=sid,
            key=planner.missing[0],
        )
    if planner.problems:
        raise IncompatibleError(
            f"snapshot {sid} does not fit the state",
            snapshot_id=sid,
            key=planner.problems[0][0],
            problems=[f"{k!r}: {why}" for k, why in planner.problems],
            see_all="`trainsnap show ROOT ID` lists every saved key with its shape",
        )


# -- template-free reads --------------------------------------------------------------------------


def read_plan(
    manifest: Manifest, keys: Sequence[str] | None, rank: int
) -> tuple[Targets, dict[str, Any]]:
    """Targets that rebuild the saved tree (or the part under ``keys``), and the dict whose
    ``"tree"`` they fill: tensors assembled whole on CPU, values decoded, containers as saved;
    global entries and ``rank``'s own. Snapshots without a tree (older formats, imports) read as
    a flat mapping of dotted keys."""
    structure = manifest.tree if manifest.tree is not None else _flat_tree(manifest, rank)
    if keys is not None:
        unknown = [k for k in keys if tree.select(structure, [k]) is None]
        if unknown:
            raise NotFoundError(
                f"snapshot {manifest.snapshot_id} has no key {unknown[0]!r} (keys= selects a "
                "saved key and everything under it)",
                snapshot_id=manifest.snapshot_id,
                key=unknown[0],
            )
        structure = tree.select(structure, list(keys))
    planner = _Planner(manifest, rank, lenient=True)
    root = planner.node(None, structure, "")
    _raise_unfit(manifest, planner)
    out = planner.targets
    result: dict[str, Any] = {}

    def assign(decoded: dict[str, Any]) -> None:
        result["tree"] = root(decoded)

    out.assign = assign
    return out, result


def _flat_tree(manifest: Manifest, rank: int) -> Any:
    tensors = zip(manifest.tensor_keys, manifest.tensor_ranks.tolist(), strict=True)
    plain = zip(manifest.value_keys, manifest.value_ranks.tolist(), strict=True)
    keys = dict.fromkeys(k for k, r in [*tensors, *plain] if r in (-1, rank))
    return tree.mapping("d", [(k, tree.LEAF) for k in keys])
