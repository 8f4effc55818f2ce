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


# -- the tests mirror the code (issue 23 item 3) ---------------------------------------------------------------------
TESTS = Path(__file__).resolve().parents[1]
# Test files at the top of unit/ or integration/ that check what lies outside the package (the docs, deploy/,
# bench/, the image, the package's own shape): named by what they check, not by a module.
CROSS_CUTTING = {"test_bench_output.py", "test_docs.py", "test_grafana.py", "test_k8s_manifests.py",
                 "test_nginx.py", "test_packaging.py", "test_structure.py"}
# Packages another branch is creating (issue 23a: the inference wing out of http/): their tests are placed
# already. Delete the entry once batchserve/inference/ exists.
COMING = {"inference"}


def mirror_mistakes(tests: Path, package: Path, cross_cutting: set[str], coming: set[str]) -> list[str]:
    """What in `tests` does not mirror `package`: a test file outside unit/ and integration/ (the CI's two runs
    would miss it), a folder that names no package (or lacks the __init__.py that keeps same-named test files
    apart), a top-level test file that names no module, and a unit test marked slow (the real model is
    integration's)."""
    out = [f"{p.relative_to(tests)}: a test outside unit/ and integration/" for p in sorted(tests.glob("test_*.py"))]
    for kind in ("unit", "integration"):
        root = tests / kind
        for folder in sorted(p for p in root.rglob("*") if p.is_dir() and p.name != "__pycache__"):
            rel = folder.relative_to(root)
            if not (package / rel / "__init__.py").exists() and rel.parts[0] not in coming:
                out.append(f"{kind}/{rel.as_posix()}/: batchserve/{rel.as_posix()}/ is not a package")
            if not (folder / "__init__.py").exists():
                out.append(f"{kind}/{rel.as_posix()}/: no __init__.py")
        for path in sorted(root.glob("test_*.py")):
            name = path.stem.removeprefix("test_")
            if path.name not in cross_cutting and not ((package / f"{name}.py").exists()
                                                       or (package / name / "__init__.py").exists()):
                out.append(f"{kind}/{path.name}: batchserve has no module or package {name!r}")
    out += [f"{p.relative_to(tests)}: marked slow, so it belongs in integration/"
            for p in sorted((tests / "unit").rglob("test_*.py")) if marks_slow(p)]
    return out


def marks_slow(path: Path) -> bool:
    """Whether the file uses `pytest.mark.slow` (read with `ast`: the words in a string do not count)."""
    return any(isinstance(n, ast.Attribute) and n.attr == "slow" and isinstance(n.value, ast.Attribute)
               and n.value.attr == "mark" for n in ast.walk(ast.parse(path.read_text())))


def test_the_tests_mirror_the_code():
    mistakes = mirror_mistakes(TESTS, PACKAGE, CROSS_CUTTING, COMING)
    assert any((TESTS / "unit").rglob("test_*.py")), "no unit tests found: the check is not looking at tests/"
    assert not mistakes, "tests/ does not mirror batchserve/ (see docs/architecture.md, Tests):\n" + "\n".join(mistakes)


def test_the_mirror_check_finds_each_stray(tmp_path: Path):
    package, tests = tmp_path / "pkg", tmp_path / "tests"
    for path in ("__init__.py", "core/__init__.py", "plan.py"):
        (package / path).parent.mkdir(parents=True, exist_ok=True)
        (package / path).touch()
    good = ["unit/__init__.py", "unit/core/__init__.py", "unit/core/test_anything.py", "unit/test_plan.py",
            "unit/test_docs.py", "integration/__init__.py", "integration/soon/__init__.py", "integration/test_core.py"]
    for path in good:
        (tests / path).parent.mkdir(parents=True, exist_ok=True)
        (tests / path).write_text("")
    assert mirror_mistakes(tests, package, {"test_docs.py"}, {"soon"}) == []
    for path, text in (("test_flat.py", ""), ("unit/nowhere/__init__.py", ""), ("integration/core/test_x.py", ""),
                       ("unit/test_nothing.py", ""), ("unit/core/test_slow.py", "pytestmark = pytest.mark.slow\n")):
        (tests / path).parent.mkdir(parents=True, exist_ok=True)
        (tests / path).write_text(text)
    assert mirror_mistakes(tests, package, {"test_docs.py"}, {"soon"}) == [
        "test_flat.py: a test outside unit/ and integration/",
        "unit/nowhere/: batchserve/nowhere/ is not a package",
        "unit/test_nothing.py: batchserve has no module or package 'nothing'",
        "integration/core/: no __init__.py",
        "unit/core/test_slow.py: marked slow, so it belongs in integration/"]


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
