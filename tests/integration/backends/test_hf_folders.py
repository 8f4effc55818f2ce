"""`serve --model [name=]PATH` (issue 36) on small models the test builds itself (random weights, hidden size 32,
2 layers, `tests/hf_folders.py`), over real HTTP, against the libraries' own answers on the same folders:
embeddings equal `SentenceTransformer(folder).encode` (mean pooling + Normalize, and CLS pooling without it),
`dimensions` truncates and normalises again; /v1/rerank's scores equal `CrossEncoder(folder).predict`, sorted,
with top_n and return_documents; a folder that cannot be served, or whose files are malformed, exits 2 with one
line naming why. Generation folders are tests/integration/generation/test_folder_generation.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
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
]
QUERY = "what is the capital of france"
DOCUMENTS = [
    "paris is the capital of france",
    "the cat eats fish",
    "a big city on a river",
    "france",
    "hello world",
    "the capital of the sea is blue",
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        "emb": hf_folders.embedder(root / "emb"),
        "cls": hf_folders.embedder(root / "cls", pooling="cls", normalize=False, max_seq_length=16),
        "rr": hf_folders.cross_encoder(root / "rr"),
    }


@pytest.fixture(scope="module")
def server(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    s = start_server(
        *(a for name, path in folders.items() for a in ("--model", f"{name}={path}")),
        "--slo-ms",
        "2000",
        "--timeout-ms",
        "20000",
        "--jobs-db",
        str(tmp_path_factory.mktemp("jobs") / "jobs.db"),
        timeout=180,
    )
    yield s
    s.stop()


def embed(server: LiveServer, model: str, texts: list[str], **extra: object) -> np.ndarray:
    r = httpx.post(server.url + "/v1/embeddings", json={"input": texts, "model": model, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]])


@pytest.mark.parametrize("model", ["emb", "cls"])
def test_embeddings_equal_sentence_transformers(server: LiveServer, folders: dict[str, Path], model: str) -> None:
    from sentence_transformers import SentenceTransformer

    want = SentenceTransformer(str(folders[model]), device="cpu").encode(TEXTS)
    got = embed(server, model, TEXTS)
    assert got.shape == want.shape == (len(TEXTS), 32)
    np.testing.assert_allclose(got, want, atol=1e-5)
    norms = np.linalg.norm(got, axis=1)
    if model == "emb":
        np.testing.assert_allclose(norms, 1.0, atol=1e-5)  # its Normalize module
    else:
        assert np.abs(norms - 1.0).max() > 1e-2  # CLS pooling with no Normalize: raw vectors


def test_dimensions_truncates_and_normalises_again(server: LiveServer) -> None:
    full = embed(server, "emb", TEXTS)
    short = embed(server, "emb", TEXTS, dimensions=8)
    want = full[:, :8] / np.linalg.norm(full[:, :8], axis=1, keepdims=True)
    np.testing.assert_allclose(short, want, atol=1e-6)
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "x", "model": "emb", "dimensions": 33})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
    assert "32" in r.json()["error"]["message"]


def test_a_long_input_is_embedded_from_a_cut_and_an_unsafe_one_is_a_clear_413(
    server: LiveServer, folders: dict[str, Path]
) -> None:
    """ "emb" reads 64 tokens, so the tokenizer is given at most 2,048 characters of an input: a 10,000-character
    text gets the vector sentence-transformers gives the whole text; 5,000 spaces before two words (no safe cut:
    its first 2,048 characters make no token) get a JSON 413 naming the bound, not a vector of 2 tokens."""
    from sentence_transformers import SentenceTransformer

    long = (" ".join(TEXTS) + " ") * 25
    assert 10_000 < len(long) < 16_384  # --max-input-chars
    want = SentenceTransformer(str(folders["emb"]), device="cpu").encode([long])
    np.testing.assert_allclose(embed(server, "emb", [long]), want, atol=1e-5)
    r = httpx.post(server.url + "/v1/embeddings", json={"input": " " * 5000 + "the cat", "model": "emb"}, timeout=60)
    assert r.status_code == 413 and "2048" in r.json()["error"]["message"], r.text


def test_usage_counts_the_folders_tokens(server: LiveServer, folders: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folders["cls"]))
    r = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS, "model": "cls"}, timeout=60)
    # truncated at the folder's max_seq_length (16), as sentence-transformers truncates
    want = sum(len(tok(t, truncation=True, max_length=16)["input_ids"]) for t in TEXTS)
    assert r.json()["usage"]["prompt_tokens"] == want


def test_rerank_scores_equal_cross_encoder_and_are_sorted(server: LiveServer, folders: dict[str, Path]) -> None:
    from sentence_transformers import CrossEncoder

    want = CrossEncoder(str(folders["rr"]), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    r = httpx.post(server.url + "/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "rr@v1" and body["usage"]["prompt_tokens"] > len(DOCUMENTS)
    results = body["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCUMENTS)))
    got = np.array([next(r["relevance_score"] for r in results if r["index"] == i) for i in range(len(DOCUMENTS))])
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert [r["index"] for r in results] == sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    assert all("document" not in r for r in results)


def test_rerank_top_n_and_return_documents(server: LiveServer) -> None:
    full = httpx.post(server.url + "/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=60).json()
    r = httpx.post(
        server.url + "/v1/rerank",
        json={
            "query": QUERY,
            "documents": [{"text": d} for d in DOCUMENTS],
            "top_n": 2,
            "return_documents": True,
            "model": "rr",
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    top = r.json()["results"]
    assert [t["index"] for t in top] == [t["index"] for t in full["results"][:2]]
    assert [t["document"]["text"] for t in top] == [DOCUMENTS[t["index"]] for t in top]


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"query": "", "documents": ["a"]}, 400, "query"),
        ({"query": "q", "documents": []}, 400, "documents"),
        ({"query": "q", "documents": [3]}, 400, "documents"),
        ({"query": "q", "documents": ["", "x"]}, 400, "documents"),
        ({"query": "q", "documents": [{"text": "x"}, {"text": ""}]}, 400, "documents"),
        ({"query": "q", "documents": ["a"], "top_n": 0}, 400, "top_n"),
        ({"query": "q", "documents": ["a"], "model": "emb"}, 400, "model"),
        ({"query": "q", "documents": ["a"], "model": "nope"}, 404, "model"),
    ],
)
def test_rerank_refuses_bad_bodies_in_openai_shape(server: LiveServer, body: dict, status: int, param: str) -> None:
    r = httpx.post(server.url + "/v1/rerank", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_the_openapi_document_describes_rerank(server: LiveServer) -> None:
    doc = httpx.get(server.url + "/openapi.json").json()
    assert {"/v1/rerank", "/rerank"} <= set(doc["paths"])
    assert "RerankResponse" in doc["components"]["schemas"]


def test_a_folder_embedder_serves_kserve_v2_and_a_batch_job(server: LiveServer) -> None:
    """Everything a built-in model has: KServe v2 (FP32 [n, 32], the vectors of /v1/embeddings) and batch jobs
    (their items tokenized by the tokenizer stage when the job scheduler reads them, `pretokenize`)."""
    want = embed(server, "emb", TEXTS[:2])
    r = httpx.post(
        server.url + "/v2/models/emb/infer",
        json={"inputs": [{"name": "input", "datatype": "BYTES", "shape": [2], "data": TEXTS[:2]}]},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["datatype"] == "FP32" and out["shape"] == [2, 32]
    np.testing.assert_allclose(np.array(out["data"]).reshape(2, 32), want, atol=1e-6)
    job = httpx.post(
        server.url + "/v1/batches", json={"model": "rr", "inputs": ["new text one", "another"]}, timeout=30
    )
    assert job.status_code in (200, 201, 202), job.text
    job_id = job.json()["id"]
    for _ in range(300):
        state = httpx.get(f"{server.url}/v1/batches/{job_id}", timeout=30).json()
        if state["status"] in ("completed", "failed", "cancelled"):
            break
        time.sleep(0.1)
    assert state["status"] == "completed", state


def serve_exit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "batchserve", "serve", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_folder_that_cannot_be_served_exits_2_with_one_line(tmp_path: Path, folders: dict[str, Path]) -> None:
    seq2seq = tmp_path / "t5"
    seq2seq.mkdir()
    (seq2seq / "config.json").write_text(
        json.dumps({"architectures": ["T5ForConditionalGeneration"], "model_type": "t5"})
    )
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    (gpt2 / "tokenizer.json").write_text((folders["rr"] / "tokenizer.json").read_text())
    hostile = tmp_path / "hostile"  # a normalizer that turns each space into 4 KB: one request once took 8 GB
    shutil.copytree(folders["emb"], hostile)
    from tokenizers import Tokenizer, normalizers

    tok = Tokenizer.from_file(str(hostile / "tokenizer.json"))
    tok.normalizer = normalizers.Sequence([tok.normalizer, normalizers.Replace(" ", "x" * 4096)])
    tok.save(str(hostile / "tokenizer.json"))
    cases = [
        (("--model", str(hostile)), "its normalizer turns"),
        (("--model", str(seq2seq)), "cannot tell what to serve"),
        (("--model", str(gpt2), "--task", "generation"), "cannot run on the generation engine"),
        (("--model", str(folders["rr"]), "--task", "generation"), "cannot run on the generation engine"),
        (("--model", str(tmp_path / "missing")), "no such folder"),
        (("--model", "nobody/no-such-model"), "not in the local Hugging Face cache"),
    ]
    for args, says in cases:
        done = serve_exit(*args)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, (args, done.stderr)
        assert lines[0].startswith("batchserve serve: error: model ") and says in lines[0], lines[0]


def corrupt(folder: Path, file: str, content: object) -> None:
    """Rewrite one of the folder's files: `content` as JSON, a str as it is, a callable of the file's JSON."""
    path = folder / file
    if callable(content):
        content = content(json.loads(path.read_text()))
    path.write_text(content if isinstance(content, str) else json.dumps(content))


def without(key: str):
    return lambda d: {k: v for k, v in d.items() if k != key}


# (folder, file, new content, what the line says is wrong): the three of issue 46 first
MALFORMED = [
    ("emb", "config.json", [1, 2], "malformed: Expected `object`, got `array`"),
    ("emb", "sentence_bert_config.json", {"max_seq_length": "256"}, "got `str` - at `$.max_seq_length`"),
    ("emb", "modules.json", [0, 1, 2], "malformed: Expected `object`, got `int` - at `$[0]`"),
    ("emb", "tokenizer_config.json", ["not", "an", "object"], "malformed: Expected `object`, got `array`"),
    ("emb", "1_Pooling/config.json", '{"pooling_mode": "mean",', "not valid JSON"),
    ("emb", "modules.json", lambda m: m[:1] + [{"type": m[1]["type"], "path": 1}], "at `$[1].path`"),
    ("rr", "config.json", without("model_type"), "missing required field `model_type`"),
    ("rr", "config.json", lambda c: {**c, "id2label": 1}, "at `$.id2label`"),
    ("rr", "tokenizer.json", {"version": 1}, "the tokenizers library cannot read it"),
]


@pytest.mark.parametrize(
    "name,file,content,says", MALFORMED, ids=[f"{m[0]}-{m[1]}-{i}" for i, m in enumerate(MALFORMED)]
)
def test_a_malformed_folder_exits_2_with_one_line_naming_the_file(
    tmp_path: Path, folders: dict[str, Path], name: str, file: str, content: object, says: str
) -> None:
    """Issue 46, item 11: a folder whose JSON files have the wrong shape ends start-up in one line naming the file
    and what is wrong with it, exit status 2, no traceback (read before any weight is loaded)."""
    folder = tmp_path / name
    shutil.copytree(folders[name], folder)
    corrupt(folder, file, content)
    done = serve_exit("--model", f"x={folder}")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and not done.stdout, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert lines[0].startswith(f"batchserve serve: error: model x: {folder / file}: "), lines[0]
    assert says in lines[0], lines[0]
