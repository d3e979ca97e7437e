"""The package's layers: imports point down only, and no modules import each other in a cycle.

Every import counts, function-level ones included: an import deferred into a function is still a
dependency, and the usual way a cycle hides. The layers, lowest first (docs/ARCHITECTURE.md):
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import trainsnap

LAYERS: list[list[set[str]]] = [  # each layer: its rooms; rooms of one layer are peers
    [{"errors", "faults", "trace", "tunables", "_version"}],  # the foundation everyone may use
    [{"format"}, {"storage"}],  # the pure format | storage backends
    [{"engine"}, {"state"}],  # the I/O engine | user state to entries and back
    [{"protocol"}],  # the cross-rank save and load protocols, the commit
    [{"api"}],  # the public entry points
    [{"manager"}],  # the CheckpointManager and what it runs
    [{"__init__"}],  # the facade, `import trainsnap`
    [{"integrations"}],  # torchtitan, Lightning, accelerate
    [{"tools"}],  # the command line, export, import, the demo
    [{"testing"}],  # the multi-rank harness
]
PACKAGE = Path(trainsnap.__file__).resolve().parent


def _layer_of(module: str) -> tuple[int, str]:
    """(layer index, room name) of a dotted module name inside the package."""
    parts = module.split(".")
    head = parts[1] if len(parts) > 1 else "__init__"
    for i, rooms in enumerate(LAYERS):
        for room in rooms:
            if head in room:
                return i, min(room)
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS")


def _module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = [root.name, *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(root: Path, path: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, module) for every import of a package module in ``path``, at any depth."""
    here = _module_name(root, path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                # `from pkg import name` imports the module pkg.name when there is one
                sub = f"{target}.{alias.name}"
                found.append((node.lineno, sub if sub in known else target))
    return [(line, m) for line, m in found if m == root.name or m.startswith(root.name + ".")]


def layer_violations(root: Path) -> list[str]:
    """Every upward or sideways import between layers, and every import cycle, under ``root``."""
    files = sorted(root.rglob("*.py"))
    known = {_module_name(root, f) for f in files}
    graph: dict[str, set[str]] = {m: set() for m in known}
    problems: list[str] = []
    for path in files:
        here = _module_name(root, path)
        level, layer = _layer_of(here)
        for line, target in _imports(root, path, known):
            if target not in known:
                problems.append(f"{here}:{line} imports {target}, which does not exist")
                continue
            their_level, their_layer = _layer_of(target)
            if their_level > level or (their_level == level and their_layer != layer):
                problems.append(
                    f"{here}:{line} imports {target}: layer {layer!r} may not import "
                    f"{their_layer!r} (layers point down only; see LAYERS)"
                )
            if not target.endswith(".__init__") and target != root.name:
                graph[here].add(target)
    problems += [f"import cycle: {' -> '.join(c)}" for c in _cycles(graph)]
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle from each strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [[*c, c[0]] for c in components]


def test_imports_point_down_the_layers_and_make_no_cycle() -> None:
    assert layer_violations(PACKAGE) == []


def test_every_package_is_in_a_layer() -> None:
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    placed = {name for rooms in LAYERS for room in rooms for name in room}
    assert packages | modules <= placed, sorted((packages | modules) - placed)


# -- one door between ranks -------------------------------------------------------------------

AGREEMENT = {"protocol/control_plane.py", "protocol/collective.py"}
"""The control plane and the agreement primitive: the only modules that exchange over a session."""
RAW_EXCHANGES_LEFT: set[str] = set()  # modules being moved onto the primitive: never grow it
RAW_EXCHANGE = re.compile(r"\bsession\.(gather|broadcast|scatter|publish)\(")


def raw_exchanges(root: Path) -> dict[str, list[int]]:
    """Module (path under ``root``) -> the lines that call a session's exchanges directly."""
    found: dict[str, list[int]] = {}
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        lines = path.read_text().splitlines()
        hits = [n for n, line in enumerate(lines, 1) if RAW_EXCHANGE.search(line)]
        if hits and name not in AGREEMENT:
            found[name] = hits
    return found


def test_every_cross_rank_step_goes_through_the_agreement_primitive() -> None:
    """A step that gathers or broadcasts by hand forgets what the primitive does for every step:
    capture any exception on every rank and tell the others which rank failed and why
    (trainsnap.protocol.collective)."""
    found = raw_exchanges(PACKAGE)
    outside = {name: lines for name, lines in found.items() if name not in RAW_EXCHANGES_LEFT}
    assert outside == {}, (
        f"use trainsnap.protocol.collective instead of raw session calls: {outside}"
    )
    done = sorted(RAW_EXCHANGES_LEFT - set(found))
    assert done == [], f"no raw session call left in {done}: remove them from RAW_EXCHANGES_LEFT"


def test_the_raw_exchange_check_finds_a_hand_written_step(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"api/vote.py": "votes = session.gather('vote', ok)\n"})
    assert raw_exchanges(root) == {"api/vote.py": [1]}


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "trainsnap"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in {p.parent for p in root.rglob("*.py")}:
        (folder / "__init__.py").touch()
    return root


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (  # a pure format module reaching up into the manager
            {"format/manifest.py": "from trainsnap.manager.policies import Every\n"},
            "trainsnap.format.manifest:1 imports trainsnap.manager.policies",
        ),
        (  # peers in one layer
            {"engine/reader.py": "from trainsnap.state import capture\n", "state/capture.py": ""},
            "layer 'engine' may not import 'state'",
        ),
        (  # a cycle hidden in a function body, within one layer
            {
                "protocol/a.py": "def f():\n    from trainsnap.protocol import b\n",
                "protocol/b.py": "from trainsnap.protocol.a import f\n",
            },
            "import cycle: trainsnap.protocol.a -> trainsnap.protocol.b -> trainsnap.protocol.a",
        ),
        (  # a relative import upwards
            {"storage/posix.py": "from ..api import snapshots\n", "api/snapshots.py": ""},
            "trainsnap.storage.posix:1 imports trainsnap.api.snapshots",
        ),
    ],
)
def test_the_check_finds_upward_imports_and_cycles(
    tmp_path: Path, files: dict[str, str], expected: str
) -> None:
    problems = layer_violations(_tree(tmp_path, files))
    assert any(expected in p for p in problems), problems


def test_downward_imports_pass_the_check(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "manager/policies.py": "from trainsnap.format import manifest\nimport trainsnap.errors",
            "format/manifest.py": "from trainsnap.errors import TrainsnapError\n",
            "errors.py": "",
        },
    )
    assert layer_violations(root) == []
