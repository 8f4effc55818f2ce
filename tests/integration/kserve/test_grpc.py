"""KServe v2 over gRPC (`--grpc-port`, issue 35 item 3) on a live server, driven by Triton's own gRPC client
(`tritonclient.grpc`): health, server and model metadata, BYTES infers on the sim and FP32 vectors of an
embedding model, every element through the same door as the HTTP routes (it shares batches with them and is
counted in /metrics), and refusals as gRPC status codes."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import re
import time
from typing import TYPE_CHECKING

import httpx
import numpy as np
import pytest

from tests.conftest import LiveServer, start_server
from tests.integration.embeddings.test_routes import EMBED_PLUGIN

if TYPE_CHECKING:
    import tritonclient.grpc as triton

GRPC_LINE = re.compile(r"gRPC \(KServe v2\) listening on [\d.]+:(\d+)")


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def grpc_port(server: LiveServer) -> int:
    give_up = time.monotonic() + 10
    while time.monotonic() < give_up:
        for line in server.log_lines:
            m = GRPC_LINE.search(line)
            if m:
                return int(m.group(1))
        time.sleep(0.05)
    raise AssertionError("no gRPC port in the log:\n" + server.log())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("grpc")
    (root / "embedplug.py").write_text(EMBED_PLUGIN)
    config = root / "bs.toml"
    config.write_text(
        '[[models]]\nname = "echo"\nbackend = "sim"\nsim_batch_ms = 50\n\n'
        '[[models]]\nname = "slow"\nbackend = "sim"\nsim_batch_ms = 600\n\n'
        '[[models]]\nname = "embed"\nbackend = "embedplug:Embed"\n\n'
        f'[[keys]]\ntenant = "slow"\ntier = "paid"\nsha256 = "{digest("sk-grpc")}"\nrate = 0.01\n'
        "burst = 4\n\n"
        f'[[keys]]\ntenant = "roomy"\ntier = "paid"\nsha256 = "{digest("sk-roomy")}"\nrate = 1000\n'
    )
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    s = start_server("--config", str(config), "--grpc-port", "0", "--slo-ms", "2000", "--timeout-ms", "10000", env=env)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> triton.InferenceServerClient:
    import tritonclient.grpc as triton

    return triton.InferenceServerClient(f"127.0.0.1:{grpc_port(server)}")


ROOMY = {"authorization": "Bearer sk-roomy"}


def strings(*texts: str) -> triton.InferInput:
    import tritonclient.grpc as triton

    tensor = triton.InferInput("input", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    return tensor


def test_health_and_metadata(client):
    from tritonclient.utils import InferenceServerException

    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "batchserve" and "binary_tensor_data" in meta["extensions"]
    echo = client.get_model_metadata("echo", as_json=True)
    assert echo["name"] == "echo" and echo["versions"] == ["v1"] and echo["platform"] == "batchserve_sim"
    assert echo["inputs"] == [{"name": "input", "datatype": "BYTES", "shape": ["-1"]}]
    assert echo["outputs"] == [{"name": "output", "datatype": "BYTES", "shape": ["-1"]}]
    assert client.get_model_metadata("embed", "v1", as_json=True)["outputs"][0]["datatype"] == "FP32"
    assert client.is_model_ready("echo") and client.is_model_ready("embed", "v1")
    assert not client.is_model_ready("nope")
    with pytest.raises(InferenceServerException, match="unknown model 'echo' version 'v9'") as caught:
        client.get_model_metadata("echo", "v9")
    assert caught.value.status() == "StatusCode.NOT_FOUND"


def test_bytes_on_the_sim_each_caller_its_own_answer(client):
    texts = ("a cat", "hello world", "é ü ✓")
    result = client.infer("echo", [strings(*texts)], request_id="three", headers=ROOMY)
    out = result.as_numpy("output")
    assert out.shape == (3,) and [o.decode() for o in out] == [t[::-1] for t in texts]
    response = result.get_response()
    assert response.model_name == "echo" and response.model_version == "v1" and response.id == "three"


def test_fp32_vectors_of_an_embedding_model(client):
    result = client.infer("embed", [strings("a cat", "a kitten sat")], headers=ROOMY)
    vectors = result.as_numpy("output")
    assert vectors.dtype == np.float32 and vectors.shape == (2, 4)
    assert vectors[:, 0].tolist() == [5.0, 12.0] and vectors[:, 2:].tolist() == [[0.5, -1.25]] * 2


def test_grpc_and_http_callers_share_batches(server, client):
    """Inputs of gRPC and HTTP callers that wait together ride one sim batch: the door is one. A first request
    holds the model's only worker (600 ms batches) while the eight others queue behind it."""
    with (
        httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": "Bearer sk-roomy"}) as http,
        concurrent.futures.ThreadPoolExecutor(9) as pool,
    ):
        blocker = pool.submit(http.post, "/v1/inference", json={"input": "first", "model": "slow"})
        time.sleep(0.2)
        grpc_calls = [pool.submit(client.infer, "slow", [strings(f"grpc {i}")], headers=ROOMY) for i in range(4)]
        http_calls = [
            pool.submit(http.post, "/v1/inference", json={"input": f"http {i}", "model": "slow"}) for i in range(4)
        ]
        sizes = [c.result().json()["batch_size"] for c in http_calls]
        outs = [c.result().as_numpy("output")[0].decode() for c in grpc_calls]
        assert blocker.result().status_code == 200
    assert outs == [f"grpc {i}"[::-1] for i in range(4)]
    assert max(sizes) > 4, f"no batch held both gRPC and HTTP inputs: batch sizes {sizes}"


def test_refusals_are_grpc_status_codes(server, client):
    import tritonclient.grpc as triton
    from tritonclient.utils import InferenceServerException

    def status(call) -> str:
        with pytest.raises(InferenceServerException) as caught:
            call()
        return caught.value.status()

    assert status(lambda: client.infer("nope", [strings("x")], headers=ROOMY)) == "StatusCode.NOT_FOUND"
    wrong = triton.InferInput("input", [1], "FP32")
    wrong.set_data_from_numpy(np.array([1.0], dtype=np.float32))
    assert status(lambda: client.infer("echo", [wrong], headers=ROOMY)) == "StatusCode.INVALID_ARGUMENT"
    assert status(lambda: client.infer("echo", [strings("")], headers=ROOMY)) == "StatusCode.INVALID_ARGUMENT"
    bad_key = {"authorization": "Bearer sk-wrong"}
    assert status(lambda: client.infer("echo", [strings("x")], headers=bad_key)) == "StatusCode.UNAUTHENTICATED"
    # sk-grpc's bucket holds 4 tokens: a 5-element tensor after it is spent is over its rate
    limited = {"authorization": "Bearer sk-grpc"}
    client.infer("echo", [strings("a", "b", "c", "d")], headers=limited)
    assert status(lambda: client.infer("echo", [strings("e")], headers=limited)) == "StatusCode.RESOURCE_EXHAUSTED"
    metrics = httpx.get(server.url + "/metrics").text
    assert re.search(r'batchserve_requests_total\{model="echo@v1",status="200"\} [1-9]', metrics)


@pytest.mark.slow
@pytest.mark.parallel  # answers only, no timing: CI runs it in the parallel workers
def test_minilm_over_grpc_equals_its_http_vectors():
    import tritonclient.grpc as triton

    s = start_server("--backend", "minilm", "--grpc-port", "0", timeout=300)
    try:
        client = triton.InferenceServerClient(f"127.0.0.1:{grpc_port(s)}")
        assert client.is_server_live() and client.is_model_ready("minilm")
        assert client.get_model_metadata("minilm", as_json=True)["outputs"][0]["datatype"] == "FP32"
        texts = ["A man is playing a guitar.", "Paris is the capital of France."]
        vectors = client.infer("minilm", [strings(*texts)], client_timeout=120).as_numpy("output")
        assert vectors.shape == (2, 384)
        r = httpx.post(s.url + "/v1/embeddings", json={"input": texts, "model": "minilm"}, timeout=120)
        assert r.status_code == 200, r.text
        expected = np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)
        np.testing.assert_allclose(vectors, expected, atol=1e-6)
    finally:
        s.stop()
