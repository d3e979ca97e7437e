"""TrainState over model parts, named modules and Stateful containers: each comes back bitwise."""

from __future__ import annotations

import pytest
import torch

import trainsnap as ts


def _trained(parts: list[torch.nn.Module], opts: list[torch.optim.Optimizer]) -> None:
    x = torch.ones(4, 3)
    for _ in range(2):
        for part, opt in zip(parts, opts, strict=True):
            part(x).sum().backward()
            opt.step()
            opt.zero_grad()


def _fresh() -> tuple[list[torch.nn.Module], list[torch.optim.Optimizer]]:
    parts = [torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)]
    return parts, [torch.optim.AdamW(p.parameters(), lr=0.01) for p in parts]


def _same_optim(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    return sa.keys() == sb.keys() and all(
        torch.equal(sa[k][n], sb[k][n]) for k in sa for n in sa[k]
    )


@pytest.mark.parametrize("named", [False, True])
def test_model_parts_with_one_optimizer_each_round_trip(tmp_path, named):
    torch.manual_seed(0)
    parts, opts = _fresh()
    _trained(parts, opts)
    model = {"gen": parts[0], "disc": parts[1]} if named else parts
    optim = {"gen": opts[0], "disc": opts[1]} if named else opts
    if not named:  # pipeline stages: distinct FQNs, merged
        parts[1] = torch.nn.Sequential(torch.nn.Identity(), parts[1])
        opts[1] = torch.optim.AdamW(parts[1].parameters(), lr=0.01)
        _trained(parts, opts)
        model, optim = parts, opts
    ts.save(ts.TrainState(model=model, optimizer=optim, no_data_order=True), tmp_path, step=1)
    back_parts, back_opts = _fresh()
    if not named:
        back_parts[1] = torch.nn.Sequential(torch.nn.Identity(), back_parts[1])
        back_opts[1] = torch.optim.AdamW(back_parts[1].parameters(), lr=0.01)
    back_model = {"gen": back_parts[0], "disc": back_parts[1]} if named else back_parts
    back_optim = {"gen": back_opts[0], "disc": back_opts[1]} if named else back_opts
    info = ts.load(
        ts.TrainState(model=back_model, optimizer=back_optim, no_data_order=True), tmp_path
    )
    assert info.level == "strict"
    for p, q in zip(parts, back_parts, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(p.parameters(), q.parameters(), strict=True))
    for o, q in zip(opts, back_opts, strict=True):
        assert _same_optim(o, q)
    keys = set(ts.read(tmp_path, keys="model")["model"])
    assert keys == ({"gen", "disc"} if named else {"weight", "bias", "1.weight", "1.bias"})


class Wrapper:
    """A Stateful model and optimizer container, as torchtitan's ModelWrapper and
    OptimizersContainer are: flat keys, their own state_dict."""

    def __init__(self, parts: list[torch.nn.Module], opts: list[torch.optim.Optimizer]):
        self.parts, self.opts = parts, opts

    def state_dict(self) -> dict:
        return {f"{i}.{k}": v for i, p in enumerate(self.parts) for k, v in p.state_dict().items()}

    def load_state_dict(self, sd: dict) -> None:
        for i, p in enumerate(self.parts):
            p.load_state_dict(
                {k.split(".", 1)[1]: v for k, v in sd.items() if k.startswith(f"{i}.")}
            )


class Optimizers(Wrapper):
    def state_dict(self) -> dict:
        return {str(i): o.state_dict() for i, o in enumerate(self.opts)}

    def load_state_dict(self, sd: dict) -> None:
        for i, o in enumerate(self.opts):
            o.load_state_dict(sd[str(i)])


def test_stateful_model_and_optimizer_containers_round_trip(tmp_path):
    torch.manual_seed(1)
    parts, opts = _fresh()
    _trained(parts, opts)
    state = ts.TrainState(model=Wrapper(parts, opts), optimizer=Optimizers(parts, opts))
    ts.save(state, tmp_path, step=3)
    back_parts, back_opts = _fresh()  # fresh optimizers: no moments until loaded
    back = ts.TrainState(
        model=Wrapper(back_parts, back_opts), optimizer=Optimizers(back_parts, back_opts)
    )
    ts.load(back, tmp_path)
    for o, q in zip(opts, back_opts, strict=True):
        assert _same_optim(o, q)
    assert torch.equal(parts[0].weight, back_parts[0].weight)


def test_mismatched_parts_and_optimizers_are_refused():
    parts, opts = _fresh()
    with pytest.raises(ts.InvalidArgumentError, match="one optimizer each"):
        ts.TrainState(model=parts, optimizer=opts[:1])
    with pytest.raises(ts.InvalidArgumentError, match="share the parameter name"):
        ts.save(ts.TrainState(model=parts, optimizer=opts), "memory://clash", step=1)
    with pytest.raises(ts.InvalidArgumentError, match="Stateful optimizer container"):
        ts.TrainState(model=Wrapper(parts, opts), optimizer=opts)
