"""Cohere's own Python clients against a live server: `cohere.ClientV2.rerank` (`POST /v2/rerank`, Cohere's v2
shape) and `cohere.Client.rerank` (`POST /v1/rerank`, v1) rank the documents by a rerank plugin's scores, cut at
top_n, and the v2 answer carries its tokens in Cohere's `meta`. The plugin scores a pair by its length, so the
expected order is known without a model."""

from __future__ import annotations

import os
from pathlib import Path

import cohere
import httpx
import pytest

from batchserve.backends.hf import pair_input
from tests.conftest import LiveServer, start_server

PLUGIN = '''
class Rerank:
    """A score per (query, document) pair: the shorter the pair, the higher."""

    output_kind = "json"
    max_batch_size = 8

    def batch(self, inputs):
        return [1.0 / (1 + len(text)) for text in inputs]
'''

QUERY = "capital of france"
DOCUMENTS = ["paris is the capital of france", "a cat", "the sea is blue today", "france"]


def expected(top_n: int) -> list[tuple[int, float]]:
    """What the plugin scores each document, best first: the server's answer must equal it."""
    scores = [1.0 / (1 + len(pair_input(QUERY, d))) for d in DOCUMENTS]
    return sorted(enumerate(scores), key=lambda x: -x[1])[:top_n]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("plugin")
    (folder / "coherereplug.py").write_text(PLUGIN)
    config = folder / "bs.toml"
    config.write_text('[[models]]\nname = "rr"\nbackend = "coherereplug:Rerank"\ntask = "reranking"\n')
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}
    s = start_server("--config", str(config), "--jobs-db", str(Path(folder) / "jobs.db"), env=env)
    yield s
    s.stop()


def test_cohere_client_v2_reranks(server: LiveServer) -> None:
    co = cohere.ClientV2(base_url=server.url, api_key="any")
    r = co.rerank(model="rr", query=QUERY, documents=DOCUMENTS, top_n=3, max_tokens_per_doc=512)
    assert [(x.index, x.relevance_score) for x in r.results] == expected(3)
    assert r.id and r.meta is not None and r.meta.tokens is not None and r.meta.api_version is not None
    assert r.meta.api_version.version == "2"


def test_cohere_client_v1_reranks_with_documents(server: LiveServer) -> None:
    co = cohere.Client(base_url=server.url, api_key="any")
    r = co.rerank(model="rr", query=QUERY, documents=DOCUMENTS, top_n=2, return_documents=True)
    assert [(x.index, x.relevance_score) for x in r.results] == expected(2)
    assert [x.document.text for x in r.results if x.document] == [DOCUMENTS[i] for i, _ in expected(2)]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"model": "rr", "query": "q", "documents": [{"text": "a"}]}, "documents"),  # v2 takes strings only
        ({"model": "rr", "query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
        ({"model": "nope", "query": "q", "documents": ["a"]}, "model"),
    ],
)
def test_v2_refuses_bad_bodies_in_openai_shape(server: LiveServer, body: dict, param: str) -> None:
    r = httpx.post(server.url + "/v2/rerank", json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_the_openapi_document_declares_v2_rerank(server: LiveServer) -> None:
    doc = httpx.get(server.url + "/openapi.json").json()
    assert "/v2/rerank" in doc["paths"]
    assert "V2RerankResponse" in doc["components"]["schemas"]
