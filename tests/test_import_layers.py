"""Imports point one way: reference < kernels < fa4 < model < serving < profiles, tests; and no module-level or
function-level import closes a cycle between modules. Parsed with ast, so every import counts, wherever it sits."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"reference": 0, "kernels": 1, "fa4": 2, "model": 3, "serving": 4, "profiles": 5, "tests": 6}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for top in LAYERS for p in (ROOT / top).rglob("*.py")}


def imports_of(path: Path, known: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, module) of every import of a project module in path: `from a import b` counts as a.b when that is a
    module, else a."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module)
                      for a in node.names]
    return [(line, m) for line, m in found if m.split(".")[0] in LAYERS]


def graph() -> dict[str, set[str]]:
    known = modules()
    edges = {}
    for name, path in known.items():
        edges[name] = {m for _, m in imports_of(path, known) if m in known and m != name
                       and not name.startswith(m + ".")}  # a package's own __init__ is not an edge back
    return edges


def test_no_import_points_up():
    known = modules()
    upward = [f"{path.relative_to(ROOT)}:{line} imports {m}" for name, path in known.items()
              for line, m in imports_of(path, known) if LAYERS[m.split(".")[0]] > LAYERS[name.split(".")[0]]]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    edges = graph()
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"
    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("source, bad", [("from model import ops\n", "model.ops"),
                                         ("def f():\n    import serving.engine\n", "serving.engine")])
def test_the_check_sees_upward_imports(tmp_path, source, bad):
    # an import inside a function counts as much as one at the top
    path = tmp_path / "k.py"
    path.write_text(source)
    assert [m for _, m in imports_of(path, modules())] == [bad]
