"""`POST /v1/embeddings` (issue 11) on a live server, with a small embedding plugin (exact float32 values, no
model to load): OpenAI's shapes through the official `openai` client in float and base64, each input riding the
batcher on its own, usage from the backend's token counts, keys and a list of N inputs costing N rate-limit
tokens, errors in OpenAI's shape, and the published schemas. The real model is in
tests/integration/backends/test_minilm.py."""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import struct
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import httpx

import pytest

from tests.conftest import LiveServer, hang_up_behind_a_busy_worker, start_server
from tests.integration.inference.test_routes import metric
from tests.integration.http.test_openapi import response_schema, validate
from tests.integration.http.test_tenancy import add_key

if TYPE_CHECKING:
    import openai

EMBED_PLUGIN = '''
import time


class Embed:
    """[characters, inputs in this batch, 0.5, -1.25]: exact in float32, and says how inputs were batched."""

    output_kind = "embedding"
    max_batch_size = 8

    def batch(self, inputs):
        time.sleep(0.02)
        return [[float(len(text)), float(len(inputs)), 0.5, -1.25] for text in inputs]

    def count_tokens(self, texts):
        return [len(text.split()) for text in texts]
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("embed")
    (root / "embedplug.py").write_text(EMBED_PLUGIN)
    config = root / "bs.toml"
    config.write_text(
        '[[models]]\nname = "embed"\nbackend = "embedplug:Embed"\n\n'
        '[[models]]\nname = "echo"\nbackend = "sim"\nsim_batch_ms = 5\n'
    )
    key = add_key(config, "big", "enterprise", "--rate", "10000")
    small = add_key(config, "small", "free", "--rate", "0.01")
    with config.open("a") as fh:
        fh.write("burst = 10\n")  # the last [[keys]] table: the small key holds 10 tokens at most
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    s = start_server("--config", str(config), "--slo-ms", "2000", "--timeout-ms", "10000", env=env)
    s.key, s.small_key = key, small  # type: ignore[attr-defined]
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.key, max_retries=0, timeout=30)


def vector(text: str, batch: float) -> list[float]:
    return [float(len(text)), batch, 0.5, -1.25]


def values(embedding: list[float] | str) -> list[float]:
    """The vector, from a list of floats or (asked for explicitly, the client hands it on as it came) base64."""
    if isinstance(embedding, str):
        raw = base64.b64decode(embedding)
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    return embedding


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_openai_client_one_input_and_a_list(client: openai.OpenAI, encoding: str):
    one = client.embeddings.create(input="hello there", model="embed", encoding_format=encoding)
    assert one.object == "list" and one.model == "embed@v1" and len(one.data) == 1
    assert one.data[0].index == 0 and values(one.data[0].embedding) == vector("hello there", 1.0)
    assert one.usage.prompt_tokens == one.usage.total_tokens == 2
    texts = ["a", "bb bb", "ccc ccc ccc", "dddd"]
    many = client.embeddings.create(input=texts, model="embed", encoding_format=encoding)
    assert [d.index for d in many.data] == [0, 1, 2, 3]
    assert [values(d.embedding)[0] for d in many.data] == [1.0, 5.0, 11.0, 4.0]  # in input order
    assert many.usage.prompt_tokens == 1 + 2 + 3 + 1


def test_base64_is_little_endian_float32_and_the_clients_default_decodes(server: LiveServer):
    import openai

    r = httpx.post(
        server.url + "/v1/embeddings",
        json={"input": "xyz", "model": "embed", "encoding_format": "base64"},
        headers={"Authorization": f"Bearer {server.key}"},
    )
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    assert raw == struct.pack("<4f", 3.0, 1.0, 0.5, -1.25)
    default = openai.OpenAI(base_url=server.url + "/v1", api_key=server.key, max_retries=0)
    assert default.embeddings.create(input="xyz", model="embed").data[0].embedding == [3.0, 1.0, 0.5, -1.25]


async def _post(session: aiohttp.ClientSession, url: str, key: str, body: dict) -> tuple[int, dict]:
    async with session.post(url + "/v1/embeddings", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, await r.json()


def test_each_input_rides_the_batcher_and_concurrent_callers_share_batches(server: LiveServer):
    async def scenario() -> tuple[list, tuple]:
        async with aiohttp.ClientSession() as session:
            singles = [
                _post(session, server.url, server.key, {"input": f"single {i}", "model": "embed"}) for i in range(24)
            ]
            listed = _post(
                session, server.url, server.key, {"input": [f"listed {i}" for i in range(30)], "model": "embed"}
            )
            *answers, whole = await asyncio.gather(*singles, listed)
            return answers, whole

    singles, (status, listed) = asyncio.run(scenario())
    assert all(s == 200 for s, _ in singles)
    sizes = [body["data"][0]["embedding"][1] for _, body in singles]
    assert max(sizes) > 1  # separate callers' inputs shared batches
    assert status == 200 and len(listed["data"]) == 30
    # 30 inputs of one request became 30 items: batches of the plugin's limit 8 at most, all answered in order.
    assert all(1 <= d["embedding"][1] <= 8 for d in listed["data"])
    assert [d["embedding"][0] for d in listed["data"]] == [float(len(f"listed {i}")) for i in range(30)]


def test_a_list_of_n_inputs_costs_n_rate_limit_tokens(server: LiveServer):
    def post(n: int) -> httpx.Response:
        return httpx.post(
            server.url + "/v1/embeddings",
            json={"input": ["t"] * n, "model": "embed"},
            headers={"Authorization": f"Bearer {server.small_key}"},
            timeout=30,
        )

    first = post(7)
    assert first.status_code == 200 and first.headers["x-ratelimit-remaining"] == "3"
    refused = post(7)  # 3 tokens left: 7 inputs do not fit
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
    assert int(refused.headers["retry-after"]) >= 1
    too_many = post(11)  # more than the key's whole burst: never fits
    assert too_many.status_code == 429 and "burst of 10" in too_many.json()["error"]["message"]
    assert post(3).status_code == 200  # the refusals took nothing
    # The bucket is empty now: the next request is refused from its head alone, before its body is read (the
    # client announces 100 kB and never sends them; a server that waited for the body would not answer).
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer %s\r\nContent-Length: 100000\r\n\r\n" % server.small_key.encode()
        )
        head = sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 429"), head[:200]
    assert b"rate_limit_error" in head and b"x-request-id:" in head.lower()


@pytest.mark.parametrize(
    "body,status,param,code",
    [
        ({"input": "x", "model": "embed", "dimensions": 5}, 400, "dimensions", "invalid_value"),
        ({"input": "x", "model": "embed", "dimensions": 0}, 400, "dimensions", "invalid_value"),
        ({"input": "x", "model": "embed", "dimensions": 2.5}, 400, "dimensions", "invalid_value"),
        ({"input": [1, 2, 3], "model": "embed"}, 400, "input", "unsupported_value"),
        ({"input": [[1, 2], [3]], "model": "embed"}, 400, "input", "unsupported_value"),
        ({"input": ["x"] * 2049, "model": "embed"}, 400, "input", "invalid_value"),
        ({"input": [], "model": "embed"}, 400, "input", "invalid_value"),
        ({"input": ["ok", ""], "model": "embed"}, 400, "input", "invalid_value"),
        ({"input": "x", "model": "embed", "encoding_format": "int8"}, 400, "encoding_format", "invalid_value"),
        ({"input": "x", "model": "echo"}, 400, "model", "model_not_embedding"),
        ({"input": "x", "model": "nope"}, 404, "model", "model_not_found"),
        ({"model": "embed"}, 400, "input", "invalid_value"),
    ],
)
def test_bad_requests_answer_in_openai_shape(server: LiveServer, body: dict, status: int, param: str, code: str):
    r = httpx.post(server.url + "/v1/embeddings", json=body, headers={"Authorization": f"Bearer {server.key}"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code) and error["message"]


def test_keys_are_required_and_errors_keep_the_shape(server: LiveServer, client: openai.OpenAI):
    import openai

    r = httpx.post(server.url + "/v1/embeddings", json={"input": "x"}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(
        server.url + "/v1/embeddings", content=b"{not json", headers={"Authorization": f"Bearer {server.key}"}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(input="x", model="embed", dimensions=5)  # over the plugin's 4
    # without "model": the first model that serves embeddings
    r = httpx.post(
        server.url + "/v1/embeddings",
        json={"input": "abc", "encoding_format": "float"},
        headers={"Authorization": f"Bearer {server.key}"},
    )
    assert r.status_code == 200 and r.json()["model"] == "embed@v1"


def test_dimensions_truncates_and_normalises_again(server: LiveServer, client: openai.OpenAI):
    """OpenAI's `dimensions`: the first N components of the plugin's [chars, n, 0.5, -1.25], L2-normalised."""
    r = httpx.post(
        server.url + "/v1/embeddings",
        json={"input": ["four", "sixsix"], "model": "embed", "dimensions": 3},
        headers={"Authorization": f"Bearer {server.key}"},
    )
    assert r.status_code == 200, r.text
    for item, chars in zip(r.json()["data"], (4.0, 6.0)):
        got = item["embedding"]
        assert len(got) == 3 and abs(sum(x * x for x in got) - 1.0) < 1e-9
        assert abs(got[0] / got[2] - chars / 0.5) < 1e-9  # the same direction as the first three components
    got = client.embeddings.create(input="four", model="embed", dimensions=2, encoding_format="base64")
    vector = struct.unpack("<2f", base64.b64decode(got.data[0].embedding))  # asked for base64: left encoded
    assert abs(vector[0] ** 2 + vector[1] ** 2 - 1.0) < 1e-6


def test_inference_route_returns_the_vector_as_output(server: LiveServer):
    r = httpx.post(
        server.url + "/v1/inference",
        json={"input": "four", "model": "embed"},
        headers={"Authorization": f"Bearer {server.key}"},
    )
    assert r.status_code == 200 and r.json()["output"] == vector("four", 1.0)
    models = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {server.key}"}).json()["data"]
    assert {m["id"]: m["output_kind"] for m in models} == {"embed@v1": "embedding", "echo@v1": "text"}


def test_live_answers_match_the_published_schemas(server: LiveServer):
    doc: dict[str, Any] = httpx.get(server.url + "/openapi.json").json()
    auth = {"Authorization": f"Bearer {server.key}"}
    for fmt in ("float", "base64"):
        r = httpx.post(server.url + "/v1/embeddings", json={"input": ["a", "b"], "encoding_format": fmt}, headers=auth)
        validate(doc, response_schema(doc, "/v1/embeddings", "post", 200), r.json())
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "a", "dimensions": 30}, headers=auth)
    validate(doc, response_schema(doc, "/v1/embeddings", "post", 400), r.json())
    validate(doc, {"$ref": "#/components/schemas/EmbeddingRequest"}, {"input": ["a"], "model": "embed"})


HANG_PLUGIN = '''
import time


class Embed:
    """Two numbers per input; an input "HANG" holds the worker 0.8 s."""

    output_kind = "embedding"
    max_batch_size = 8

    def batch(self, inputs):
        time.sleep(0.8 if "HANG" in inputs else 0.005)
        return [[float(len(text)), 1.0] for text in inputs]
'''


def test_an_embeddings_caller_who_hangs_up_never_takes_a_place_in_a_batch(tmp_path, server_factory) -> None:
    """The route hands the door uvicorn's disconnect flag (it passed the Request itself, so the probe was always
    None and a queued input whose caller had left still ran)."""
    (tmp_path / "hangplug.py").write_text(HANG_PLUGIN)
    config = tmp_path / "bs.toml"
    config.write_text('[[models]]\nname = "embed"\nbackend = "hangplug:Embed"\n')
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    server = server_factory(
        "--config", str(config), "--devices", "1", "--slo-ms", "2000", "--timeout-ms", "10000", env=env
    )

    assert (
        hang_up_behind_a_busy_worker(
            server.url,
            "/v1/embeddings",
            {"model": "embed", "input": "HANG"},
            b'{"model": "embed", "input": "gone"}',
            "gone-e",
        )
        == 200
    )
    time.sleep(0.3)
    with httpx.Client(base_url=server.url, timeout=10) as c:
        record = c.get("/v1/requests/gone-e").json()
        text = c.get("/metrics").text
    assert record.get("status") == "failed" and record.get("error") == "CLIENT_DISCONNECTED", record
    assert metric(text, "batchserve_batch_size_sum", model="embed@v1") == 1  # only HANG's batch ran after warm-up
