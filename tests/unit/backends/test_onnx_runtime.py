"""The pure pieces of `--runtime onnx` (backends/onnx_runtime.py): the export cache's key is the folder's content
(not its files' times, not where it lies), how int8 is compared with fp32, which flag combinations are refused
in one line, and that a CUDA host refuses it. The exports themselves are
tests/integration/backends/test_onnx_runtime.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from batchserve.backends import onnx_runtime
from batchserve.config import Settings


def folder(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "bert"}')
    (path / "model.safetensors").write_bytes(b"\x00" * 64 + b"weights")
    (path / "tokenizer.json").write_text("{}")
    return path


def test_the_key_is_the_content_not_the_times_nor_the_place(tmp_path: Path) -> None:
    a = folder(tmp_path / "a")
    key = onnx_runtime.content_key(a, "embeddings")
    for name in ("config.json", "model.safetensors"):
        os.utime(a / name, (1, 1))  # touched: same bytes, another time
    assert onnx_runtime.content_key(a, "embeddings") == key
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert onnx_runtime.content_key(b, "embeddings") == key  # a copy elsewhere reuses the export
    assert onnx_runtime.content_key(a, "reranking") != key  # another graph (logits, not token vectors)
    (a / "tokenizer.json").write_text('{"changed": 1}')
    assert onnx_runtime.content_key(a, "embeddings") == key  # not in the graph
    weights = bytearray((a / "model.safetensors").read_bytes())
    weights[3] = 1
    (a / "model.safetensors").write_bytes(bytes(weights))
    changed = onnx_runtime.content_key(a, "embeddings")
    assert changed != key
    (a / "config.json").write_text('{"model_type": "bert", "layer_norm_eps": 1e-6}')
    assert onnx_runtime.content_key(a, "embeddings") not in (key, changed)


def test_every_weight_shard_is_in_the_key(tmp_path: Path) -> None:
    a = folder(tmp_path / "a")
    (a / "model.safetensors").rename(a / "model-00001-of-00002.safetensors")
    (a / "model-00002-of-00002.safetensors").write_bytes(b"second")
    assert [p.name for p in onnx_runtime.content_files(a)] == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    key = onnx_runtime.content_key(a, "embeddings")
    (a / "model-00002-of-00002.safetensors").write_bytes(b"Second")
    assert onnx_runtime.content_key(a, "embeddings") != key


def test_an_embedder_is_judged_by_its_worst_vector() -> None:
    reference = [[1.0, 0.0], [0.0, 2.0], [3.0, 4.0]]
    close = [[1.0, 0.01], [0.0, 2.0], [3.0, 4.0]]
    assert onnx_runtime.agreement("embeddings", reference, reference) == pytest.approx(1.0)
    assert onnx_runtime.agreement("embeddings", reference, close) == pytest.approx(1 / np.hypot(1, 0.01))
    turned = [[1.0, 0.0], [2.0, 0.0], [3.0, 4.0]]  # one input's vector at right angles: the minimum says so
    assert onnx_runtime.agreement("embeddings", reference, turned) == pytest.approx(0.0)


def test_a_reranker_is_judged_by_the_correlation_of_its_scores() -> None:
    scores = [0.9, 0.1, 0.5, 0.7]
    assert onnx_runtime.agreement("reranking", scores, [s * 0.5 + 0.2 for s in scores]) == pytest.approx(1.0)
    # all near 0.5 (their cosine would be ~1), but the order is lost: the correlation is not
    assert onnx_runtime.agreement("reranking", scores, [0.5, 0.5001, 0.5002, 0.4999]) < 0.0


def test_a_classifier_is_judged_by_its_worst_logit_vector() -> None:
    def answer(*logits: float) -> list[dict]:
        return [{"label": f"L{i}", "score": 0.0, "logit": x} for i, x in enumerate(logits)]

    reference = [answer(2.0, -1.0, 0.5), answer(0.0, 3.0, 1.0)]
    assert onnx_runtime.agreement("classification", reference, reference) == pytest.approx(1.0)
    # the second input's logits turned to another class: its cosine (3 / sqrt(10) / sqrt(10)) is the minimum
    turned = [answer(2.0, -1.0, 0.5), answer(3.0, 0.0, 1.0)]
    assert onnx_runtime.agreement("classification", reference, turned) == pytest.approx(0.1)
    assert onnx_runtime.measure_name("classification") == "lowest logit cosine"


@pytest.mark.parametrize(
    "values,says",
    [
        ({"quantize": "int8"}, "--quantize int8 needs --runtime onnx"),
        ({"runtime": "onnx", "quantize_cosine_floor": 0.0}, "--quantize-cosine-floor must be in (0, 1]"),
        ({"runtime": "onnx", "quantize_cosine_floor": 1.5}, "--quantize-cosine-floor must be in (0, 1]"),
        ({"runtime": "tensorrt"}, "--runtime must be one of torch, onnx"),
        ({"runtime": "onnx", "quantize": "int4"}, "--quantize must be one of none, int8"),
    ],
)
def test_combinations_that_cannot_run_are_refused_in_one_line(values: dict, says: str) -> None:
    with pytest.raises(ValueError) as caught:
        Settings(**values).check()
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_the_plan_follows_the_flags_and_refuses_cuda(tmp_path: Path) -> None:
    Settings(runtime="onnx", quantize="int8").check()
    assert onnx_runtime.plan_of(Settings(), ["cpu"]) is None
    settings = Settings(
        runtime="onnx",
        quantize="int8",
        quantize_cosine_floor=0.95,
        weights_cache=str(tmp_path),
        given={"weights_cache": "--weights-cache"},
    )
    assert onnx_runtime.plan_of(settings, ["cpu"]) == onnx_runtime.OnnxPlan("int8", 0.95, tmp_path)
    with pytest.raises(onnx_runtime.OnnxError, match=r"runs on the CPU .* CUDA devices \(cuda:0\).*--runtime torch"):
        onnx_runtime.plan_of(settings, ["cuda:0"])
