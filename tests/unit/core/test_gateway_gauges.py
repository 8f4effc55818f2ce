"""The gateway gauges' collector in process (issue 26 item 4); the gauges moving under real load are
tests/integration/core/test_gateway_gauges.py."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from batchserve.core.load_signal import GatewayGauges, ModelLoad


def gauges(text: str) -> dict[tuple[str, str], float]:
    """(metric name, model) -> value, for the gateway gauges in a /metrics text."""
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith(("batchserve_num_requests_", "batchserve_kv_cache_usage_perc")):
            for sample in family.samples:
                out[(sample.name, sample.labels["model"])] = sample.value
    return out


def test_collector_exports_one_series_per_model_and_kv_only_for_generation():
    loads = {"sim@v1": ModelLoad(3, 2), "SmolLM2-135M-Instruct": ModelLoad(1, 4, 0.25)}
    registry = CollectorRegistry()
    GatewayGauges(lambda: loads, registry)
    got = gauges(generate_latest(registry).decode())
    assert got == {
        ("batchserve_num_requests_waiting", "sim@v1"): 3,
        ("batchserve_num_requests_running", "sim@v1"): 2,
        ("batchserve_num_requests_waiting", "SmolLM2-135M-Instruct"): 1,
        ("batchserve_num_requests_running", "SmolLM2-135M-Instruct"): 4,
        ("batchserve_kv_cache_usage_perc", "SmolLM2-135M-Instruct"): 0.25,
    }
    loads["sim@v1"] = ModelLoad(0, 0)  # read at scrape time, not when registered
    assert gauges(generate_latest(registry).decode())[("batchserve_num_requests_waiting", "sim@v1")] == 0
