"""The docs match the code: the format version they state, every option the README names
exists, and every public option is documented in the README or docs/."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import typer.main

import trainsnap as ts
from trainsnap.format.manifest import FORMAT_VERSION
from trainsnap.tools.cli import app

HERE = Path(__file__).resolve().parent.parent
README = (HERE / "README.md").read_text()
FORMAT = (HERE / "FORMAT.md").read_text()
DOCS = README + "".join(p.read_text() for p in sorted((HERE / "docs").glob("*.md")))
OPTION_CLASSES = {c.__name__: c for c in (ts.SaveOptions, ts.ManagerOptions, ts.LocalTier)}


def test_the_format_version_the_docs_state_is_the_code_s() -> None:
    """Why: the README said FORMAT.md is version 3 and FORMAT.md's marker example said 3 (it
    is 4)."""
    (stated,) = re.findall(r"normative spec \(version (\d+)", README)
    assert int(stated) == FORMAT_VERSION
    example = re.search(r'(\{"format": "trainsnap.marker".*?)\n```', FORMAT, re.S)
    assert example is not None
    assert json.loads(example.group(1))["format_version"] == FORMAT_VERSION


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_every_option_the_readme_names_exists() -> None:
    named = re.findall(r"(SaveOptions|ManagerOptions|LocalTier)(?:\(|\.)(\w+)", README)
    named += re.findall(r"(SaveOptions|ManagerOptions|LocalTier)\([^)]*?,\s*(\w+)=", README)
    assert named
    unknown = {(cls, name) for cls, name in named if name not in _fields(OPTION_CLASSES[cls])}
    assert not unknown


@pytest.mark.parametrize("cls", OPTION_CLASSES.values(), ids=OPTION_CLASSES)
def test_every_public_option_is_documented(cls: type) -> None:
    missing = {name for name in _fields(cls) if not name.startswith("_") and name not in DOCS}
    assert not missing, f"{cls.__name__} fields the README and docs/ never mention"


def _cli_options() -> dict[str, set[str]]:
    group = typer.main.get_command(app)
    out: dict[str, set[str]] = {}
    for name, command in group.commands.items():  # type: ignore[attr-defined]
        out[name] = {
            opt
            for p in command.params
            if getattr(p, "param_type_name", "") == "option"
            for opt in p.opts
        } - {"--help"}
    return out


def test_every_command_line_option_is_in_the_readme() -> None:
    commands = _cli_options()
    assert {"ls", "show", "verify", "gc", "history", "interval", "export"} <= set(commands)
    for name, options in commands.items():
        assert f"trainsnap {name}" in README, name
        missing = {opt for opt in options if opt not in README}
        assert not missing, f"trainsnap {name}: {missing} not in the README"
