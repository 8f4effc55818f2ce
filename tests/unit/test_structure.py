"""The package's shape (issue 10): no import circles, TYPE_CHECKING imports included, and one door to the
batcher. Read from the source with `ast`, and the module list from `pkgutil`, so a new module is covered
without editing this test."""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
from pathlib import Path

import batchserve

PACKAGE = Path(batchserve.__file__).parent


def modules() -> dict[str, Path]:
    found = {"batchserve": PACKAGE / "__init__.py"}
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="batchserve."):
        spec = importlib.util.find_spec(info.name)
        assert spec is not None and spec.origin is not None
        found[info.name] = Path(spec.origin)
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every batchserve module `name` imports anywhere in its source (function bodies and TYPE_CHECKING
    blocks too): `from a.b import c` counts as an import of `a.b.c` when that is a module, else of `a.b`."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycles():
    mods = modules()
    graph = {name: imports_of(name, path, set(mods)) for name, path in mods.items()}
    assert graph["batchserve.app"], "the import graph came out empty: the test is not reading imports"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_only_the_door_submits_to_the_batcher():
    """`Batcher.submit` is called from core/service.py alone: every route and the job scheduler go through
    the InferenceService (issue 10 §2)."""
    callers = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "submit"
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "batcher"):
                callers.append(name)
    assert callers and set(callers) == {"batchserve.core.service"}, callers
