"""The package's shape (issues 10, 23 and 35): no import circles between modules or between packages (a package
being `batchserve.X`: a subpackage or a top-level module), TYPE_CHECKING imports included; the wiring (app, cli,
runtime) imported by nothing it wires; no wing importing another's routes; one door to the batcher; and one
request path: no route module reads a body, takes rate tokens or renders an error itself. Read
from the source with `ast`, and the module list from `pkgutil`, so a new module is covered without editing this
test."""

from __future__ import annotations

import ast
from collections.abc import Iterator
import importlib.util
import pkgutil
import re
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
                return stack[stack.index(nxt) :] + [nxt]
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


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def package_of(module: str) -> str:
    """`batchserve.X`: the subpackage (or top-level module) a module belongs to."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph seen from afar: an edge between two packages when any module of one imports the other's."""
    out: dict[str, set[str]] = {package_of(m): set() for m in graph}
    for module, targets in graph.items():
        out[package_of(module)].update(package_of(t) for t in targets if package_of(t) != package_of(module))
    return out


def importers_of(graph: dict[str, set[str]], targets: set[str]) -> dict[str, set[str]]:
    return {m: ts & targets for m, ts in graph.items() if ts & targets}


def test_no_import_cycles():
    graph = import_graph()
    assert graph["batchserve.app"], "the import graph came out empty: the test is not reading imports"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycles_between_packages():
    """core/ and the batcher, http/ and the wings, the wings and the runtime once imported each other in loops
    (issue 23): a package may lean on one below it, never on one that leans on it."""
    graph = package_graph(import_graph())
    assert {"batchserve.core", "batchserve.http", "batchserve.inference", "batchserve.app"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle)


def test_the_package_graph_sees_a_loop_the_module_graph_does_not():
    modules_only = {"p.a.x": {"p.b.y"}, "p.b.y": set(), "p.b.z": {"p.a.w"}, "p.a.w": set()}
    assert find_cycle(modules_only) is None
    assert find_cycle(package_graph(modules_only)) == ["p.a", "p.b", "p.a"]


WIRING = {"batchserve.app", "batchserve.cli", "batchserve.runtime"}


def test_the_wiring_is_imported_by_nothing_it_wires():
    """app.py, cli.py and runtime.py put the wings together; a wing (or http/, core/) that imported them would
    depend on everything. Routes read the runtime through a Protocol of their own wing instead."""
    allowed = WIRING | {"batchserve.__main__"}
    wrong = {m: ts for m, ts in importers_of(import_graph(), WIRING).items() if m not in allowed}
    assert not wrong, wrong


def test_no_wing_imports_another_wings_routes():
    graph = import_graph()
    routes = {m for m in graph if m.endswith("routes")}
    assert "batchserve.inference.routes" in routes and "batchserve.jobs.routes" in routes
    wrong = {
        m: {t for t in ts if package_of(t) != package_of(m)}
        for m, ts in importers_of(graph, routes).items()
        if m not in WIRING
    }
    assert not any(wrong.values()), wrong


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_only_the_door_submits_to_the_batcher():
    """`Batcher.submit` is called from core/service.py alone: every route and the job scheduler go through
    the InferenceService (issue 10 §2)."""
    callers = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "submit"
                and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr == "batcher"
            ):
                callers.append(name)
    assert callers and set(callers) == {"batchserve.core.service"}, callers


def test_the_architecture_page_names_only_modules_that_exist():
    """docs/architecture.md follows requests through the code by module path: a moved module must move there too."""
    root = PACKAGE.parent
    text = (root / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:[a-z_]+/)*[a-z_0-9]+\.py)\b", text))
    assert "core/batcher.py" in named and "http/guards.py" in named
    missing = sorted(p for p in named if not (PACKAGE / p).exists() and not (root / p).exists())
    assert not missing, missing


# -- the one request path (issue 35 item 2) -----------------------------------------------------------------------
ROUTE_MODULES = sorted(
    {p for p in PACKAGE.glob("*/routes.py")}
    | {p for p in PACKAGE.glob("*/file_routes.py")}
    | {PACKAGE / "generation" / "serving.py", PACKAGE / "http" / "usage.py"}
)
# What only the skeleton (`http/endpoint.py`) and the dialects (`http/dialects.py`) do.
BODY_READERS = {"read_body_from", "body_chunks"}
ERROR_RENDERERS = {"error_response", "error_body", "send_json", "internal_error", "unexpected_error", "http_error"}
RATE_METHODS = {"take", "admit", "check", "enter", "take_token", "check_token", "identify", "check_ops_key"}
BODY_METHODS = {"body", "json", "form", "stream"}
# A route whose body is larger than any request body is parsed as it streams in, by its own parser.
STREAMED_UPLOADS = {
    "jobs/file_routes.py": "the multipart upload of a file, stored a chunk at a time",
    "jobs/routes.py": "a job's body of up to --jobs-max-body-bytes, parsed as it streams in (jobs/parse.py)",
}


def route_findings(path: Path) -> list[str]:
    """What a route module does that is the skeleton's: read a body, take rate tokens (or identify), render
    an error, or build a Starlette response (which would skip the one-write answer and the accounting)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = {a.name for a in node.names}
            if node.module == "batchserve.http.plumbing" and names & (BODY_READERS | ERROR_RENDERERS):
                found.append(f"imports {sorted(names & (BODY_READERS | ERROR_RENDERERS))} from http.plumbing")
            if node.module == "batchserve.http.dialects" and names & ERROR_RENDERERS:
                found.append(f"imports {sorted(names & ERROR_RENDERERS)} from http.dialects")
            if node.module == "starlette.responses":
                found.append(f"builds Starlette responses ({sorted(names)})")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            attr, owner = node.func.attr, node.func.value
            owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if attr in RATE_METHODS and owner_name in ("guard", "tenancy"):
                found.append(f"calls {owner_name}.{attr} (line {node.lineno})")
            if attr in BODY_METHODS and owner_name in ("request", "call"):
                found.append(f"reads the body: {owner_name}.{attr}() (line {node.lineno})")
            if attr == "receive" and owner_name in ("request", "call"):
                found.append(f"calls {owner_name}.receive() (line {node.lineno})")
        elif isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            if "error" in keys:
                found.append(f"writes an error shape by hand (line {node.lineno})")
    return found


def test_route_modules_leave_the_request_path_to_the_skeleton():
    assert len(ROUTE_MODULES) >= 10, ROUTE_MODULES  # the glob found the wings' route modules
    bad = {}
    for path in ROUTE_MODULES:
        rel = str(path.relative_to(PACKAGE))
        findings = route_findings(path)
        if rel in STREAMED_UPLOADS:
            findings = [f for f in findings if not f.startswith("reads the body: call.body()")]
        if findings:
            bad[rel] = findings
    assert not bad, bad


def test_the_route_check_sees_what_it_forbids(tmp_path):
    hand_written = tmp_path / "routes.py"
    hand_written.write_text(
        "from batchserve.http.plumbing import read_body_from\n"
        "from batchserve.http.dialects import error_response\n"
        "from starlette.responses import Response\n"
        "async def route(request, guard):\n"
        "    guard.take(caller)\n"
        "    await request.body()\n"
        "    call.body()\n"
        "    return {'error': 'X', 'message': 'y'}\n"
    )
    findings = route_findings(hand_written)
    assert len(findings) == 7, findings


# -- the size limits (issue 45) -------------------------------------------------------------------------------------
MODULE_LINES, FUNCTION_LINES, CLASS_LINES, CLASS_FIELDS = 600, 60, 400, 40
# What is past a limit, at its size: nothing now. Kept so that a limit ever let go is let go here, in sight, and
# may then only shrink: a module, function or class past a limit and not named here fails.
OVER_LIMIT: dict[str, int] = {}


def definitions(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    """Every function and class under `node`, nested ones too, by qualified name (`Class.method`)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield prefix + child.name, child
            yield from definitions(child, prefix + child.name + ".")


def sizes_past_limits(package: Path) -> dict[str, int]:
    """Every module over MODULE_LINES lines, function over FUNCTION_LINES, class over CLASS_LINES or with more than
    CLASS_FIELDS annotated fields, in `package`: `path`, `path:Qual.name` or `path:Class fields` -> its size."""
    out: dict[str, int] = {}
    for path in sorted(package.rglob("*.py")):
        source, rel = path.read_text(), path.relative_to(package).as_posix()
        if len(source.splitlines()) > MODULE_LINES:
            out[rel] = len(source.splitlines())
        for name, node in definitions(ast.parse(source)):
            assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if isinstance(node, ast.ClassDef):
                if lines > CLASS_LINES:
                    out[f"{rel}:{name}"] = lines
                fields = sum(isinstance(b, ast.AnnAssign) for b in node.body)
                if fields > CLASS_FIELDS:
                    out[f"{rel}:{name} fields"] = fields
            elif lines > FUNCTION_LINES:
                out[f"{rel}:{name}"] = lines
    return out


def test_nothing_grows_past_the_size_limits():
    found = sizes_past_limits(PACKAGE)
    new = {k: v for k, v in found.items() if k not in OVER_LIMIT}
    grown = {k: (OVER_LIMIT[k], v) for k, v in found.items() if k in OVER_LIMIT and v > OVER_LIMIT[k]}
    shrunk = {k: (OVER_LIMIT[k], v) for k, v in found.items() if k in OVER_LIMIT and v < OVER_LIMIT[k]}
    within = sorted(set(OVER_LIMIT) - set(found))
    assert not new, f"past a size limit (module {MODULE_LINES}, function {FUNCTION_LINES}, class {CLASS_LINES}): {new}"
    assert not grown, f"grown past their recorded size (was, now): {grown}"
    assert not within, f"within the limits now: take these out of OVER_LIMIT, so they stay so: {within}"
    assert not shrunk, f"smaller now (was, now): record the new sizes in OVER_LIMIT, so they cannot grow back: {shrunk}"


def test_the_size_check_sees_a_long_function(tmp_path: Path):
    body = "\n".join(f"        x{i} = {i}" for i in range(FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"class C:\n    def f(self):\n{body}\n")
    assert sizes_past_limits(tmp_path) == {"m.py:C.f": FUNCTION_LINES + 1}
