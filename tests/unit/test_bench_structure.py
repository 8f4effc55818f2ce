"""bench/'s shape (issue 35 item 6): no import circle between bench modules (report.py and run_standard.py once
imported each other), read from the source with `ast` like tests/unit/test_structure.py reads batchserve/, and
the module list from the folder, so a new bench script is covered without editing this test."""

from __future__ import annotations

import pkgutil
from pathlib import Path

from tests.unit.test_structure import find_cycle, imports_of

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_modules() -> dict[str, Path]:
    found = {"bench": BENCH / "__init__.py"}
    for info in pkgutil.walk_packages([str(BENCH)], prefix="bench."):
        folder = BENCH.joinpath(*info.name.split(".")[1:])
        found[info.name] = folder / "__init__.py" if info.ispkg else folder.with_suffix(".py")
    return found


def bench_graph() -> dict[str, set[str]]:
    mods = bench_modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def test_bench_has_no_import_cycle():
    graph = bench_graph()
    assert "bench.report" in graph["bench.run_standard"], "the graph is not reading bench's imports"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in bench/: " + " -> ".join(cycle)


def test_the_bench_graph_sees_imports_inside_functions(tmp_path: Path):
    """run_standard once imported report inside main() to dodge the circle at import time: still a circle."""
    (tmp_path / "a.py").write_text("def main():\n    from bench import b\n")
    (tmp_path / "b.py").write_text("from bench.a import main\n")
    known = {"bench.a", "bench.b"}
    graph = {m: imports_of(m, tmp_path / f"{m.split('.')[1]}.py", known) for m in known}
    assert find_cycle(graph) in (["bench.a", "bench.b", "bench.a"], ["bench.b", "bench.a", "bench.b"])
