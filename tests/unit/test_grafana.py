"""deploy/grafana/batchserve.json: a Grafana dashboard that validates against the dashboard model's schema
(deploy/grafana/dashboard.schema.json), queries only series batchserve/metrics.py exports, and shows what the
issue asked for (latency split into queue wait and compute, batch sizes, refusals by reason, per-model load, SLO
attainment per tier). And deploy/prometheus/batchserve-rules.yaml, the alert rule on the same SLO ledger, read
with the same PromQL parser."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import promql_parser
import pytest
import yaml

from batchserve.core.ledger import ADMITTED, OUTCOMES
from batchserve.metrics import make_metrics

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "batchserve-rules.yaml"
LEDGER = "batchserve_slo_requests_total"
# What Grafana substitutes before the query reaches Prometheus: its interval macro and the dashboard's variables
# (a multi-value variable becomes a regex alternation).
GRAFANA_VALUES = {"$__rate_interval": "1m", "$__interval": "15s", "$model": "a|b", "$instance": ".*"}
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
    "summary": ("_sum", "_count", "_created"),
}


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


@pytest.mark.parametrize(
    "break_it",
    [
        lambda b: b["panels"][0].pop("gridPos"),
        lambda b: b["panels"][0]["gridPos"].update(w=30),
        lambda b: b["panels"][1]["targets"][0].pop("expr"),
        lambda b: b["panels"][2].update(targets=[]),
        lambda b: b["templating"]["list"][1].pop("query"),
        lambda b: b.pop("schemaVersion"),
    ],
    ids=["no-gridPos", "too-wide", "no-expr", "no-targets", "variable-without-query", "no-schemaVersion"],
)
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
    split = [
        e
        for e in panels.values()
        if "batchserve_queue_wait_seconds_bucket" in e and "batchserve_batch_compute_seconds_bucket" in e
    ]
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


def outcomes_selected(node: promql_parser.Expr) -> set[str]:
    """The outcomes of the SLO ledger that the query's selectors of it let through (all of them when a selector
    names none)."""
    chosen: set[str] = set()

    def visit(n: object) -> bool:
        if isinstance(n, promql_parser.VectorSelector) and n.name == LEDGER:
            allowed = set(OUTCOMES)
            for m in n.matchers.matchers:
                if m.name != "outcome":
                    continue
                hit = {o for o in OUTCOMES if (re.fullmatch(m.value, o) if "Re" in str(m.op) else m.value == o)}
                allowed &= (set(OUTCOMES) - hit) if "Not" in str(m.op) else hit
            chosen.update(allowed)
        return True

    promql_parser.walk(node, visit)
    return chosen


def attainment_ratio(expr: promql_parser.Expr) -> promql_parser.BinaryExpr | None:
    """The first `met / admitted` division in the query: numerator only `met`, denominator exactly the admitted
    outcomes (met, slow, expired, failed: refusals left out), both summed by tier."""
    found: list[promql_parser.BinaryExpr] = []

    def visit(n: object) -> bool:
        if (
            isinstance(n, promql_parser.BinaryExpr)
            and str(n.op) == "/"
            and outcomes_selected(n.lhs) == {"met"}
            and outcomes_selected(n.rhs) == {OUTCOMES[i] for i in ADMITTED}
            and all("by (tier)" in str(side) for side in (n.lhs, n.rhs))
        ):
            found.append(n)
        return True

    promql_parser.walk(expr, visit)
    return found[0] if found else None


def test_the_dashboard_shows_slo_attainment_per_tier():
    panels = [p for p in dashboard()["panels"] if any(attainment_ratio(parsed(t["expr"])) for t in p["targets"])]
    assert panels, "no panel divides met by the admitted outcomes per tier"
    assert panels[0]["fieldConfig"]["defaults"]["unit"] == "percentunit"


def test_the_attainment_check_catches_refusals_in_the_denominator():
    wrong = (
        'sum by (tier) (rate(batchserve_slo_requests_total{outcome="met"}[1m])) / '
        "sum by (tier) (rate(batchserve_slo_requests_total[1m]))"
    )  # refused counted as admitted
    assert attainment_ratio(parsed(wrong)) is None
    right = wrong.replace("total[1m]))", 'total{outcome!="refused"}[1m]))')
    assert attainment_ratio(parsed(right)) is not None


def rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_the_alert_rules_file_has_prometheus_shape():
    """The shape Prometheus's rule loader accepts: groups of a name and rules; an alerting rule has alert, expr,
    and only the keys Prometheus knows, a duration in `for`, and string labels and annotations."""
    doc = yaml.safe_load(RULES.read_text())
    assert set(doc) == {"groups"}
    for group in doc["groups"]:
        assert set(group) <= {"name", "interval", "limit", "rules"} and group["name"] and group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}, rule
            assert re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", rule["alert"])
            assert re.fullmatch(r"(\d+[smhdwy])+", rule.get("for", "0s"))
            assert all(isinstance(v, str) for v in {**rule.get("labels", {}), **rule.get("annotations", {})}.values())
            parsed(rule["expr"])  # ValueError if Prometheus would refuse it
            assert series_of(rule["expr"]) <= exported_series(), rule["alert"]


def test_an_alert_fires_on_slo_attainment_of_admitted_requests_below_target():
    alerts = [(r, attainment_ratio(parsed(r["expr"]))) for r in rules()]
    (rule,) = [r for r, a in alerts if a is not None]
    comparison = next(
        n
        for n in [parsed(rule["expr"]).lhs, parsed(rule["expr"])]
        if isinstance(n, promql_parser.BinaryExpr) and str(n.op) == "<"
    )
    assert isinstance(comparison.rhs, promql_parser.NumberLiteral) and 0.5 <= comparison.rhs.val < 1
    assert "{{ $labels.tier }}" in rule["annotations"]["summary"]
