"""The `minilm` backend on the real all-MiniLM-L6-v2 weights (issue 11): started with `--backend minilm` and no
other flag, its vectors equal sentence-transformers' own `encode`, a paraphrase scores above an unrelated
sentence, and the official `openai` client gets them in float and base64; the weights are found without
importing their package and extracted once, atomically."""

from __future__ import annotations

import base64
import math
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from batchserve.backends import minilm
from tests.conftest import LiveServer, start_server

# Vectors and counts only, no timing (60 s deadlines, or the derived default's 2 s at least for one short
# sentence): CI runs it in the parallel workers.
pytestmark = [pytest.mark.slow, pytest.mark.parallel]

SENTENCES = [
    "A man is playing a guitar.",
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings turn text into vectors that can be compared with a cosine.",
    "¿Dónde está la biblioteca? Está cerca de la estación.",
    "batchserve gathers single requests into batches for the GPU.",
    "word " * 400,  # past the 256-token window: truncated, as sentence-transformers does
    "Paris is the capital of France.",
]


@pytest.fixture(scope="module")
def started():
    s = start_server("--backend", "minilm", ready=False, timeout=300)  # no other flag: the defaults must serve it
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(started: LiveServer) -> object:
    """sentence-transformers' model, loaded in the test process while the server loads and warms its own."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm.model_dir()), device="cpu")


@pytest.fixture(scope="module")
def server(started: LiveServer, reference: object) -> LiveServer:
    started.wait_ready(300)
    return started


def embed(server: LiveServer, texts: list[str], **extra: object) -> dict:
    # A roomy deadline: CI's two cores are shared; the answers, not their latency, are checked here.
    body = {"input": texts, "model": "minilm", "timeout_ms": 60000, **extra}
    r = httpx.post(server.url + "/v1/embeddings", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_vectors_equal_sentence_transformers_encode(server: LiveServer, reference):
    got = np.array([d["embedding"] for d in embed(server, SENTENCES, encoding_format="float")["data"]])
    want = reference.encode(SENTENCES, normalize_embeddings=True)
    assert got.shape == (len(SENTENCES), 384)
    assert np.abs(got - want).max() < 1e-4
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_usage_counts_the_tokens_embedded(server: LiveServer, reference):
    body = embed(server, SENTENCES)
    counts = [len(ids) for ids in reference.tokenizer(SENTENCES, truncation=True, max_length=256)["input_ids"]]
    assert body["usage"]["prompt_tokens"] == sum(counts)
    assert counts[SENTENCES.index("word " * 400)] == 256


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_a_paraphrase_scores_above_an_unrelated_sentence(server: LiveServer):
    a, para, other = (
        d["embedding"]
        for d in embed(
            server,
            ["A man is playing a guitar.", "Someone is playing an instrument.", "The stock market fell sharply today."],
            encoding_format="float",
        )["data"]
    )
    assert cosine(a, para) > cosine(a, other) + 0.2


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_the_openai_client_gets_one_vector_and_a_list(server: LiveServer, reference, encoding: str):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    roomy = {"timeout_ms": 60000}
    one = client.embeddings.create(input=SENTENCES[0], model="minilm", encoding_format=encoding, extra_body=roomy)
    many = client.embeddings.create(input=SENTENCES[:4], model="minilm", encoding_format=encoding, extra_body=roomy)

    def vec(e: list[float] | str) -> np.ndarray:
        return np.frombuffer(base64.b64decode(e), dtype="<f4") if isinstance(e, str) else np.array(e)

    want = reference.encode(SENTENCES[:4], normalize_embeddings=True)
    assert len(one.data) == 1 and np.abs(vec(one.data[0].embedding) - want[0]).max() < 1e-4
    assert [d.index for d in many.data] == [0, 1, 2, 3]
    assert np.abs(np.stack([vec(d.embedding) for d in many.data]) - want).max() < 1e-4
    assert many.model == "minilm@v1" and many.usage.prompt_tokens > 0
    decoded = client.embeddings.create(input=SENTENCES[1], model="minilm")  # the client's default: base64, decoded
    assert np.abs(np.array(decoded.data[0].embedding) - want[1]).max() < 1e-4


def test_tokenize_counts_with_the_model_and_says_its_window(server: LiveServer, reference):
    r = httpx.post(server.url + "/tokenize", json={"model": "minilm", "prompt": SENTENCES[0]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == reference.tokenizer(SENTENCES[0])["input_ids"]
    assert body["max_model_len"] == 256  # the embedder's window, found behind the MiniLM wrapper


def test_inference_route_answers_384_floats(server: LiveServer):
    r = httpx.post(server.url + "/v1/inference", json={"input": "What is the capital of France?"}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "minilm@v1"
    output = r.json()["output"]
    assert len(output) == 384 and all(isinstance(x, float) for x in output)


def test_the_weights_are_found_without_importing_their_package_and_extracted_once(tmp_path: Path):
    """find_spec, not import (the package prints); two extractions at once leave one complete directory."""
    code = (
        "import sys, os; os.environ['BATCHSERVE_CACHE_DIR'] = sys.argv[1]\n"
        "from batchserve.backends import minilm\n"
        "import threading\n"
        "found = []\n"
        "ts = [threading.Thread(target=lambda: found.append(minilm.model_dir())) for _ in range(2)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "assert len(set(found)) == 1, found\n"
        "assert 'all_minilm_l6_v2' not in sys.modules\n"
        "print(found[0])\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("all-MiniLM-L6-v2-0.1.2")  # nothing else printed: the package never ran
    target = Path(done.stdout.strip())
    assert (target / "model.safetensors").stat().st_size > 80_000_000 and (target / "tokenizer.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == [target.name]  # no temporary directory left behind


def test_inputs_sorted_by_length_come_back_in_input_order():
    backend = minilm.MiniLM(["cpu"], pass_tokens=24)  # small passes: sorting decides which inputs share one
    backend.setup("cpu")
    texts = ["a much longer sentence than the others, with many more tokens in it", "short", "medium length one"]
    together = backend.batch(texts, "cpu")
    alone = [backend.batch([t], "cpu")[0] for t in texts]
    assert np.abs(np.array(together) - np.array(alone)).max() < 1e-5
