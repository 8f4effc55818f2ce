"""Tracing in process (issue 26 item 3): off without an endpoint, route templates name no values (a live server's
spans are tests/integration/test_tracing.py)."""

from __future__ import annotations

from batchserve.app import FastPath, create_app
from batchserve.config import Settings
from batchserve.tracing import Tracing, route_template


def test_off_without_an_endpoint():
    assert Tracing.from_env({}) is None
    assert Tracing.from_env({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:1/v1/traces"}) is not None
    assert isinstance(create_app(Settings()), FastPath)  # this test's environment names no endpoint


def test_route_template_names_no_values():
    assert (
        route_template("/v2/models/sim/versions/v1/infer", {"model": "sim", "version": "v1"})
        == "/v2/models/{model}/versions/{version}/infer"
    )
    assert route_template("/v1/inference", None) == "/v1/inference"
