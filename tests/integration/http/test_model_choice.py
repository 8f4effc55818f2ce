"""While the models load (the port is open before), a request that names no model answers as `/v1/inference`
does then: 503 `NO_HEALTHY_WORKER` "warming up", not a 404 saying no model embeds. The plugin backend here
holds its constructor until the test releases it, so the warm-up lasts exactly as long as the test needs."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.conftest import start_server
from tests.integration.backends.test_plugin import write_plugins

HELD_EMBEDDER = """
import os
import time


class Embedder:
    output_kind = "embedding"

    def __init__(self, gate):
        while not os.path.exists(gate):  # loading, until the test says
            time.sleep(0.02)

    def batch(self, inputs):
        return [[float(len(text)), 1.0] for text in inputs]
"""


def test_requests_naming_no_model_are_503_warming_up_while_the_models_load(tmp_path: Path) -> None:
    env = write_plugins(tmp_path, held=HELD_EMBEDDER)
    gate = tmp_path / "loaded"
    config = tmp_path / "bs.toml"
    config.write_text(f'[[models]]\nname = "embed"\nbackend = "held:Embedder"\n[models.options]\ngate = "{gate}"\n')
    server = start_server("--config", str(config), "--slo-ms", "5000", "--timeout-ms", "10000", env=env, ready=False)
    try:
        with server.client() as c:
            assert c.get("/readyz").status_code == 503
            inference = c.post("/v1/inference", json={"input": "hi"})
            unnamed = c.post("/v1/embeddings", json={"input": "hi"})
            named = c.post("/v1/embeddings", json={"input": "hi", "model": "embed"})
            for r in (inference, unnamed, named):
                assert r.status_code == 503, r.text
                assert "warming up" in r.text and r.headers.get("retry-after"), r.text
            assert unnamed.json()["error"]["code"] == named.json()["error"]["code"]
            gate.touch()
            server.wait_ready()
            r = c.post("/v1/embeddings", json={"input": "hi"})
            assert r.status_code == 200 and r.json()["data"][0]["embedding"] == [2.0, 1.0], r.text
    finally:
        server.stop()


def test_with_models_loaded_none_that_embeds_is_404() -> None:
    server = start_server("--slo-ms", "5000")  # the sim backend: json outputs, no embeddings
    try:
        r = httpx.post(server.url + "/v1/embeddings", json={"input": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    finally:
        server.stop()
