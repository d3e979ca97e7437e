"""The command line starts without torch for the commands that do not move tensors: `--help`,
`--version`, `ls`, `show`, `interval` and `history` answer in a fraction of a second, while
torch alone takes seconds to import."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import trainsnap as ts

_RUN = textwrap.dedent(
    """
    import runpy, sys
    sys.argv = ["trainsnap", *sys.argv[1:]]
    code = 0
    try:
        runpy.run_module("trainsnap.tools.cli", run_name="__main__")
    except SystemExit as e:
        code = e.code or 0
    print("TORCH" if "torch" in sys.modules else "NO-TORCH", code)
    """
)


def _modules_after(*args: str) -> tuple[str, str]:
    """(the command's output, whether torch was imported and the exit status)."""
    out = subprocess.run(
        [sys.executable, "-c", _RUN, *args], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    *lines, verdict = out.stdout.rstrip("\n").split("\n")
    return "\n".join(lines), verdict


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("root")
    mgr = ts.CheckpointManager(path, interval=ts.Every(steps=1), async_save=False)
    for step in range(3):
        mgr.step(step, {"w": torch.full((4,), float(step)), "step": step})
    mgr.close()
    return path


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["--version"],
        ["ls", "{root}"],
        ["show", "{root}", "latest"],
        ["show", "{root}", "1", "--json"],
        ["interval", "--cost", "30s", "--mtbf", "4h"],
        ["history", "{root}"],
        ["history", "{root}", "--json"],
    ],
)
def test_commands_that_move_no_tensor_do_not_import_torch(root: Path, args: list[str]) -> None:
    """Why: every command, even `--help`, imported torch (seconds before anything happened)."""
    output, verdict = _modules_after(*(a.format(root=root) for a in args))
    assert verdict == "NO-TORCH 0", output
    assert output  # the command did answer


def test_a_command_that_needs_torch_imports_it_when_it_runs(root: Path) -> None:
    output, verdict = _modules_after("diff", str(root), "0", "2")
    assert verdict == "TORCH 0", output
    assert "1 changed" in output


def test_every_public_name_resolves_from_the_lazy_package() -> None:
    """The package imports its public names on first use; each one must still be there, and
    `from trainsnap import X` must work for all of them."""
    code = (
        "import trainsnap as ts, sys; assert 'torch' not in sys.modules; "
        "missing = [n for n in ts.__all__ if getattr(ts, n, None) is None]; "
        "assert not missing, missing; from trainsnap import CheckpointManager, Sharded, tiers; "
        "assert set(ts.__all__) <= set(dir(ts)); print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
