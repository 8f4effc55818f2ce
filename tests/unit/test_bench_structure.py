"""bench/'s shape (issue 35 item 6): no import circle between bench modules (report.py and run_standard.py once
imported each other), read from the source with `ast` like tests/unit/test_structure.py reads batchserve/, and
the module list from the folder, so a new bench script is covered without editing this test."""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import sys
from pathlib import Path

import pytest

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


class Parsed(Exception):
    """Raised in place of running a bench once its flags are parsed."""


def test_every_command_in_the_catalogue_exists_and_takes_its_quick_flags(monkeypatch: pytest.MonkeyPatch):
    """`python -m bench GROUP --quick` passes each bench the flags in bench/commands.py: a renamed flag or a
    removed bench must show here, not halfway through a group's run. Each bench's own parser reads them (its
    `main` stops right after parsing)."""
    from bench.commands import GROUPS

    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        raise Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    names = [b.name for _, benches in GROUPS.values() for b in benches]
    assert len(names) == len(set(names)), "a command listed twice"
    for _, benches in GROUPS.values():
        for b in benches:
            path = BENCH / (b.name if b.name.endswith(".sh") else f"{b.name}.py")
            assert path.exists(), path
            if b.name.endswith(".sh"):
                assert all(f in path.read_text() for f in b.quick), (b.name, b.quick)
                continue
            main = importlib.import_module(f"bench.{b.name}").main
            for argv in (list(b.quick), [*b.quick, "--record"] if b.output else list(b.quick)):
                monkeypatch.setattr(sys, "argv", [f"bench/{b.name}.py", *argv])
                with pytest.raises(Parsed):  # SystemExit (argparse's error) would fail the test
                    main(argv) if inspect.signature(main).parameters else main()


def test_the_readme_table_lists_each_command_once():
    from bench.commands import GROUPS

    rows = [
        line
        for line in (BENCH / "README.md").read_text().splitlines()
        if line.startswith(("| `python -m bench.", "| `bash bench/"))
    ]
    listed = [row.split("`")[1].split()[-1].removeprefix("bench.").removeprefix("bench/") for row in rows]
    assert sorted(listed) == sorted(b.name for _, benches in GROUPS.values() for b in benches)
