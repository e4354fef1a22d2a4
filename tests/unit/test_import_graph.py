"""crane_mp's modules import each other without circles: a circle makes import order matter and hides
which layer owns what. Parsed statically, so every import counts, also those inside functions and
under `if TYPE_CHECKING:` (a circle postponed to call time or to the type checker is still a circle)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import crane_mp

PACKAGE_DIR = Path(crane_mp.__file__).parent


def module_files() -> dict[str, Path]:
    files = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = ("crane_mp",) + path.relative_to(PACKAGE_DIR).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The crane_mp modules that `name` imports anywhere in its source. `from pkg import x` imports the
    submodule pkg.x when there is one, else pkg itself."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0]
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                targets.add(submodule if submodule in known else source)
    return targets & known


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imported_modules(name, path, set(files)) for name, path in files.items()}


def tangles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with a circle in them (Tarjan): every module in one imports,
    directly or not, every other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = {node}
            while (member := stack.pop()) != node:
                component.add(member)
            if len(component) > 1 or node in graph[node]:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _circle_through(start: str, component: set[str], graph: dict[str, set[str]]) -> list[str]:
    # Breadth-first inside the component: the shortest way from start back to itself. Every member
    # of a strongly connected component leads back to start, so the search always ends there.
    paths = {start: [start]}
    frontier = [start]
    while True:
        node = frontier.pop(0)
        for nxt in sorted(graph[node] & component):
            if nxt == start:
                return paths[node] + [start]
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                frontier.append(nxt)


def _describe(found: list[set[str]], graph: dict[str, set[str]]) -> str:
    return "\n".join(
        " -> ".join(_circle_through(min(tangle), tangle, graph)) + f"  (tangle: {', '.join(sorted(tangle))})"
        for tangle in found
    )


def _in_area(module: str, area: str) -> bool:
    return module == area or module.startswith(area + ".")


def strict_areas() -> list[str]:
    """Every top-level module and subpackage: a circle's report names the area it passes through."""
    tops = {".".join(name.split(".")[:2]) for name in module_files()}
    return sorted(tops - {"crane_mp"})


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


@pytest.mark.parametrize("area", strict_areas())
def test_area_is_in_no_import_cycle(area: str, graph: dict[str, set[str]]):
    found = [tangle for tangle in tangles(graph) if any(_in_area(m, area) for m in tangle)]
    assert not found, f"import circles through {area}:\n{_describe(found, graph)}"


def test_package_has_no_import_cycles(graph: dict[str, set[str]]):
    found = tangles(graph)
    assert not found, f"import circles:\n{_describe(found, graph)}"


def test_graph_sees_every_kind_of_import(graph: dict[str, set[str]], tmp_path: Path):
    """The parser itself: relative, function-level and TYPE_CHECKING imports, submodules named in `from`."""
    assert "crane_mp.frontend.serving.generation" in graph["crane_mp.frontend.serving.choices"]
    assert "crane_mp.protocol" in graph["crane_mp.scheduler.process"]
    fake = {"crane_mp.a", "crane_mp.b", "crane_mp.pkg", "crane_mp.pkg.c", "crane_mp.pkg.d"}
    path = tmp_path / "mod.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import a\n"
        "if TYPE_CHECKING:\n"
        "    from crane_mp.b import Thing\n"
        "def f():\n"
        "    from .pkg import c, helper\n"
        "    import crane_mp.pkg.d\n"
    )
    assert imported_modules("crane_mp.mod", path, fake) == fake
