"""The architecture as the imports keep it: the layer contracts in pyproject.toml ([tool.importlinter],
drawn in docs/development.md) hold, and no module of src/llmserver or bench/ takes part in an import
circle, nor any folder in a folder-level one (each checked on a small package made to break it too)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def circles(package: str) -> list[list[str]]:
    """The import circles among `package`'s modules (imports inside functions and under TYPE_CHECKING
    count: they are dependencies all the same), each as its sorted modules, and the circles between its
    folders (a folder imports another when any module of it does)."""
    graph = grimp.build_graph(package, cache_dir=None)
    modules = sorted(graph.modules)
    found = _strongly_connected(modules, lambda m: graph.find_modules_directly_imported_by(m))
    depth = package.count(".") + 2

    def folder(module: str) -> str:
        return ".".join(module.split(".")[:depth])

    imports: dict[str, set[str]] = {}
    for module in modules:
        for imported in graph.find_modules_directly_imported_by(module):
            if folder(module) != folder(imported):
                imports.setdefault(folder(module), set()).add(folder(imported))
    found += _strongly_connected(sorted(imports), lambda f: imports.get(f, set()))
    return found


def _strongly_connected(nodes: list[str], edges: object) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node."""
    following = edges  # a callable: node -> the nodes it imports
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in following(node):  # type: ignore[operator]
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
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

    for node in nodes:
        if node not in index:
            visit(node)
    return components


@pytest.mark.parametrize("package", ["llmserver", "bench"])
def test_no_import_circles(package: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    assert circles(package) == []


def test_the_layer_contracts_hold() -> None:
    run = subprocess.run([str(LINT_IMPORTS)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 kept, 0 broken" in run.stdout


def _package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_a_circle_and_a_folder_circle_are_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _package(
        tmp_path,
        {
            "knot/__init__.py": "",
            "knot/a.py": "from knot import b\n",
            "knot/b.py": "def f():\n    from knot import a\n",
            "knot/up/__init__.py": "",
            "knot/up/x.py": "import knot.down.y\n",
            "knot/down/__init__.py": "",
            "knot/down/y.py": "",
            "knot/down/z.py": "import knot.up.x\n",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    found = circles("knot")
    assert ["knot.a", "knot.b"] in found
    assert ["knot.down", "knot.up"] in found  # no module circle: knot.down.z imports up, up.x imports down.y


def test_a_broken_layer_fails_the_contract(tmp_path: Path) -> None:
    _package(
        tmp_path,
        {
            "tower/__init__.py": "",
            "tower/top.py": "",
            "tower/bottom.py": "import tower.top\n",
            "pyproject.toml": """
                [tool.importlinter]
                root_packages = ["tower"]
                [[tool.importlinter.contracts]]
                name = "Layers"
                type = "layers"
                layers = ["tower.top", "tower.bottom"]
            """,
        },
    )
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    run = subprocess.run([str(LINT_IMPORTS)], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "0 kept, 1 broken" in run.stdout
