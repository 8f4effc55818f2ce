"""The series read at scrape time (`batchserve/metrics.py`): admission's predicted and observed waits, one series
per model in each family, each family's value from its own place in the row."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from batchserve.metrics import AdmissionWaitCollector


def samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, s.labels["model"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "model" in s.labels
    }


def test_admission_waits_are_one_series_per_model_each_from_its_place_in_the_row() -> None:
    registry = CollectorRegistry()
    rows = {"b@v1": (1.5, 3.0, 4, 1.25, 0.05), "a@v1": (0.5, 0.25, 2, 0.75, 0.0)}
    AdmissionWaitCollector(lambda: rows, registry)
    got = samples(registry)
    p = "batchserve_admission_"
    for model, (predicted, actual, n, factor, margin) in rows.items():
        assert got[(p + "predicted_wait_seconds_total", model)] == predicted
        assert got[(p + "actual_wait_seconds_total", model)] == actual
        assert got[(p + "calibrated_requests_total", model)] == n
        assert got[(p + "wait_factor", model)] == factor
        assert got[(p + "wait_margin_seconds", model)] == margin
    assert len(got) == 10  # five families, two models, nothing else


def test_no_model_no_series() -> None:
    registry = CollectorRegistry()
    AdmissionWaitCollector(dict, registry)
    assert samples(registry) == {}
