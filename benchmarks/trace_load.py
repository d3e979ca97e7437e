"""How much of trainsnap one ``ts.load`` of a TrainState passes through, traced with
``sys.setprofile`` in one process: distinct functions, distinct modules and layer switches
(consecutive trainsnap calls in different subpackages), and, for reference, the same counts of
``torch.distributed.checkpoint.load`` of the same model and optimizer.

Run from the repository root against any checkout, to compare two::

    python -m benchmarks.trace_load [--json out.json]
    PYTHONPATH=/other/checkout/src python -m benchmarks.trace_load

The counts depend on the code, not on the machine: no timing is taken.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch

import trainsnap as ts


class Trace:
    """Every Python function called while it is active, in order of first call."""

    def __init__(self, package: str) -> None:
        self.package = package
        self.functions: dict[tuple[str, int, str], None] = {}
        self.modules: dict[str, None] = {}
        self.switches = 0
        self._layer: str | None = None

    def __call__(self, frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not isinstance(module, str) or not module.startswith(self.package):
            return
        code = frame.f_code
        self.functions[(code.co_filename, code.co_firstlineno, code.co_name)] = None
        self.modules[module] = None
        layer = module.split(".")[1] if "." in module else module
        if self._layer is not None and layer != self._layer:
            self.switches += 1
        self._layer = layer

    def counts(self) -> dict[str, int]:
        return {
            "functions": len(self.functions),
            "modules": len(self.modules),
            "layer_switches": self.switches,
        }


def traced(package: str, call: Callable[[], Any]) -> Trace:
    trace = Trace(package)
    sys.setprofile(trace)
    try:
        call()
    finally:
        sys.setprofile(None)
    return trace


def _state() -> tuple[torch.nn.Module, torch.optim.Optimizer, ts.TrainState]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    sampler = ts.ElasticSampler(64, global_batch_size=8, rank=0, world_size=1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=4)
    return model, opt, ts.TrainState(model, opt, scheduler, dataloader=sampler)


def measure(workdir: Path) -> dict[str, Any]:
    root = str(workdir / "trainsnap")
    _model, _opt, state = _state()
    ts.save(state, root, step=1)
    ts.load(_state()[2], root)  # imports and one-time caches out of the trace
    fresh = _state()[2]
    mine = traced("trainsnap", lambda: ts.load(fresh, root))
    out: dict[str, Any] = {"trainsnap": mine.counts(), "trainsnap_modules": list(mine.modules)}
    import torch.distributed.checkpoint as dcp

    model, opt, _ = _state()
    path = str(workdir / "dcp")
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
    model, opt, _ = _state()
    target = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(target, checkpoint_id=path)
    target = {"model": model.state_dict(), "optim": opt.state_dict()}
    theirs = traced("torch.distributed.checkpoint", lambda: dcp.load(target, checkpoint_id=path))
    out["dcp"] = theirs.counts()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the counts here as JSON")
    parser.add_argument("--smoke", action="store_true", help="the same run (it is small)")
    parser.add_argument("--dir", type=Path, help="work directory (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args.dir or Path(tmp))
    print(f"== one-process ts.load of a TrainState (trainsnap at {ts.__file__})")
    for name in ("trainsnap", "dcp"):
        counts = result[name]
        print(
            f"{name:10s} functions {counts['functions']:4d}  modules {counts['modules']:3d}  "
            f"layer switches {counts['layer_switches']:4d}"
        )
    print(
        "trainsnap modules:",
        ", ".join(m.removeprefix("trainsnap.") for m in result["trainsnap_modules"]),
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
