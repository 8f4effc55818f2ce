"""KServe Open Inference Protocol v2 (issue 26 item 2) on a live server, driven by Triton's own client
(`tritonclient[http]`): health, server and model metadata, a 3-input infer on the sim (binary and JSON tensors),
FP32 outputs of an embedding model, each element riding the batcher as its own item (sharing batches with other
callers), and refusals in v2's `{"error": ...}` shape."""

from __future__ import annotations

import concurrent.futures
import os
import struct
from typing import TYPE_CHECKING

import httpx
import numpy as np
import pytest

from tests.conftest import LiveServer, start_server
from tests.integration.embeddings.test_routes import EMBED_PLUGIN
from tests.integration.http.test_openapi import validate

if TYPE_CHECKING:
    import tritonclient.http as triton


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("kserve")
    (root / "embedplug.py").write_text(EMBED_PLUGIN)
    config = root / "bs.toml"
    config.write_text(
        '[[models]]\nname = "echo"\nbackend = "sim"\nsim_batch_ms = 5\n\n'
        '[[models]]\nname = "embed"\nbackend = "embedplug:Embed"\n'
    )
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    s = start_server(
        "--config", str(config), "--slo-ms", "2000", "--timeout-ms", "10000", "--max-body-bytes", "65536", env=env
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> triton.InferenceServerClient:
    import tritonclient.http as triton

    return triton.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=30)


def strings(*texts: str, binary: bool = True) -> triton.InferInput:
    import tritonclient.http as triton

    tensor = triton.InferInput("input", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array(texts, dtype=object), binary_data=binary)
    return tensor


def test_health_and_metadata(client):
    from tritonclient.utils import InferenceServerException

    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "batchserve" and "binary_tensor_data" in meta["extensions"]
    echo = client.get_model_metadata("echo")
    assert echo["name"] == "echo" and echo["versions"] == ["v1"]
    assert echo["inputs"] == [{"name": "input", "datatype": "BYTES", "shape": [-1]}]
    assert echo["outputs"] == [{"name": "output", "datatype": "BYTES", "shape": [-1]}]
    assert client.get_model_metadata("echo", "v1") == echo
    assert client.get_model_metadata("embed")["outputs"][0]["datatype"] == "FP32"
    assert client.is_model_ready("echo") and client.is_model_ready("embed", "v1")
    assert not client.is_model_ready("nope")
    with pytest.raises(InferenceServerException, match="unknown model 'echo' version 'v9'"):
        client.get_model_metadata("echo", "v9")


@pytest.mark.parametrize("binary", [True, False])
def test_three_inputs_on_the_sim(client, binary):
    import tritonclient.http as triton

    texts = ("a cat", "hello world", "é ü ✓")
    result = client.infer(
        "echo",
        [strings(*texts, binary=binary)],
        request_id="three",
        outputs=[triton.InferRequestedOutput("output", binary_data=binary)],
    )
    out = result.as_numpy("output")
    assert out.shape == (3,)
    got = [o.decode() if isinstance(o, bytes) else o for o in out]
    assert got == [t[::-1] for t in texts]  # the sim's answer: each input reversed, in input order
    response = result.get_response()
    assert response["model_name"] == "echo" and response["model_version"] == "v1" and response["id"] == "three"


def test_nested_json_tensor_keeps_its_shape(server):
    body = {"inputs": [{"name": "input", "datatype": "BYTES", "shape": [2, 2], "data": [["ab", "cd"], ["ef", "gh"]]}]}
    r = httpx.post(server.url + "/v2/models/echo/versions/v1/infer", json=body)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["shape"] == [2, 2] and out["data"] == ["ba", "dc", "fe", "hg"]


def test_embedding_model_answers_fp32_and_elements_share_a_batch(client):
    """The plugin's vector is [characters, inputs in its batch, 0.5, -1.25]: one 3-element request is three
    items that ride one batch together."""
    result = client.infer("embed", [strings("x", "yy", "zzz")])
    vectors = result.as_numpy("output")
    assert vectors.dtype == np.float32 and vectors.shape == (3, 4)
    assert vectors[:, 0].tolist() == [1.0, 2.0, 3.0]
    assert vectors[:, 1].tolist() == [3.0, 3.0, 3.0]
    assert vectors[:, 2:].tolist() == [[0.5, -1.25]] * 3


def test_concurrent_v2_callers_share_batches(server):
    """Sixteen one-element requests at once, each on its own connection: they are batched together (the
    plugin holds 8 a batch and takes 20 ms, so 16 lone requests would each report a batch of 1)."""
    import tritonclient.http as triton

    def one(i: int) -> float:
        c = triton.InferenceServerClient(server.url.removeprefix("http://"))
        try:
            return float(c.infer("embed", [strings(f"caller {i}")]).as_numpy("output")[0][1])
        finally:
            c.close()

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        sizes = list(pool.map(one, range(16)))
    assert max(sizes) > 1, sizes


@pytest.mark.parametrize(
    "body,status,words",
    [
        (b"not json", 400, "not valid JSON"),
        (b'{"inputs": []}', 400, "exactly one tensor"),
        (b'{"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["x"]}]}', 400, "unknown input"),
        (b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1], "data": [1.0]}]}', 400, "datatype BYTES"),
        (b'{"inputs": [{"name": "input", "datatype": "BYTES", "shape": [2], "data": ["x"]}]}', 400, "must hold 2"),
        (b'{"inputs": [{"name": "input", "datatype": "BYTES", "shape": [1], "data": [""]}]}', 400, "non-empty"),
        (b'{"inputs": [{"name": "input", "datatype": "BYTES", "shape": [0], "data": []}]}', 400, "1 to 2048"),
        (
            b'{"inputs": [{"name": "input", "datatype": "BYTES", "shape": [1], "data": ["x"]}],'
            b' "outputs": [{"name": "logits"}]}',
            400,
            "unknown output",
        ),
        (
            b'{"inputs": [{"name": "input", "datatype": "BYTES", "shape": [1], "data": ["x"]}],'
            b' "parameters": {"timeout": -5}}',
            400,
            "microseconds",
        ),
        (
            b'{"inputs": [{"name": "input", "datatype": "BYTES", "shape": [1], "data": ["' + b"x" * 70000 + b'"]}]}',
            413,
            "limit",
        ),
        # ragged: four strings, but not nested as a [2, 2] tensor (it was accepted)
        (
            b'{"inputs": [{"name": "input", "datatype": "BYTES", "shape": [2, 2], "data": [["a"], ["b", "c", "d"]]}]}',
            400,
            "nested unlike its shape [2, 2]",
        ),
        (
            b'{"inputs": [{"name": "input", "datatype": "BYTES", "shape": [2, 2], "data": [["a", "b"], "c", "d"]}]}',
            400,
            "nested unlike its shape",
        ),
        (
            b'{"inputs": [{"name": "input", "datatype": "BYTES", "shape": [2], "data": [["a"], ["b"]]}]}',
            400,
            "nested deeper than its shape [2]",
        ),
    ],
)
def test_bad_requests_get_v2_errors(server, body, status, words):
    r = httpx.post(server.url + "/v2/models/echo/infer", content=body)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and words in r.json()["error"]
    assert r.headers["x-request-id"]


def test_binary_body_that_lies_about_its_size(server):
    tail = struct.pack("<I", 100) + b"abc"  # the length prefix says 100 bytes, 3 follow
    for declared, words in ((9, "binary_data_size"), (len(tail), "ends inside an element")):
        head = (
            b'{"inputs": [{"name": "input", "datatype": "BYTES", "shape": [1], '
            b'"parameters": {"binary_data_size": %d}}]}' % declared
        )
        r = httpx.post(
            server.url + "/v2/models/echo/infer",
            content=head + tail,
            headers={"Inference-Header-Content-Length": str(len(head))},
        )
        assert r.status_code == 400 and words in r.json()["error"], r.text
    r = httpx.post(
        server.url + "/v2/models/echo/infer", content=b"{}", headers={"Inference-Header-Content-Length": "99"}
    )
    assert r.status_code == 400 and "Inference-Header-Content-Length" in r.json()["error"]
    # 4,301 digits: past Python's int-from-string limit, which raised a ValueError (a 500)
    r = httpx.post(
        server.url + "/v2/models/echo/infer", content=b"{}", headers={"Inference-Header-Content-Length": "9" * 4301}
    )
    assert r.status_code == 400 and "Inference-Header-Content-Length" in r.json()["error"], r.text


def test_unknown_model_and_the_server_still_serves(server, client):
    r = httpx.post(
        server.url + "/v2/models/nope/infer",
        json={"inputs": [{"name": "input", "datatype": "BYTES", "shape": [1], "data": ["x"]}]},
    )
    assert r.status_code == 404 and set(r.json()) == {"error"}
    assert client.infer("echo", [strings("still")]).as_numpy("output")[0] == b"llits"


def test_answers_match_the_published_schemas(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    with httpx.Client(base_url=server.url) as c:
        for path, schema in (
            ("/v2", "V2ServerMetadata"),
            ("/v2/models/echo", "V2ModelMetadata"),
            ("/v2/health/ready", "V2Ready"),
            ("/v2/health/live", "V2Live"),
            ("/v2/models/embed/ready", "V2Ready"),
        ):
            r = c.get(path)
            assert r.status_code == 200, path
            validate(doc, {"$ref": f"#/components/schemas/{schema}"}, r.json())
        r = c.post(
            "/v2/models/embed/infer",
            json={"inputs": [{"name": "input", "datatype": "BYTES", "shape": [1], "data": ["x"]}]},
        )
        validate(doc, {"$ref": "#/components/schemas/V2InferResponse"}, r.json())
        assert r.json()["outputs"][0]["data"] == [1.0, 1.0, 0.5, -1.25]
        validate(doc, {"$ref": "#/components/schemas/V2Error"}, c.get("/v2/models/nope").json())


def test_infer_paths_of_another_shape_are_not_v2_infers(server):
    from batchserve.kserve.routes import infer_path_params

    assert infer_path_params("/v2/models/sim/infer") == {"model": "sim"}
    assert infer_path_params("/v2/models/sim/versions/v1/infer") == {"model": "sim", "version": "v1"}
    for path in ("/v2/models//infer", "/v2/models/a/b/infer", "/v2/models/a/versions//infer", "/v2/models/infer"):
        assert infer_path_params(path) is None, path
        r = httpx.post(server.url + path, json={})
        # the router's answer in the main error shape (404, or 405 where a GET route has that shape), not an infer
        assert r.status_code in (404, 405) and r.json()["error"] in ("NOT_FOUND", "METHOD_NOT_ALLOWED"), path
    assert httpx.get(server.url + "/v2/models/echo/infer").status_code == 405
