"""The model and its optimizers as a :class:`~trainsnap.TrainState` saves and restores them.

A model is an ``nn.Module``, a list of modules (model parts: pipeline stages keep their FQNs,
merged into one mapping), a dict of modules (a GAN's or an EMA's pair, each under its name) or
any Stateful (torchtitan's ``ModelWrapper``). Optimizers are torch optimizers (one list over a
single module; one per part, in order or by name, over parts) or a Stateful container with its
own ``state_dict`` (torchtitan's ``OptimizersContainer``).

Modules and torch optimizers go through ``torch.distributed.checkpoint.state_dict``, so DDP,
FSDP2/DTensor and compiled modules give FQN-keyed, reshardable state and optimizer state keyed
by parameter name; Stateful objects are taken at their word.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from trainsnap.errors import InvalidArgumentError
from trainsnap.state.capture import Exact, is_stateful


def is_container(optimizer: Any) -> bool:
    """A Stateful optimizer container: its own ``state_dict`` (not a torch optimizer's)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return type(optimizer).state_dict is not torch.optim.Optimizer.state_dict
    return is_stateful(optimizer)


class ModelParts:
    """How one TrainState's model and optimizers become trees, and go back."""

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.model = model
        if isinstance(model, torch.nn.Module):
            self.kind, self.parts = "module", {"": model}
        elif isinstance(model, list | tuple) and model:
            self.kind, self.parts = "parts", {str(i): m for i, m in enumerate(model)}
        elif isinstance(model, Mapping) and model:
            self.kind, self.parts = "named", {str(k): m for k, m in model.items()}
        elif is_stateful(model):
            self.kind, self.parts = "stateful", {}
        else:
            raise InvalidArgumentError(
                f"TrainState: model must be an nn.Module, a non-empty list or dict of modules, or "
                f"an object with state_dict()/load_state_dict(); got {type(model).__name__}"
            )
        bad = [k for k, m in self.parts.items() if not isinstance(m, torch.nn.Module)]
        if bad:
            raise InvalidArgumentError(f"TrainState: model part {bad[0]!r} is not an nn.Module")
        self._part_keys: dict[str, list[str]] = {}
        self.container = optimizer if optimizer is not None and is_container(optimizer) else None
        self.optimizers = {} if self.container is not None else self._pair(optimizer)

    def _pair(self, optimizer: Any) -> dict[str, list[Any]]:
        """The torch optimizers of each part (a single module may have several)."""
        if optimizer is None:
            return {}
        if self.kind == "module":
            opts = list(optimizer) if isinstance(optimizer, list | tuple) else [optimizer]
            return {"": opts}
        if self.kind == "stateful":
            raise InvalidArgumentError(
                "TrainState: torch optimizers need their modules; with a Stateful model pass a "
                "Stateful optimizer container too (state_dict()/load_state_dict())"
            )
        if isinstance(optimizer, Mapping):
            paired = {str(k): [o] for k, o in optimizer.items()}
        elif isinstance(optimizer, list | tuple):
            paired = {str(i): [o] for i, o in enumerate(optimizer)}
        else:
            paired = {k: [optimizer] for k in self.parts} if len(self.parts) == 1 else {}
        if set(paired) != set(self.parts):
            raise InvalidArgumentError(
                f"TrainState: {len(self.parts)} model parts need one optimizer each, paired by "
                f"{'name' if self.kind == 'named' else 'position'} (got {len(paired)}); or pass "
                "one Stateful optimizer container"
            )
        return paired

    @property
    def has_optimizer(self) -> bool:
        return self.container is not None or bool(self.optimizers)

    # -- trees --------------------------------------------------------------------------------

    def model_tree(self) -> Any:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        if self.kind == "stateful":
            return self.model.state_dict()
        sds = {k: dict(get_model_state_dict(m)) for k, m in self.parts.items()}
        self._part_keys = {k: list(sd) for k, sd in sds.items()}
        if self.kind == "module":
            return sds[""]
        if self.kind == "named":
            return sds
        merged: dict[str, Any] = {}
        for part, sd in sds.items():
            clash = next((k for k in sd if k in merged), None)
            if clash is not None:
                raise InvalidArgumentError(
                    f"TrainState: model parts share the parameter name {clash!r} (part {part}); "
                    "pass a dict of modules to keep each part under its own name"
                )
            merged.update(sd)
        return merged

    def optim_tree(self, *, initialise: bool = False) -> Any:
        """The optimizers' state tree, keyed by parameter name. A save leaves a fresh optimizer
        as it is (no state); ``initialise`` lets torch give it its state first (a zero-lr step
        on zero gradients), which a load template needs and a load then replaces whole."""
        from contextlib import nullcontext

        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if self.container is not None:
            return self.container.state_dict()
        sds = {}
        for k, opts in self.optimizers.items():
            with nullcontext() if initialise else _no_initialising_step(opts):
                sds[k] = dict(get_optimizer_state_dict(self.parts[k], opts))
        if self.kind == "module":
            return sds[""]
        if self.kind == "named":
            return sds
        return [sds[str(i)] for i in range(len(sds))]

    def exact(self, msd: Any, osd: Any) -> tuple[Any, Any]:
        """The load templates ``msd`` and ``osd`` (from :meth:`model_tree` and
        :meth:`optim_tree`) with the mappings of names made :class:`Exact`: the names a rank's
        modules hold are all it loads, so a pipeline stage is not given the other stages'
        layers, nor their moments, from the job's one saved tree. An optimizer's state admits
        its part's names, whether it holds them yet or not. A Stateful model's and optimizer
        container's own trees stay as they are."""
        if self.kind == "stateful":
            return msd, osd
        for part, sd in self.optim_trees_by_part(osd):
            sd["state"] = Exact(sd["state"], allowed=self._part_keys[part])
        if self.kind == "named" and self.container is None and osd is not None:
            osd = Exact(osd)
        if self.kind == "named":
            return Exact({k: Exact(sd) for k, sd in msd.items()}), osd
        return Exact(msd), osd

    def plain_optim_trees(self, osd: Any) -> list[dict[str, Any]]:
        """The torch optimizers' state dicts inside ``osd`` (none for a container)."""
        return [sd for _, sd in self.optim_trees_by_part(osd)]

    def optim_trees_by_part(self, osd: Any) -> list[tuple[str, dict[str, Any]]]:
        """(part, its torch optimizer's state dict) inside ``osd`` (none for a container)."""
        if self.container is not None or osd is None:
            return []
        if self.kind == "module":
            return [("", osd)]
        if isinstance(osd, Mapping):
            return list(osd.items())
        return [(str(i), sd) for i, sd in enumerate(osd)]

    def apply(self, msd: Any, osd: Any) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if self.kind == "stateful":
            self.model.load_state_dict(msd)
        for k, m in self.parts.items():
            if self.kind == "module":
                part_sd = msd
            elif self.kind == "named":
                part_sd = msd[k]
            else:
                part_sd = {n: msd[n] for n in self._part_keys[k]}
            set_model_state_dict(m, part_sd)
        if osd is None:
            return
        if self.container is not None:
            self.container.load_state_dict(osd)
            return
        for k, opts in self.optimizers.items():
            if self.kind == "module":
                part_osd = osd
            else:
                part_osd = osd[k] if self.kind == "named" else osd[int(k)]
            # Not strict: parameters that had no optimizer state when saved (they never got a
            # gradient) must have none now; the load plan checked exactly which those are.
            with _no_initialising_step(opts):
                set_optimizer_state_dict(
                    self.parts[k], opts, part_osd, options=StateDictOptions(strict=False)
                )

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        for k, m in self.parts.items():
            prefix = f"{k}." if self.kind == "named" else ""
            for n, p in m.named_parameters():
                yield prefix + n, p


@contextmanager
def _no_initialising_step(optimizers: Sequence[torch.optim.Optimizer]) -> Iterator[None]:
    """Keep torch's state-dict functions from stepping an optimizer that has no state yet.

    ``get_optimizer_state_dict`` and ``set_optimizer_state_dict`` fill an empty optimizer's
    state by running ``step()`` at learning rate 0 on zero gradients: Adam's state becomes
    step 1 with zero moments, and the run diverges from one that never saved. They skip that
    when a parameter has a gradient, so for the duration of the call one parameter of each
    such optimizer gets a zero gradient of one element's storage, expanded to its shape; it is
    set back to None afterwards. The saved state is then the optimizer's real one: empty.
    O(1) memory per optimizer."""
    lent: list[torch.Tensor] = []
    for opt in optimizers:
        params = [p for group in opt.param_groups for p in group["params"]]
        if opt.state or not params or any(p.grad is not None for p in params):
            continue  # torch initialises nothing here
        param = next((p for p in params if p.requires_grad), params[0])
        param.grad = _zero_grad_like(param)
        lent.append(param)
    try:
        yield
    finally:
        for param in lent:
            param.grad = None


def _zero_grad_like(param: torch.Tensor) -> torch.Tensor:
    try:
        return torch.zeros((), dtype=param.dtype, device=param.device).expand_as(param)
    except (RuntimeError, TypeError):  # a tensor subclass (DTensor) that will not expand
        return torch.zeros_like(param)
