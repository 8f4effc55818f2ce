"""deploy/grafana/batchserve.json: a Grafana dashboard that validates against the dashboard model's schema
(deploy/grafana/dashboard.schema.json), queries only series batchserve/metrics.py exports, and shows what the
issue asked for (latency split into queue wait and compute, batch sizes, refusals by reason, per-model load)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import promql_parser
import pytest

from batchserve.metrics import make_metrics

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
# What Grafana substitutes before the query reaches Prometheus: its interval macro and the dashboard's variables
# (a multi-value variable becomes a regex alternation).
GRAFANA_VALUES = {"$__rate_interval": "1m", "$__interval": "15s", "$model": "a|b", "$instance": ".*"}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "summary": ("_sum", "_count", "_created")}


def dashboard() -> dict:
    return json.loads((GRAFANA / "batchserve.json").read_text())


def validator() -> jsonschema.Draft202012Validator:
    schema = json.loads((GRAFANA / "dashboard.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def exported_series() -> set[str]:
    """Every series name metrics.py's registry can expose (a counter `x` as `x_total`, a histogram as
    `x_bucket`, `x_sum`, `x_count`), labelled ones included even before their first sample."""
    names = set()
    for family in make_metrics().registry.collect():
        names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


def queries(board: dict) -> list[str]:
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def parsed(expr: str) -> promql_parser.Expr:
    """The query as Prometheus would parse it (promql-parser, a port of Prometheus's own parser); ValueError
    for a query Prometheus would refuse."""
    for macro, value in sorted(GRAFANA_VALUES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(macro, value)
    return promql_parser.parse(expr)


def series_of(expr: str) -> set[str]:
    """The metric names the query selects (every vector selector in its syntax tree)."""
    names: set[str] = set()

    def visit(node: object) -> bool:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)
        return True

    promql_parser.walk(parsed(expr), visit)
    return names


def unknown_series(board: dict) -> set[str]:
    return {name for expr in queries(board) for name in series_of(expr)} - exported_series()


def test_the_dashboard_validates_against_the_dashboard_schema():
    errors = sorted(validator().iter_errors(dashboard()), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


@pytest.mark.parametrize("break_it", [
    lambda b: b["panels"][0].pop("gridPos"),
    lambda b: b["panels"][0]["gridPos"].update(w=30),
    lambda b: b["panels"][1]["targets"][0].pop("expr"),
    lambda b: b["panels"][2].update(targets=[]),
    lambda b: b["templating"]["list"][1].pop("query"),
    lambda b: b.pop("schemaVersion"),
], ids=["no-gridPos", "too-wide", "no-expr", "no-targets", "variable-without-query", "no-schemaVersion"])
def test_the_schema_rejects_a_broken_dashboard(break_it):
    broken = copy.deepcopy(dashboard())
    break_it(broken)
    assert not validator().is_valid(broken)


def test_every_query_parses_as_promql():
    problems = []
    for expr in queries(dashboard()):
        try:
            parsed(expr)
        except ValueError as exc:
            problems.append(f"{expr}: {exc}")
    assert not problems, "\n".join(problems)
    with pytest.raises(ValueError):  # the parser does refuse a broken query
        parsed("sum(rate(batchserve_requests_total[$__rate_interval])")


def test_every_metric_the_dashboard_queries_is_one_batchserve_exports():
    board = dashboard()
    used = {name for expr in queries(board) for name in series_of(expr)}
    assert len(used) >= 10, used
    assert not unknown_series(board), f"not in batchserve/metrics.py: {unknown_series(board)}"


def test_a_misspelt_metric_is_caught():
    board = copy.deepcopy(dashboard())
    board["panels"][0]["targets"][0]["expr"] = "sum(rate(batchserve_request_total[1m])) by (status)"
    assert unknown_series(board) == {"batchserve_request_total"}  # requests_total


def test_the_dashboard_shows_what_an_operator_asks_first():
    panels = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in dashboard()["panels"]}
    split = [e for e in panels.values() if "batchserve_queue_wait_seconds_bucket" in e
             and "batchserve_batch_compute_seconds_bucket" in e]
    assert split, "latency split into queue wait and compute"
    assert any("batchserve_batch_size" in e for e in panels.values()), "batch sizes"
    assert any(re.search(r"sum by \(reason\) \(rate\(batchserve_rejected_total", e) for e in panels.values())
    assert any(re.search(r"sum by \(model\) \(rate\(batchserve_requests_total", e) for e in panels.values())
    assert any("batchserve_queue_depth" in e for e in panels.values())


def test_panels_do_not_overlap_and_use_the_dashboard_variables():
    board = dashboard()
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
    defined = {v["name"] for v in board["templating"]["list"]}
    used = {m for e in queries(board) for m in re.findall(r"\$(\w+)", e) if not m.startswith("__")}
    assert used <= defined, used - defined
    for p in board["panels"]:
        assert p["datasource"]["uid"] == "${datasource}"
