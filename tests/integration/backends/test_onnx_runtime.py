"""`--runtime onnx` and `--quantize int8` (backends/onnx_runtime.py) on small folders the test builds (random
weights, hidden size 32, 2 layers, `tests/hf_folders.py`): the ONNX fp32 graph gives torch's vectors, scores and
classes (the backend objects, and a live server's /v1/embeddings, /v1/rerank and /v1/classify against
sentence-transformers' and transformers' pipeline's own answers); int8 stays within the cosine floor and is
refused, exit 2 in one line, above a floor it cannot reach; the export is made once, kept in the weights cache by
the folder's content (a touched file reuses it, a changed byte exports anew) and reused by the next server start."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from batchserve.backends import onnx_runtime
from batchserve.backends.folder import inspect_folder
from batchserve.backends.hf import FolderClassifier, FolderEmbedder, FolderReranker, TokenModel, pair_input
from tests import hf_folders
from tests.conftest import start_server

TEXTS = [
    "hello world",
    "the cat is on the road",
    "what is the capital of france",
    "a big red car " * 30,  # past max_seq_length: truncated
    "Quick brown fox, jumping!",
    "fish",
]
QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "the cat eats fish", "a big city on a river", "france", "hello world"]


def cross_encoder(folder: Path) -> Path:
    """A cross-encoder whose scores spread (larger random weights than `hf_folders.cross_encoder`'s, whose
    scores all lie within 1e-5 of 0.5): a difference in them shows."""
    import torch
    from transformers import BertForSequenceClassification

    torch.manual_seed(3)
    tokenizer = hf_folders.wordpiece_tokenizer()
    config = hf_folders.bert_config(tokenizer, num_labels=1, initializer_range=0.15)
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("onnx-folders")
    return {
        # weights wider than BERT's default 0.02, whose vectors int8 changes by less than a cosine of 1e-6 (it prints
        # 1.000000): here it reaches ~0.9999, so a floor above that is refused and one below it holds
        "emb": hf_folders.embedder(root / "emb", initializer_range=0.15),
        "cls": hf_folders.embedder(root / "cls", pooling="cls", normalize=False, max_seq_length=16),
        "rr": cross_encoder(root / "rr"),
        "clf": hf_folders.classifier(root / "clf", initializer_range=0.15),
        # int8 weights change its classes (lowest logit cosine ~0.38; at 0.5 it was ~0.94)
        "chaotic": hf_folders.classifier(root / "chaotic", initializer_range=0.7),
    }


def backend(path: Path, plan: onnx_runtime.OnnxPlan | None) -> TokenModel:
    info = inspect_folder(str(path))
    kind = {"reranking": FolderReranker, "classification": FolderClassifier}.get(info.task, FolderEmbedder)
    made = kind(info, ["cpu"], onnx=plan)
    made.setup("cpu")
    return made


def inputs_of(model: TokenModel) -> list[str]:
    return [pair_input(QUERY, d) for d in DOCUMENTS + TEXTS] if isinstance(model, FolderReranker) else TEXTS


@pytest.mark.parametrize("name", ["emb", "cls", "rr"])
def test_onnx_fp32_gives_torchs_answers(folders: dict[str, Path], tmp_path: Path, name: str) -> None:
    torch_model = backend(folders[name], None)
    onnx_model = backend(folders[name], onnx_runtime.OnnxPlan("none", cache=tmp_path))
    assert isinstance(onnx_model.models["cpu"], onnx_runtime.OnnxModel)  # the graph runs, not torch
    want = np.array(torch_model.batch(inputs_of(torch_model), "cpu"))
    got = np.array(onnx_model.batch(inputs_of(onnx_model), "cpu"))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-4)
    if name == "rr":
        assert np.ptp(want) > 0.05  # scores that differ, so equal ones say something
        assert list(np.argsort(got)) == list(np.argsort(want))


def classes(answers: list) -> tuple[list[list[str]], np.ndarray, np.ndarray]:
    """A classifier's answers as their labels, scores and logits, in the model's label order."""
    labels = [[c["label"] for c in row] for row in answers]
    return (
        labels,
        np.array([[c["score"] for c in row] for row in answers]),
        np.array([[c["logit"] for c in row] for row in answers]),
    )


def test_a_classifier_on_onnx_gives_torchs_classes_and_int8_keeps_the_floor(
    folders: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The classifier's graph ends at its logits; the softmax and the labels stay the torch backend's code. fp32
    gives torch's logits and scores; int8 differs from them but keeps the floor, on the lowest cosine of an
    input's logits, and is refused above what it reaches, and at the default floor where it changes classes."""
    texts = TEXTS + DOCUMENTS
    labels, scores, logits = classes(backend(folders["clf"], None).batch(texts, "cpu"))
    fp32 = backend(folders["clf"], onnx_runtime.OnnxPlan("none", cache=tmp_path))
    assert isinstance(fp32.models["cpu"], onnx_runtime.OnnxModel)
    got_labels, got_scores, got_logits = classes(fp32.batch(texts, "cpu"))
    assert got_labels == labels and labels[0] == ["negative", "neutral", "positive"]
    np.testing.assert_allclose(got_logits, logits, atol=1e-4)
    np.testing.assert_allclose(got_scores, scores, atol=1e-4)
    assert np.ptp(scores[:, 0]) > 0.03  # scores that differ between inputs (by 0.045), so equal ones say something
    with caplog.at_level(logging.INFO, logger="batchserve.onnx"):
        int8 = backend(folders["clf"], onnx_runtime.OnnxPlan("int8", 0.98, tmp_path))
    assert "lowest logit cosine" in caplog.text, caplog.text
    _, int8_scores, int8_logits = classes(int8.batch(texts, "cpu"))
    assert onnx_runtime.agreement("embeddings", logits.tolist(), int8_logits.tolist()) >= 0.98
    assert np.abs(int8_logits - logits).max() > 1e-6  # int8 weights: not fp32's logits exactly
    np.testing.assert_allclose(int8_scores.sum(1), 1.0, atol=1e-5)  # still a softmax over the classes
    with pytest.raises(onnx_runtime.QuantizationRefused, match=r"lowest logit cosine 0\.9\d+ .* --quantize-cosine"):
        backend(folders["clf"], onnx_runtime.OnnxPlan("int8", 0.9999999, tmp_path))
    # random weights of a wide range: a network so chaotic that int8 flips its classes is refused at the default
    with pytest.raises(
        onnx_runtime.QuantizationRefused, match=r"lowest logit cosine 0\.[0-8]\d+ .* --quantize-cosine-floor 0\.98:"
    ):
        backend(folders["chaotic"], onnx_runtime.OnnxPlan("int8", 0.98, tmp_path))


def test_int8_serves_within_the_floor_and_is_refused_above_it(
    folders: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="batchserve.onnx"):
        int8 = backend(folders["emb"], onnx_runtime.OnnxPlan("int8", 0.98, tmp_path))
    assert isinstance(int8.models["cpu"], onnx_runtime.OnnxModel) and int8.models["cpu"].path.name == "model.int8.onnx"
    assert "int8 of" in caplog.text and "lowest cosine 0.99" in caplog.text, caplog.text  # below 1.000000
    assert "Ignore MatMul" not in caplog.text  # the quantizer's chatter on the root logger is dropped
    want = np.array(backend(folders["emb"], None).batch(TEXTS, "cpu"))
    got = np.array(int8.batch(TEXTS, "cpu"))
    cosines = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosines.min() >= 0.98
    assert np.abs(got - want).max() > 1e-6  # int8 weights: not fp32's vectors exactly
    with pytest.raises(onnx_runtime.QuantizationRefused, match=r"lowest cosine 0\.99\d+ .* --quantize-cosine-floor"):
        backend(folders["emb"], onnx_runtime.OnnxPlan("int8", 0.9999999, tmp_path))


def test_the_export_is_made_once_and_kept_by_content(
    folders: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import shutil

    folder = tmp_path / "emb"
    shutil.copytree(folders["emb"], folder)
    plan = onnx_runtime.OnnxPlan("none", cache=tmp_path / "cache")

    def start() -> tuple[str, list[Path]]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="batchserve.onnx"):
            backend(folder, plan)
        return caplog.text, sorted((tmp_path / "cache" / "onnx").glob("*/model.onnx"))

    log, graphs = start()
    assert "exported" in log and len(graphs) == 1
    made = graphs[0].stat().st_mtime_ns
    log, graphs = start()
    assert "from the cache" in log and "exported" not in log
    assert len(graphs) == 1 and graphs[0].stat().st_mtime_ns == made
    for name in ("config.json", "model.safetensors"):
        os.utime(folder / name)  # a newer time, the same bytes
    log, graphs = start()
    assert "from the cache" in log and "exported" not in log and graphs[0].stat().st_mtime_ns == made
    (folder / "config.json").write_text((folder / "config.json").read_text() + "\n")  # one byte more
    log, graphs = start()
    assert "exported" in log and len(graphs) == 2


def test_a_server_on_onnx_answers_as_torch_and_a_restart_reuses_the_export(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    from sentence_transformers import CrossEncoder, SentenceTransformer

    cache = tmp_path / "cache"
    common = ("--runtime", "onnx", "--weights-cache", str(cache), "--jobs-db", "")
    server = start_server(
        "--model", f"emb={folders['emb']}", "--model", f"rr={folders['rr']}", "--model", f"clf={folders['clf']}",
        *common, "--slo-ms", "2000",
        "--timeout-ms", "20000", timeout=180,
    )  # fmt: skip
    try:
        r = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS, "model": "emb"}, timeout=60)
        assert r.status_code == 200, r.text
        got = np.array([d["embedding"] for d in r.json()["data"]])
        r = httpx.post(server.url + "/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=60)
        assert r.status_code == 200, r.text
        scores = {item["index"]: item["relevance_score"] for item in r.json()["results"]}
        r = httpx.post(server.url + "/v1/classify", json={"input": TEXTS, "model": "clf"}, timeout=60)
        assert r.status_code == 200, r.text
        classified = r.json()["data"]
    finally:
        server.stop()
    assert server.log().count("exported") == 3, server.log()
    np.testing.assert_allclose(got, SentenceTransformer(str(folders["emb"]), device="cpu").encode(TEXTS), atol=1e-4)
    want = CrossEncoder(str(folders["rr"]), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    np.testing.assert_allclose([scores[i] for i in range(len(DOCUMENTS))], want, atol=1e-4)
    from transformers import pipeline

    pipe = pipeline("text-classification", model=str(folders["clf"]), top_k=None, device="cpu")
    for got_class, expected in zip(classified, pipe(TEXTS), strict=True):
        by_label = {p["label"]: p["score"] for p in expected}
        assert got_class["label"] == expected[0]["label"]
        np.testing.assert_allclose(
            got_class["probs"], [by_label[n] for n in ("negative", "neutral", "positive")], atol=1e-4
        )

    # The next start reads the export (and makes int8 beside it), then refuses a floor int8 cannot reach.
    done = subprocess.run(
        [sys.executable, "-m", "batchserve", "serve", "--port", "0", "--model", f"emb={folders['emb']}", *common,
         "--quantize", "int8", "--quantize-cosine-floor", "0.9999999"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    output = done.stdout + done.stderr
    assert "ONNX graph of" in output and "from the cache" in output and "exported" not in output, output
    errors = [line for line in done.stderr.splitlines() if line.startswith("batchserve: error:")]
    assert len(errors) == 1 and "Traceback" not in output, done.stderr
    assert "lowest cosine 0.99" in errors[0] and "--quantize-cosine-floor 0.9999999" in errors[0], errors[0]


@pytest.mark.slow
@pytest.mark.parallel
def test_minilm_serves_int8_within_the_floor(tmp_path: Path) -> None:
    """The real all-MiniLM-L6-v2 (`--backend minilm`) on int8 passes the default floor at start (the probe set
    in one batch, as the start checks it) and answers /v1/embeddings close to sentence-transformers' fp32 vectors.
    Served, an input rides the batches its length class makes, and dynamic int8 scales activations per batch, so
    its vector moves with its batch-mates (docs/backends.md): a probe text once served at 0.976 on CI's busy
    machine where the start measured 0.981, so served probe texts are held to 0.97; a one-word input moves more,
    within 0.95 here."""
    from sentence_transformers import SentenceTransformer

    from batchserve.backends import minilm

    server = start_server(
        "--backend", "minilm", "--runtime", "onnx", "--quantize", "int8", "--weights-cache", str(tmp_path),
        "--jobs-db", "", ready=False, timeout=300,
    )  # fmt: skip
    try:
        texts = list(onnx_runtime.PROBE_TEXTS) + TEXTS
        want = SentenceTransformer(str(minilm.model_dir()), device="cpu").encode(texts)
        server.wait_ready(300)
        r = httpx.post(server.url + "/v1/embeddings", json={"input": texts, "model": "minilm"}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        server.stop()
    assert "int8 of" in server.log() and "lowest cosine" in server.log(), server.log()
    got = np.array([d["embedding"] for d in r.json()["data"]])
    assert got.shape == want.shape == (len(texts), 384)
    cosines = (got * want).sum(1)
    floor = float(server.log().split("lowest cosine ", 1)[1].split()[0])
    assert floor >= 0.98, server.log()  # the default floor, as the start measured it
    assert cosines[: len(onnx_runtime.PROBE_TEXTS)].min() >= 0.97 and cosines.min() >= 0.95, cosines
    assert cosines.max() < 0.9999  # int8's vectors, not fp32's
