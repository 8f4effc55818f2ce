"""A request's own priority (`Work.ask`): `priority` on the native and v2 routes (HTTP and gRPC), OpenAI's
`service_tier` on the OpenAI routes, within what the caller's key allows, on a live server. A key may ask for less
than its tier (flex: the batch tier) and, up to its `best_tier`, for more; above that it is capped and told so
(`x-service-tier`), and the ledger books each answer under the tier it ran at."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from batchserve.core.tiers import NAMES
from tests.conftest import LiveServer, start_server
from tests.integration.inference.test_routes import metric
from tests.integration.embeddings.test_routes import EMBED_PLUGIN
from tests.integration.kserve.test_grpc import grpc_port

LIFTED, CAPPED = "sk-lifted", "sk-capped"  # both paid; only the first may ask up to enterprise


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("priority")
    (root / "embedplug.py").write_text(EMBED_PLUGIN)
    config = root / "bs.toml"
    config.write_text(
        '[[models]]\nname = "echo"\nbackend = "sim"\nsim_batch_ms = 5\n\n'
        '[[models]]\nname = "embed"\nbackend = "embedplug:Embed"\n\n'
        f'[[keys]]\ntenant = "lifted"\ntier = "paid"\nbest_tier = "enterprise"\nsha256 = "{digest(LIFTED)}"\n\n'
        f'[[keys]]\ntenant = "capped"\ntier = "paid"\nsha256 = "{digest(CAPPED)}"\n'
    )
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    s = start_server("--config", str(config), "--grpc-port", "0", env=env)
    yield s
    s.stop()


def booked(server: LiveServer) -> dict[str, float]:
    """Inputs the ledger booked as served for the echo model, by tier."""
    text = httpx.get(server.url + "/metrics").text
    return {tier: metric(text, "batchserve_inputs_served_total", model="echo@v1", tier=tier) or 0.0 for tier in NAMES}


@pytest.mark.parametrize(
    ("key", "asked", "ran"),
    [
        (LIFTED, "priority", "enterprise"),
        (LIFTED, "enterprise", "enterprise"),
        (CAPPED, "priority", "paid"),  # its key allows no more than its tier: capped, and the header says so
        (CAPPED, "enterprise", "paid"),
        (CAPPED, "free", "free"),
        (LIFTED, "flex", "batch"),
        (CAPPED, "default", "paid"),
    ],
)
def test_native_priority_runs_within_the_key_and_says_where(server: LiveServer, key, asked, ran) -> None:
    r = httpx.post(
        server.url + "/v1/inference",
        json={"input": "abc", "model": "echo", "priority": asked},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert r.status_code == 200 and r.json()["output"] == "cba", r.text
    assert r.headers["x-service-tier"] == ran


def test_no_priority_asked_no_header_and_a_bad_one_is_a_400(server: LiveServer) -> None:
    auth = {"Authorization": f"Bearer {CAPPED}"}
    r = httpx.post(server.url + "/v1/inference", json={"input": "abc", "model": "echo"}, headers=auth)
    assert r.status_code == 200 and "x-service-tier" not in r.headers
    r = httpx.post(
        server.url + "/v1/inference", json={"input": "abc", "model": "echo", "priority": "urgent"}, headers=auth
    )
    assert r.status_code == 400 and "priority" in r.json()["message"], r.text


def test_openai_service_tier_through_the_official_client(server: LiveServer) -> None:
    for key, ran in ((LIFTED, "enterprise"), (CAPPED, "paid")):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
        raw = client.embeddings.with_raw_response.create(
            model="embed", input=["a cat", "a dog"], extra_body={"service_tier": "priority"}
        )
        assert len(raw.parse().data) == 2 and raw.headers["x-service-tier"] == ran
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key=CAPPED, max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        bad.embeddings.create(model="embed", input="x", extra_body={"service_tier": "scale"})
    assert refused.value.body["param"] == "service_tier"


def test_v2_priority_over_http_and_grpc_books_the_tier_it_ran_at(server: LiveServer) -> None:
    import tritonclient.grpc as triton

    before = booked(server)
    body = {
        "inputs": [{"name": "input", "shape": [1], "datatype": "BYTES", "data": ["abc"]}],
        "parameters": {"priority": "priority"},
    }
    r = httpx.post(server.url + "/v2/models/echo/infer", json=body, headers={"Authorization": f"Bearer {LIFTED}"})
    assert r.status_code == 200 and r.headers["x-service-tier"] == "enterprise", r.text
    tensor = triton.InferInput("input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([b"abc"], dtype=object))
    client = triton.InferenceServerClient(f"127.0.0.1:{grpc_port(server)}")
    # Triton's own priority levels (its client reserves the name): 4, a tier below free, is the batch tier
    result = client.infer("echo", [tensor], headers={"authorization": f"Bearer {LIFTED}"}, priority=4)
    assert result.as_numpy("output")[0] == b"cba"
    after = booked(server)
    assert {t: after[t] - before[t] for t in NAMES} == {"enterprise": 1, "paid": 0, "free": 0, "batch": 1}


@pytest.mark.parametrize(("slo_ms", "first"), [(2000, "priority"), (200, "waited")])
def test_a_head_start_counts_in_the_models_slo(tmp_path, slo_ms: int, first: str) -> None:
    """One device of 2.5 s batches of one input. While a first request runs, a default request arrives, then
    0.6 s later one asking priority; both wait for the device. The queue takes the head with the smallest
    `arrived + head start`: at a 2 s SLO a `paid` input yields to a higher tier for a whole SLO (0.6 < 2), so the
    priority request goes first; at 200 ms its head start is 0.2 s (0.6 > 0.2), so the default one goes first. (A
    fixed 0.1 s, as before, would put the default one first at any SLO.) Each request is sent only once the server
    counts the one before it in flight, so a slow machine cannot reorder arrivals; the 0.6 s gap may stretch by
    up to 1.4 s (or shrink by 0.4 s) and the verdict holds. The wide admission slack keeps the door from refusing
    the short backlog."""
    config = tmp_path / "bs.toml"
    config.write_text(
        f'[[keys]]\ntenant = "lifted"\ntier = "paid"\nbest_tier = "enterprise"\nsha256 = "{digest(LIFTED)}"\n'
    )
    s = start_server(
        "--config", str(config), "--devices", "1", "--max-batch-size", "1", "--sim-batch-ms", "2500",
        "--slo-ms", str(slo_ms), "--timeout-ms", "20000", "--admission-slack", "100",
    )  # fmt: skip
    done: list[str] = []

    def send(name: str, body: dict) -> None:
        r = httpx.post(s.url + "/v1/inference", json=body, headers={"Authorization": f"Bearer {LIFTED}"}, timeout=30)
        assert r.status_code == 200, r.text
        done.append(name)

    def in_flight(n: int) -> float:
        """Waits until the server counts `n` requests admitted and unanswered; returns when it saw them."""
        until = time.monotonic() + 10
        while metric(httpx.get(s.url + "/metrics").text, "batchserve_inflight_requests") != n:
            assert time.monotonic() < until, f"the server never counted {n} requests in flight"
            time.sleep(0.01)
        return time.monotonic()

    threads: list[threading.Thread] = []
    try:
        for n, (name, body, gap) in enumerate(
            (
                ("running", {"input": "a"}, 0.0),
                ("waited", {"input": "b"}, 0.0),
                ("priority", {"input": "c", "priority": "priority"}, 0.6),
            ),
            start=1,
        ):
            time.sleep(gap)
            threads.append(threading.Thread(target=send, args=(name, body)))
            threads[-1].start()
            in_flight(n)
        assert not done, f"{done} ended before all three were in flight: the batch is too short for this machine"
        for t in threads:
            t.join(30)
    finally:
        s.stop()
    assert done == ["running", first, "waited" if first == "priority" else "priority"], done
