"""What :func:`~trainsnap.testing.check_resume` compares after each step: the loss and every
leaf of what a save of the state stores, copied to CPU, by dotted key."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch


def observe(loss: Any, state: Any) -> dict[str, Any]:
    """The loss and every leaf of what a save of ``state`` stores, copied, by dotted key."""
    from trainsnap.state.train_state import TrainState

    tree = state.save_tree() if isinstance(state, TrainState) else state
    out: dict[str, Any] = {"loss": _copy(loss)}
    out.update(_leaves("", tree))
    return out


def _leaves(prefix: str, node: Any) -> Iterator[tuple[str, Any]]:
    if hasattr(node, "state_dict") and not isinstance(node, torch.Tensor):
        node = node.state_dict()
    if isinstance(node, Mapping):
        for k, v in node.items():
            yield from _leaves(f"{prefix}{k}.", v)
    elif isinstance(node, list | tuple) and any(isinstance(v, torch.Tensor) for v in node):
        for k, v in enumerate(node):
            yield from _leaves(f"{prefix}{k}.", v)
    else:
        yield prefix.rstrip("."), _copy(node)


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return value
