"""The import graph: each layer imports only from the layers below it, and no modules import each other in a
circle. Every import counts, those under `if TYPE_CHECKING:` and inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["pallas_kernels", "model", "sharding", "batching", "app", "bench"]  # bottom first
# Upward arrows not yet removed, each with its way out.
KNOWN_UPWARD: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def imported_names(node: ast.AST) -> list[str]:
    """The modules (and `from` names) an import statement names; [] for other nodes and relative imports."""
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    return []


def imports() -> dict[str, set[str]]:
    """Each of the project's modules -> the project modules it imports."""
    graph: dict[str, set[str]] = {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).glob("*.py")):
            found = set()
            for node in ast.walk(ast.parse(path.read_text())):
                names = [name.removeprefix("sluice.") for name in imported_names(node)]
                found |= {name for name in names if name.split(".")[0] in LAYERS
                          and (ROOT / (name.replace(".", "/") + ".py")).exists()}
            graph[module_name(path)] = found - {module_name(path)}
    return graph


def test_every_layer_imports_only_from_the_layers_below_it():
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = {(module, imported) for module, imported_set in imports().items() for imported in imported_set
              if rank[imported.split(".")[0]] > rank[module.split(".")[0]]}
    assert upward == KNOWN_UPWARD


def test_no_modules_import_each_other_in_a_circle():
    graph = imports()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(module):] + [module]))
        if module in done:
            return
        for imported in sorted(graph.get(module, ())):
            visit(imported, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_the_project_is_imported_only_as_the_sluice_package():
    """A folder imported by its own name as well would load its modules twice (and a wheel has no such name)."""
    bare = []
    for path in sorted(p for folder in [*LAYERS, "tests"] for p in (ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            bare += [f"{path.relative_to(ROOT)}: {name}" for name in imported_names(node)
                     if name.split(".")[0] in LAYERS]
    assert bare == []
