"""The tests mirror the code (issue 23 item 3): tests/unit/ (in process) and tests/integration/ (live servers,
subprocesses, the models), each laid out as batchserve/ is, so a module's tests are found where the module is.
Read from the file tree, so a new package or test file is covered without editing this test."""

from __future__ import annotations

import ast
from pathlib import Path

import batchserve

PACKAGE = Path(batchserve.__file__).parent
TESTS = Path(__file__).resolve().parents[1]
# Test files at the top of unit/ or integration/ that check what lies outside the package (the docs, deploy/,
# bench/, the image, the package's own shape): named by what they check, not by a module.
CROSS_CUTTING = {
    "test_bench_locust.py",
    "test_kserve_manifests.py",
    "test_llmd_config.py",
    "test_rayserve_app.py",
    "test_ray_serve.py",
    "test_bench_output.py",
    "test_bench_structure.py",
    "test_docs.py",
    "test_grafana.py",
    "test_k8s_manifests.py",
    "test_layout.py",
    "test_nginx.py",
    "test_packaging.py",
    "test_structure.py",
}
# Packages another branch is creating, whose tests are placed already (none now).
COMING: set[str] = set()


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
            if path.name not in cross_cutting and not (
                (package / f"{name}.py").exists() or (package / name / "__init__.py").exists()
            ):
                out.append(f"{kind}/{path.name}: batchserve has no module or package {name!r}")
    out += [
        f"{p.relative_to(tests)}: marked slow, so it belongs in integration/"
        for p in sorted((tests / "unit").rglob("test_*.py"))
        if marks_slow(p)
    ]
    return out


def marks_slow(path: Path) -> bool:
    """Whether the file uses `pytest.mark.slow` (read with `ast`: the words in a string do not count)."""
    return any(
        isinstance(n, ast.Attribute)
        and n.attr == "slow"
        and isinstance(n.value, ast.Attribute)
        and n.value.attr == "mark"
        for n in ast.walk(ast.parse(path.read_text()))
    )


def test_the_tests_mirror_the_code():
    mistakes = mirror_mistakes(TESTS, PACKAGE, CROSS_CUTTING, COMING)
    assert any((TESTS / "unit").rglob("test_*.py")), "no unit tests found: the check is not looking at tests/"
    assert not mistakes, "tests/ does not mirror batchserve/ (see docs/architecture.md, Tests):\n" + "\n".join(mistakes)


def test_the_mirror_check_finds_each_stray(tmp_path: Path):
    package, tests = tmp_path / "pkg", tmp_path / "tests"
    for path in ("__init__.py", "core/__init__.py", "plan.py"):
        (package / path).parent.mkdir(parents=True, exist_ok=True)
        (package / path).touch()
    good = [
        "unit/__init__.py",
        "unit/core/__init__.py",
        "unit/core/test_anything.py",
        "unit/test_plan.py",
        "unit/test_docs.py",
        "integration/__init__.py",
        "integration/soon/__init__.py",
        "integration/test_core.py",
    ]
    for path in good:
        (tests / path).parent.mkdir(parents=True, exist_ok=True)
        (tests / path).write_text("")
    assert mirror_mistakes(tests, package, {"test_docs.py"}, {"soon"}) == []
    for path, text in (
        ("test_flat.py", ""),
        ("unit/nowhere/__init__.py", ""),
        ("integration/core/test_x.py", ""),
        ("unit/test_nothing.py", ""),
        ("unit/core/test_slow.py", "pytestmark = pytest.mark.slow\n"),
    ):
        (tests / path).parent.mkdir(parents=True, exist_ok=True)
        (tests / path).write_text(text)
    assert mirror_mistakes(tests, package, {"test_docs.py"}, {"soon"}) == [
        "test_flat.py: a test outside unit/ and integration/",
        "unit/nowhere/: batchserve/nowhere/ is not a package",
        "unit/test_nothing.py: batchserve has no module or package 'nothing'",
        "integration/core/: no __init__.py",
        "unit/core/test_slow.py: marked slow, so it belongs in integration/",
    ]
