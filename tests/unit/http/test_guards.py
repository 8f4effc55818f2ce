"""The one guard every route goes through (issue 23, `http/guards.py`): in-process, on the real tenancy and
metrics. And, read from the source, that no route identifies, limits or counts answers on its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import batchserve
from batchserve import errors
from batchserve.http.guards import Guard, ANONYMOUS_OWNER, KeyEntry, Tenancy, digest
from batchserve.metrics import make_metrics

KEY = "bs_test-key"


def guard(with_key: bool = False, metrics_key: str = "") -> Guard:
    keys = [KeyEntry("acme", "free", digest(KEY), rate=1, burst=2)] if with_key else []
    return Guard(Tenancy(keys=keys, anonymous_allowed=True), make_metrics(), metrics_key)


def peer(address: str) -> dict:
    """A request's scope as the guard reads it: the peer's address."""
    return {"type": "http", "client": (address, 50000)}


def sample(g: Guard, model: str, status: str) -> float:
    return g.metrics.registry.get_sample_value("batchserve_requests_total", {"model": model, "status": status}) or 0


def test_openai_routes_take_any_key_as_anonymous_when_none_are_configured_and_keep_the_client_address():
    g = guard()
    caller = g.identify("Bearer sk-whatever", peer("10.1.2.3"), openai=True)
    assert caller.key_id == "" and caller.owner == ANONYMOUS_OWNER + "10.1.2.3"
    with pytest.raises(errors.ApiError) as refused:  # the native routes do not: an unknown key is a mistake
        g.identify("Bearer sk-whatever", peer("10.1.2.3"))
    assert refused.value.status == 401


def test_a_configured_key_is_checked_on_every_route_alike():
    g = guard(with_key=True)
    for openai in (False, True):
        assert g.identify(f"Bearer {KEY}", peer("10.0.0.1"), openai=openai).owner == "acme"
        with pytest.raises(errors.ApiError):
            g.identify("Bearer bs_wrong", peer("10.0.0.1"), openai=openai)


def test_admit_takes_count_tokens_and_says_the_limits():
    g = guard(with_key=True)
    caller, headers = g.admit(f"Bearer {KEY}", peer("10.0.0.1"), count=2)
    assert caller.tenant == "acme" and headers["x-ratelimit-remaining"] == "0"
    with pytest.raises(errors.ApiError) as limited:
        g.admit(f"Bearer {KEY}", peer("10.0.0.1"))
    assert limited.value.status == 429 and limited.value.code == "RATE_LIMITED"


def test_enter_refuses_an_empty_bucket_before_the_body_and_takes_nothing():
    g = guard(with_key=True)  # a burst of 2
    caller = g.enter(f"Bearer {KEY}", peer("10.0.0.1"))
    g.enter(f"Bearer {KEY}", peer("10.0.0.1"))
    assert g.take(caller, 2)["x-ratelimit-remaining"] == "0"  # entering took none of the 2
    with pytest.raises(errors.ApiError) as limited:
        g.enter(f"Bearer {KEY}", peer("10.0.0.1"))
    assert limited.value.status == 429 and limited.value.headers["x-ratelimit-remaining"] == "0"
    with pytest.raises(errors.ApiError) as unknown:
        g.enter("Bearer bs_wrong", peer("10.0.0.1"))
    assert unknown.value.status == 401


def test_every_answer_is_counted_once_and_the_model_ones_in_the_metrics():
    g = guard()
    caller = g.identify(None, peer("10.0.0.1"))
    g.ok("m", 0.01, caller)
    g.refused("m", errors.overloaded("busy", 100), caller)
    g.refused("unknown", errors.unauthorized("no"), None)
    g.counted()
    g.shed(errors.ApiError(503, "KV_CAPACITY", "full"))  # counted when its answer goes out, not here
    assert g.answered == 4
    assert sample(g, "m", "200") == 1 and sample(g, "m", "503") == 1 and sample(g, "unknown", "401") == 1
    rejected = g.metrics.registry.get_sample_value
    assert rejected("batchserve_rejected_total", {"reason": "KV_CAPACITY"}) == 1


def test_the_operational_key():
    guard().check_ops_key(None)  # none set: open
    g = guard(metrics_key="ops-secret")
    g.check_ops_key("Bearer ops-secret")
    for wrong in (None, "Bearer nope", "ops-secret", "Basic ops-secret"):
        with pytest.raises(errors.ApiError) as refused:
            g.check_ops_key(wrong)
        assert refused.value.status == 401


def calls_outside_the_guard() -> list[str]:
    """Every place in the package, the guard aside, that identifies a caller, takes rate tokens, checks the ops
    key or counts an answer by itself."""
    package = Path(batchserve.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "guards.py" and path.parent.name == "http":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("identify", "take_token", "count_ok", "count_error", "count_outcome")
                and not (isinstance(node.func.value, ast.Name) and node.func.value.id in ("self", "guard"))
            ):
                found.append(f"{path.relative_to(package)}:{node.lineno} {node.func.attr}")
            if (
                isinstance(node, ast.AugAssign)
                and isinstance(node.target, ast.Attribute)
                and node.target.attr == "answered"
            ):
                found.append(f"{path.relative_to(package)}:{node.lineno} answered +=")
    return found


def test_no_route_identifies_limits_or_counts_on_its_own():
    assert calls_outside_the_guard() == []


def ledger_sample(g: Guard, name: str, **labels: str) -> float:
    return g.metrics.registry.get_sample_value(name, labels) or 0


def test_the_ledger_books_every_model_answer_by_model_tier_and_outcome():
    g = guard(with_key=True)  # acme, tier free
    g.slo_s = 0.2
    acme = g.identify(f"Bearer {KEY}", peer("10.0.0.1"))
    anon = g.identify(None, peer("10.0.0.2"))  # tier paid (the anonymous tier)
    g.ok("m", 0.15, acme, 4, 40.0)
    g.ok("m", 0.25, acme, 2, 10.0)
    g.refused("unknown", errors.rate_limited("over", 100, {}), acme)
    g.refused("m", errors.overloaded("busy", 100), anon, 3)
    g.refused("m", errors.deadline_exceeded(), acme)
    g.refused("m", errors.inference_failed("boom"), acme)
    g.refused("m", errors.invalid("bad body"), acme)  # the caller's mistake: no outcome
    g.refused("unknown", errors.unauthorized("no"), None)
    g.settle("m", acme, 499, 0.0)  # the caller hung up: no outcome
    series = "batchserve_slo_requests_total"
    assert ledger_sample(g, series, model="m", tier="free", outcome="met") == 1
    assert ledger_sample(g, series, model="m", tier="free", outcome="slow") == 1
    assert ledger_sample(g, series, model="unknown", tier="free", outcome="refused") == 1
    assert ledger_sample(g, series, model="m", tier="paid", outcome="refused") == 1
    assert ledger_sample(g, series, model="m", tier="free", outcome="expired") == 1
    assert ledger_sample(g, series, model="m", tier="free", outcome="failed") == 1
    assert ledger_sample(g, "batchserve_cost_served_total", model="m", tier="free") == 50.0
    assert ledger_sample(g, "batchserve_inputs_served_total", model="m", tier="free") == 6
    assert ledger_sample(g, "batchserve_inputs_served_total", model="m", tier="paid") == 0
    total = sum(
        s.value
        for f in g.metrics.registry.collect()
        if f.name == "batchserve_slo_requests"
        for s in f.samples
        if s.name == series
    )
    assert total == 6
    exposed = [s.labels for f in g.metrics.registry.collect() for s in f.samples]
    assert not any("acme" in labels.values() or "tenant" in labels for labels in exposed)  # contract.md#observability
    mine = g.usage.report("acme")
    assert mine["requests"] == {"met": 1, "slow": 1, "refused": 1, "expired": 1, "failed": 1}
    assert mine["inputs"]["met"] == 4 and mine["cost_served"] == 50.0
    assert g.usage.report("anonymous")["inputs"]["refused"] == 3


def test_the_slo_in_force_is_the_one_answers_are_held_to():
    g = guard()
    caller = g.identify(None, peer("10.0.0.1"))
    g.slo_s = 1.0  # derived after the warm-up, say
    g.ok("m", 0.5, caller)
    assert ledger_sample(g, "batchserve_slo_requests_total", model="m", tier="paid", outcome="met") == 1
