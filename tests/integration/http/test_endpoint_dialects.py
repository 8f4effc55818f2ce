"""The one request path (`http/endpoint.py`), seen from outside: one real server, one route per dialect (native
`/v1/inference`, OpenAI `/v1/embeddings`, KServe `/v2/models/{m}/infer`), each made to answer an invalid body
(400), a refusal (429, a key whose bucket holds one token) and a failure (500, an input its backend fails on).
Each error must come back in its route's dialect with the request id and, on the 429, Retry-After; and each must
be counted: the 400 in the status counts, the 429 as `refused` and the 500 as `failed` in the SLO ledger
(`batchserve_slo_requests_total`), as the skeleton books every exit of every route alike."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.conftest import LiveServer, start_server
from tests.integration.inference.test_routes import metric
from tests.integration.http.test_tenancy import add_key

FAIL = "FAILS-HERE"
EMBED_PLUGIN = f'''
class Embed:
    output_kind = "embedding"
    max_batch_size = 8

    def batch(self, inputs):
        if any("{FAIL}" in text for text in inputs):
            raise RuntimeError("this input breaks the model")
        return [[float(len(text)), 0.5] for text in inputs]
'''


def native(text: str) -> tuple[str, dict]:
    return "/v1/inference", {"input": text, "model": "echo"}


def openai(text: str) -> tuple[str, dict]:
    return "/v1/embeddings", {"input": [text], "model": "embed"}


def kserve(text: str) -> tuple[str, dict]:
    return "/v2/models/echo/infer", {"inputs": [{"name": "input", "shape": [1], "datatype": "BYTES", "data": [text]}]}


def native_shape(body: dict, status: int) -> None:
    assert set(body) >= {"error", "message", "request_id"} and body["error"].isupper(), body


def openai_shape(body: dict, status: int) -> None:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    kinds = {400: "invalid_request_error", 429: "rate_limit_error", 500: "server_error"}
    assert err["type"] == kinds[status] and err["message"], body


def kserve_shape(body: dict, status: int) -> None:
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], body


DIALECTS = {
    "native": (native, native_shape, "echo@v1"),
    "openai": (openai, openai_shape, "embed@v1"),
    "kserve": (kserve, kserve_shape, "echo@v1"),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("dialects")
    (root / "failplug.py").write_text(EMBED_PLUGIN)
    config = root / "bs.toml"
    config.write_text(
        '[[models]]\nname = "embed"\nbackend = "failplug:Embed"\n\n'
        '[[models]]\nname = "echo"\nbackend = "sim"\nsim_batch_ms = 5\n'
    )
    keys = {"big": add_key(config, "big", "enterprise", "--rate", "10000")}
    for name in DIALECTS:  # one token each, refilled once in 1,000 s: the second request is a 429
        keys[name] = add_key(config, f"one-{name}", "free", "--rate", "0.001")
        with config.open("a") as fh:
            fh.write("burst = 1\n")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    s = start_server(
        "--config", str(config), "--slo-ms", "5000", "--timeout-ms", "10000", "--sim-input-fail-marker", FAIL, env=env
    )
    s.keys = keys  # type: ignore[attr-defined]
    yield s
    s.stop()


def post(server: LiveServer, dialect: str, text: str, key: str, raw: bytes | None = None) -> httpx.Response:
    path, body = DIALECTS[dialect][0](text)
    headers = {"Authorization": f"Bearer {key}", "X-Request-ID": f"dialect-{dialect}"}
    with httpx.Client(base_url=server.url, timeout=30) as c:
        if raw is not None:
            return c.post(path, content=raw, headers={**headers, "Content-Type": "application/json"})
        return c.post(path, json=body, headers=headers)


def scrape(server: LiveServer) -> str:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        return c.get("/metrics").text


def counted(server: LiveServer) -> Callable[..., float]:
    text = scrape(server)
    return lambda name, **labels: metric(text, name, **labels)


@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_an_invalid_body_is_a_400_in_the_dialect_and_counted(server: LiveServer, dialect: str) -> None:
    shape = DIALECTS[dialect][1]
    before = counted(server)("batchserve_requests_total", model="unknown", status="400")
    r = post(server, dialect, "", server.keys["big"], raw=b"{not json")  # type: ignore[attr-defined]
    assert r.status_code == 400, r.text
    shape(r.json(), 400)
    assert r.headers["x-request-id"] == f"dialect-{dialect}"
    after = counted(server)("batchserve_requests_total", model="unknown", status="400")
    assert after == before + 1


@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_a_refusal_is_a_429_in_the_dialect_and_booked_refused(server: LiveServer, dialect: str) -> None:
    shape = DIALECTS[dialect][1]
    key = server.keys[dialect]  # type: ignore[attr-defined]
    before = counted(server)("batchserve_slo_requests_total", model="unknown", tier="free", outcome="refused")
    before_model = counted(server)(
        "batchserve_slo_requests_total", model=DIALECTS[dialect][2], tier="free", outcome="refused"
    )
    first = post(server, dialect, "spends the one token", key)
    assert first.status_code == 200, first.text
    r = post(server, dialect, "one too many", key)
    assert r.status_code == 429, r.text
    shape(r.json(), 429)
    assert int(r.headers["retry-after"]) >= 1 and r.headers["x-request-id"] == f"dialect-{dialect}"
    now = counted(server)
    booked = now("batchserve_slo_requests_total", model="unknown", tier="free", outcome="refused") - before
    booked += (
        now("batchserve_slo_requests_total", model=DIALECTS[dialect][2], tier="free", outcome="refused") - before_model
    )
    assert booked == 1  # to the model where the route knew it when it refused, else "unknown": once


@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_a_failure_is_a_500_in_the_dialect_and_booked_failed(server: LiveServer, dialect: str) -> None:
    shape, model = DIALECTS[dialect][1], DIALECTS[dialect][2]
    labels = {"model": model, "tier": "enterprise", "outcome": "failed"}
    before = counted(server)("batchserve_slo_requests_total", **labels)
    r = post(server, dialect, f"this input {FAIL}", server.keys["big"])  # type: ignore[attr-defined]
    assert r.status_code == 500, r.text
    shape(r.json(), 500)
    assert r.headers["x-request-id"] == f"dialect-{dialect}"
    assert counted(server)("batchserve_slo_requests_total", **labels) == before + 1
