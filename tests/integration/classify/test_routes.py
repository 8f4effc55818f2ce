"""`POST /v1/classify` (vLLM's shape) and `POST /predict` (TEI's) on sequence-classification folders the test
builds (random weights, `tests/hf_folders.classifier`), over real HTTP, against transformers' own
`pipeline("text-classification", top_k=None)` on the same folders: the labels and scores of a softmax folder (three
labels) and of a multi-label one (sigmoid, four labels), texts and pairs, the logits with raw_scores; the inputs
priced by tokens on the ledger like embeddings; bad bodies refused in OpenAI's shape; a cross-encoder folder
still a reranker, refused here."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from tests import hf_folders
from tests.conftest import LiveServer, start_server

TEXTS = [
    "hello world",
    "the cat is on the road",
    "what is the capital of france",
    "a big red car " * 30,
    "Quick brown fox, jumping!",
    '["looks", "like a pair"]',  # a text that spells a JSON pair is still one text
]
PAIRS = [("what is the capital of france", "paris is the capital of france"), ("the cat", "eats fish")]
MULTI_LABELS = ("sports", "music", "food", "travel")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("clf")
    return {
        "clf": hf_folders.classifier(root / "clf"),
        "multi": hf_folders.classifier(root / "multi", MULTI_LABELS, multi_label=True),
        "rr": hf_folders.cross_encoder(root / "rr"),
    }


@pytest.fixture(scope="module")
def server(folders: dict[str, Path]):
    s = start_server(
        *(a for name, path in folders.items() for a in ("--model", f"{name}={path}")),
        "--slo-ms",
        "2000",
        "--timeout-ms",
        "20000",
        timeout=180,
    )
    yield s
    s.stop()


def pipeline_of(folder: Path, function: str):
    from transformers import pipeline

    return pipeline("text-classification", model=str(folder), top_k=None, function_to_apply=function, device="cpu")


FUNCTION = {"clf": "softmax", "multi": "sigmoid"}  # what each folder's config says (problem_type)


def post(server: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


@pytest.mark.parametrize("model", ["clf", "multi"])
def test_classify_equals_the_pipelines_labels_and_scores(
    server: LiveServer, folders: dict[str, Path], model: str
) -> None:
    want = pipeline_of(folders[model], FUNCTION[model])(TEXTS)  # per text: every class, highest score first
    r = post(server, "/v1/classify", {"model": model, "input": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == f"{model}@v1" and body["usage"]["prompt_tokens"] > len(TEXTS)
    labels = list(MULTI_LABELS) if model == "multi" else ["negative", "neutral", "positive"]
    for i, (got, expected) in enumerate(zip(body["data"], want, strict=True)):
        by_label = {p["label"]: p["score"] for p in expected}
        assert got["index"] == i and got["num_classes"] == len(labels)
        np.testing.assert_allclose(got["probs"], [by_label[label] for label in labels], atol=1e-5)
        assert got["label"] == expected[0]["label"]
    if model == "clf":
        np.testing.assert_allclose([sum(d["probs"]) for d in body["data"]], 1.0, atol=1e-5)  # softmax
    else:
        assert max(sum(d["probs"]) for d in body["data"]) > 1.2  # sigmoid: each class on its own


@pytest.mark.parametrize("model", ["clf", "multi"])
def test_predict_equals_the_pipeline_for_texts_batches_and_pairs(
    server: LiveServer, folders: dict[str, Path], model: str
) -> None:
    pipe = pipeline_of(folders[model], FUNCTION[model])

    def want(seq: str | tuple[str, str]) -> list[dict]:
        return pipe([seq])[0] if isinstance(seq, str) else pipe({"text": seq[0], "text_pair": seq[1]})

    def same(got: list[dict], seq: str | tuple[str, str]) -> None:
        expected = want(seq)
        assert [p["label"] for p in got] == [p["label"] for p in expected]
        np.testing.assert_allclose([p["score"] for p in got], [p["score"] for p in expected], atol=1e-5)

    one = post(server, "/predict", {"model": model, "inputs": TEXTS[1]})
    assert one.status_code == 200, one.text
    same(one.json(), TEXTS[1])
    same(post(server, "/predict", {"model": model, "inputs": [TEXTS[2]]}).json(), TEXTS[2])
    same(post(server, "/predict", {"model": model, "inputs": list(PAIRS[0])}).json(), PAIRS[0])
    batch = post(server, "/predict", {"model": model, "inputs": [[TEXTS[0]], list(PAIRS[1]), [TEXTS[5]]]}).json()
    assert len(batch) == 3
    for got, seq in zip(batch, [TEXTS[0], PAIRS[1], TEXTS[5]], strict=True):
        same(got, seq)


def test_predict_raw_scores_are_the_logits(server: LiveServer, folders: dict[str, Path]) -> None:
    want = pipeline_of(folders["clf"], "none")(TEXTS[:2])
    got = post(server, "/predict", {"inputs": [[t] for t in TEXTS[:2]], "raw_scores": True}).json()
    for g, w in zip(got, want, strict=True):
        assert [p["label"] for p in g] == [p["label"] for p in w]
        np.testing.assert_allclose([p["score"] for p in g], [p["score"] for p in w], atol=1e-5)


def test_classify_is_priced_by_tokens_on_the_ledger(server: LiveServer) -> None:
    """Each input costs its tokens, as an embedding does: the tenant's cost served grows by the prompt tokens,
    and its inputs by one each (the usage ledger, GET /v1/usage)."""

    def counts() -> dict:
        return httpx.get(server.url + "/v1/usage").json()["data"][0]["since_start"]

    before = counts()
    r = post(server, "/classify", {"input": TEXTS[:3]})  # no model named: the first classification folder
    assert r.status_code == 200 and r.json()["model"] == "clf@v1", r.text
    after = counts()
    assert after["cost_served"] - before["cost_served"] == pytest.approx(r.json()["usage"]["prompt_tokens"])
    assert after["inputs"]["met"] + after["inputs"]["slow"] - before["inputs"]["met"] - before["inputs"]["slow"] == 3


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/classify", {"input": ""}, 400, "input"),
        ("/v1/classify", {"input": []}, 400, "input"),
        ("/v1/classify", {"input": ["a"] * 2049}, 400, "input"),
        ("/v1/classify", {"input": [1, 2]}, 400, "input"),
        ("/v1/classify", {"input": {"text": "a"}}, 400, "input"),
        ("/v1/classify", {"model": "clf"}, 400, "input"),
        ("/v1/classify", {"input": "a", "model": "rr"}, 400, "model"),  # a cross-encoder does not classify
        ("/v1/classify", {"input": "a", "model": "nope"}, 404, "model"),
        ("/predict", {"inputs": []}, 400, "inputs"),
        ("/predict", {"inputs": ["a", "b", "c"]}, 400, "inputs"),
        ("/predict", {"inputs": ["a", ["b"]]}, 400, "inputs"),
        ("/predict", {"inputs": [["a", "b", "c"]]}, 400, "inputs"),
        ("/predict", {"inputs": [[""]]}, 400, "inputs"),
        ("/predict", {"inputs": 3}, 400, "inputs"),
        ("/predict", {"inputs": "a", "raw_scores": "yes"}, 400, "raw_scores"),
        ("/predict", {"inputs": "a", "model": "rr"}, 400, "model"),
        ("/predict", {"inputs": "a", "model": "nope"}, 404, "model"),
    ],
)
def test_bad_bodies_are_refused_in_openai_shape(server: LiveServer, path: str, body: dict, status: int, param: str):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_the_cross_encoder_stays_a_reranker(server: LiveServer) -> None:
    r = post(server, "/v1/rerank", {"query": "a cat", "documents": ["a kitten", "a car"]})
    assert r.status_code == 200 and r.json()["model"] == "rr@v1", r.text
    assert post(server, "/v1/rerank", {"query": "a", "documents": ["b"], "model": "clf"}).status_code == 400


def test_the_openapi_document_describes_classify_and_predict(server: LiveServer) -> None:
    doc = httpx.get(server.url + "/openapi.json").json()
    assert {"/v1/classify", "/classify", "/predict"} <= set(doc["paths"])
    assert {"ClassifyRequest", "ClassifyResponse", "PredictRequest", "Prediction"} <= set(doc["components"]["schemas"])
