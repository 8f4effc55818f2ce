"""The SLO ledger's policy (`core/ledger.py`): which outcome each answer is, and the per-tenant usage window of
GET /v1/usage, on an injected clock."""

from __future__ import annotations

import pytest

from batchserve.core import ledger
from batchserve.core.ledger import BUCKET_S, LATENCIES, MAX_WINDOW_S, UsageBook


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    "status, outcome",
    [
        (429, "refused"),
        (503, "refused"),
        (504, "expired"),
        (500, "failed"),
        (501, "failed"),
        (502, "failed"),
        (400, None),
        (401, None),
        (404, None),
        (413, None),
        (408, None),
        (422, None),
    ],
)
def test_error_outcomes(status, outcome):
    got = ledger.error_outcome(status)
    assert (None if got is None else ledger.OUTCOMES[got]) == outcome


def test_a_served_answer_is_met_up_to_the_slo_and_slow_past_it():
    assert ledger.served_outcome(0.1999, 0.2) == ledger.MET
    assert ledger.served_outcome(0.2, 0.2) == ledger.MET  # "within" the SLO includes it
    assert ledger.served_outcome(0.2001, 0.2) == ledger.SLOW


def test_attainment_divides_by_what_was_admitted():
    assert [ledger.OUTCOMES[i] for i in ledger.ADMITTED] == ["met", "slow", "expired", "failed"]


def test_the_window_counts_requests_inputs_and_cost_by_outcome():
    clock = Clock()
    book = UsageBook(clock)
    book.record("acme", "paid", ledger.MET, 4, 40.0, 0.05, "m@v1")
    book.record("acme", "paid", ledger.SLOW, 2, 30.0, 0.5, "m@v1")
    book.record("acme", "paid", ledger.REFUSED, 3, 99.0, 0.0, "m@v1")  # refused: its cost was not served
    book.record("other", "free", ledger.EXPIRED, 1, 1.0, 0.0, "m@v1")
    got = book.report("acme")
    assert got["requests"] == {"met": 1, "slow": 1, "refused": 1, "expired": 0, "failed": 0}
    assert got["inputs"] == {"met": 4, "slow": 2, "refused": 3, "expired": 0, "failed": 0}
    assert got["cost_served"] == 70.0
    assert got["tier"] == "paid" and got["tenant"] == "acme"
    assert got["latency_ms"] == {
        "count": 2,
        "p50": 50.0,
        "p95": 500.0,
        "sample_max": LATENCIES,
        "by_model": {"m@v1": {"count": 2, "p50": 50.0, "p95": 500.0}},
    }
    assert got["since_start"]["requests"] == got["requests"]
    assert book.report("other")["requests"]["expired"] == 1 and book.report("other")["cost_served"] == 0


def test_the_window_forgets_what_is_older_and_since_start_does_not():
    clock = Clock()
    book = UsageBook(clock)
    book.record("acme", "paid", ledger.MET, 1, 1.0, 0.01, "m@v1")
    clock.now += 100
    book.record("acme", "paid", ledger.MET, 1, 1.0, 0.03, "m@v1")
    recent = book.report("acme", window_s=50)
    assert recent["requests"]["met"] == 1 and recent["latency_ms"]["count"] == 1
    assert recent["latency_ms"]["p50"] == 30.0
    assert recent["since_start"]["requests"]["met"] == 2
    assert book.report("acme", window_s=200)["requests"]["met"] == 2


def test_a_window_is_rounded_out_to_whole_buckets():
    clock = Clock(1000.0)  # a bucket edge
    book = UsageBook(clock)
    book.record("acme", "paid", ledger.MET, 1, 1.0, 0.01, "m@v1")  # in bucket [1000, 1005)
    clock.now = 1000.0 + BUCKET_S + 1  # 1006: now in bucket [1005, 1010)
    assert book.report("acme", window_s=0.5)["requests"]["met"] == 0  # back to 1005.5: not its bucket
    assert book.report("acme", window_s=2)["requests"]["met"] == 1  # back to 1004: its bucket, counted whole
    assert book.report("acme", window_s=2)["latency_ms"]["count"] == 0  # latencies: the window exactly


def test_memory_is_bounded_per_tenant():
    clock = Clock()
    book = UsageBook(clock)
    for _ in range(int(MAX_WINDOW_S / BUCKET_S) * 3):
        book.record("acme", "paid", ledger.MET, 1, 1.0, 0.01, "m@v1")
        clock.now += BUCKET_S
    usage = book.tenants["acme"]
    assert len(usage.buckets) <= MAX_WINDOW_S / BUCKET_S + 1
    assert len(usage.latencies) == LATENCIES
    assert book.report("acme", MAX_WINDOW_S)["requests"]["met"] <= MAX_WINDOW_S / BUCKET_S + 1
    assert book.report("acme")["since_start"]["requests"]["met"] == int(MAX_WINDOW_S / BUCKET_S) * 3


def test_percentiles_are_nearest_rank_over_the_served_answers():
    book = UsageBook(Clock())
    for ms in range(1, 101):  # 1 .. 100 ms
        book.record("acme", "paid", ledger.MET, 1, 1.0, ms / 1000, "m@v1")
    book.record("acme", "paid", ledger.REFUSED, 1, 1.0, 0.0, "m@v1")  # no latency of its own
    latency = book.report("acme")["latency_ms"]
    assert (latency["count"], latency["p50"], latency["p95"]) == (100, 50.0, 95.0)


def test_percentiles_per_model_beside_the_tenants_mix():
    """A tenant that calls a fast embedder and a slow LM: its p95 mixes both, each model's is its own; a model
    with no served answer in the window is not listed."""
    clock = Clock()
    book = UsageBook(clock)
    book.record("acme", "paid", ledger.MET, 1, 1.0, 0.5, "old@v1")
    clock.now += 100
    for ms in range(1, 101):
        book.record("acme", "paid", ledger.MET, 1, 1.0, ms / 1000, "embed@v1")
    for ms in range(1001, 1011):
        book.record("acme", "paid", ledger.MET, 1, 1.0, ms / 1000, "lm@v1")
    book.record("acme", "paid", ledger.REFUSED, 1, 1.0, 0.0, "lm@v1")
    latency = book.report("acme", window_s=50)["latency_ms"]
    assert (latency["count"], latency["p50"], latency["p95"], latency["sample_max"]) == (110, 55.0, 1005.0, LATENCIES)
    assert latency["by_model"] == {
        "embed@v1": {"count": 100, "p50": 50.0, "p95": 95.0},
        "lm@v1": {"count": 10, "p50": 1005.0, "p95": 1010.0},
    }
    assert set(book.report("acme", window_s=200)["latency_ms"]["by_model"]) == {"embed@v1", "lm@v1", "old@v1"}


def test_each_models_sample_is_bounded():
    book = UsageBook(Clock())
    for _ in range(LATENCIES + 10):
        book.record("acme", "paid", ledger.MET, 1, 1.0, 0.01, "a@v1")
        book.record("acme", "paid", ledger.MET, 1, 1.0, 0.02, "b@v1")
    usage = book.tenants["acme"]
    assert len(usage.latencies) == len(usage.by_model["a@v1"]) == len(usage.by_model["b@v1"]) == LATENCIES
    assert book.report("acme")["latency_ms"]["by_model"]["b@v1"]["count"] == LATENCIES


def test_an_unknown_tenant_reads_zeros():
    got = UsageBook(Clock()).report("nobody")
    assert got["requests"] == dict.fromkeys(ledger.OUTCOMES, 0) and got["latency_ms"]["p50"] is None
    assert got["tier"] is None


def test_every_tenant_for_an_admin():
    book = UsageBook(Clock())
    for tenant in ("zeta", "acme"):
        book.record(tenant, "free", ledger.MET, 1, 1.0, 0.01, "m@v1")
    assert [r["tenant"] for r in book.reports()] == ["acme", "zeta"]
