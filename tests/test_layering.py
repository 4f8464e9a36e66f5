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


def imports() -> dict[str, set[str]]:
    """Each of the project's modules -> the project modules it imports."""
    graph: dict[str, set[str]] = {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).glob("*.py")):
            found = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
                elif isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                else:
                    continue
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
