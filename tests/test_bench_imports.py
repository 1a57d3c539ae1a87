"""The benchmark's modules import each other without a circle, counting the imports inside functions
too (a circle that only a late import closes still ties the modules to each other)."""

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "lamport_mhc" / "bench"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found


def test_no_import_circle():
    graph = {path.stem: _imports(path) & {p.stem for p in BENCH.glob("*.py")} for path in BENCH.glob("*.py")}
    graph.pop("__init__")
    state: dict[str, str] = {}

    def visit(module: str, trail: list[str]) -> None:
        if state.get(module) == "done":
            return
        assert state.get(module) != "open", "import circle: " + " -> ".join(trail + [module])
        state[module] = "open"
        for imported in sorted(graph.get(module, ())):
            visit(imported, trail + [module])
        state[module] = "done"

    for module in sorted(graph):
        visit(module, [])
