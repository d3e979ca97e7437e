"""A load walks the user's state once (state/template.py): what a rank wants before the
manifest, the plan, the reads and the fill all read the walked nodes. Counted on 2 real ranks,
where a load also says what it wants before the manifest is read."""

from __future__ import annotations

from typing import Any

import torch

import trainsnap as ts
from trainsnap.state.template import MappingNode, StatefulNode, TensorNode, Walker, walk
from trainsnap.testing import assert_all_ok, run_ranks


class Counted:
    """A stateful object that counts the calls of its ``state_dict``."""

    def __init__(self, value: float) -> None:
        self.weight = torch.full((4,), value)
        self.note = {"seen": value}
        self.calls = 0

    def state_dict(self) -> dict[str, Any]:
        self.calls += 1
        return {"weight": self.weight, "note": self.note}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.note = state["note"]


def _state(rank: int, value: float) -> dict[str, Any]:
    return {"a": Counted(value), "b": {"inner": Counted(value + 1)}, "w": torch.full((2,), value)}


def _save(rank: int, world: int, root: str) -> None:
    ts.save(_state(rank, 5.0), root, step=1, timeout=60)


def _load(rank: int, world: int, root: str) -> dict[str, Any]:
    state = _state(rank, 0.0)
    ts.load(state, root, timeout=60)
    inner = state["b"]["inner"]
    return {
        "calls": [state["a"].calls, inner.calls],
        "loaded": [float(state["a"].weight[0]), float(inner.weight[0]), float(state["w"][0])],
        "notes": [state["a"].note["seen"], inner.note["seen"]],
    }


def _load_train_state(rank: int, world: int, root: str) -> dict[str, Any]:
    model = torch.nn.Linear(3, 2)
    state = ts.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), no_data_order=True)
    parts = state._parts
    assert parts is not None
    taken = [0]
    model_tree = parts.model_tree

    def counted() -> Any:
        taken[0] += 1
        return model_tree()

    parts.model_tree = counted  # type: ignore[method-assign]
    with torch.no_grad():
        model.weight.zero_()
    ts.load(state, root, timeout=60)
    return {"model_trees": taken[0], "weight": model.weight.detach().sum().item()}


def _save_train_state(rank: int, world: int, root: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(1.0)
    state = ts.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), no_data_order=True)
    ts.save(state, root, step=1, timeout=60)


def test_a_two_rank_load_calls_each_state_dict_once(tmp_path: Any) -> None:
    root = str(tmp_path)
    assert_all_ok(run_ranks(_save, 2, args=(root,), timeout=120))
    out = assert_all_ok(run_ranks(_load, 2, args=(root,), timeout=120))
    for rank_out in out:
        assert rank_out["loaded"] == [5.0, 6.0, 5.0], rank_out
        assert rank_out["notes"] == [5.0, 6.0], rank_out
        # Once per load: the wants, the plan and the fill share one walk.
        assert rank_out["calls"] == [1, 1], rank_out


def test_a_two_rank_train_state_load_takes_the_model_tree_once(tmp_path: Any) -> None:
    root = str(tmp_path)
    assert_all_ok(run_ranks(_save_train_state, 2, args=(root,), timeout=120))
    out = assert_all_ok(run_ranks(_load_train_state, 2, args=(root,), timeout=120))
    for rank_out in out:
        assert rank_out["weight"] == 6.0, rank_out  # 2 x 3 ones
        assert rank_out["model_trees"] == 1, rank_out


def test_the_walk_types_every_node_and_reuses_a_tensor_and_a_stateful_object_seen_again() -> None:
    shared = Counted(1.0)
    state = {"a": shared, "b": [torch.zeros(2), 3], "c": {"x": 1}}
    walker = Walker()
    root = walker.walk(state)
    assert isinstance(root, MappingNode)
    kinds = {k: type(node).__name__ for k, node in root.children}
    assert kinds == {"a": "StatefulNode", "b": "SequenceNode", "c": "MappingNode"}
    again = walker.walk({"a": shared})
    assert isinstance(again, MappingNode)
    node = again.children[0][1]
    assert isinstance(node, StatefulNode) and node is root.children[0][1]
    assert shared.calls == 1
    weight = node.walked().children[0][1]
    assert isinstance(weight, TensorNode) and weight.described().key == "a.weight"
    assert walk(state) is not root and shared.calls == 2  # a new load walks afresh


def test_the_prefetch_hook_gets_the_manifest_before_anything_is_read(tmp_path: Any) -> None:
    from trainsnap.protocol.control_plane import LocalComm
    from trainsnap.protocol.load_protocol import run_load
    from trainsnap.storage import open_storage

    ts.save(_state(0, 5.0), str(tmp_path), step=1)
    state = _state(0, 0.0)
    seen: list[tuple[int, float]] = []

    def prefetch(part: Any) -> None:  # nothing read yet: the tensors are as given
        seen.append((part.step, float(state["w"][0])))

    storage = open_storage(str(tmp_path))
    loaded = run_load(
        state,
        storage,
        "latest",
        LocalComm(),
        level="strict",
        allow_downgrade=False,
        allow_pickle=False,
        prefetch=prefetch,
    )
    assert seen == [(1, 0.0)]
    assert loaded.level == "strict" and float(state["w"][0]) == 5.0
    assert state["a"].calls == 1
