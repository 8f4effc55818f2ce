"""minilm from a folder of its weights (issue 25): what a GPU host with no registry access gets inside the
repository copy it is sent (`bench/gpu_prep.sh` writes an fp16 copy; `$BATCHSERVE_MINILM_DIR` names it).
On the CPU: an fp32 copy gives the package's vectors exactly, an fp16 copy the same to fp16's precision, a
server started with the variable serves the copy's vectors, a folder without the weights is refused in one
line; and the batch limits a GPU gets from its free memory (made-up figures).

In process on the real weights, except `test_a_server_serves_the_folder_the_variable_names` (starts a server); the
parts without the weights are tests/unit/backends/test_minilm_dir.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import numpy as np
import pytest

from batchserve.backends import minilm
from batchserve.config import Settings
from tests.conftest import start_server

TEXTS = ["A man is playing a guitar.", "Hi", "Embeddings turn text into vectors that can be compared.", "word " * 300]


@pytest.fixture(scope="module")
def copies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("minilm")
    return {dtype: minilm.export_copy(root / dtype, dtype) for dtype in ("float32", "float16")}


def vectors(path: Path | None = None) -> np.ndarray:
    model = minilm.MiniLM(["cpu"], path=path) if path is not None else minilm.MiniLM(["cpu"])
    model.setup("cpu")
    return np.array(model.batch(TEXTS, "cpu"))


@pytest.fixture(scope="module")
def package_vectors() -> np.ndarray:
    return vectors()


@pytest.fixture(scope="module")
def fp16_vectors(copies: dict[str, Path]) -> np.ndarray:
    """The fp16 copy's vectors in process: the fp16 test and the server's both compare with them (one load)."""
    return vectors(copies["float16"])


def test_an_fp32_copy_gives_the_packages_vectors(copies: dict[str, Path], package_vectors: np.ndarray) -> None:
    assert {p.name for p in copies["float32"].iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert (copies["float32"] / "1_Pooling" / "config.json").exists()  # sentence-transformers loads it too
    np.testing.assert_allclose(vectors(copies["float32"]), package_vectors, atol=1e-6)


def test_an_fp16_copy_is_half_the_size_and_the_same_to_its_precision(
    copies: dict[str, Path], package_vectors: np.ndarray, fp16_vectors: np.ndarray
) -> None:
    size16 = (copies["float16"] / "model.safetensors").stat().st_size
    size32 = (copies["float32"] / "model.safetensors").stat().st_size
    assert size16 < 0.51 * size32
    got = fp16_vectors
    assert not np.array_equal(got, package_vectors)  # the copy was loaded, not the package
    cosines = (got * package_vectors).sum(1)
    assert cosines.min() > 0.9999 and np.abs(got - package_vectors).max() < 5e-3


def test_the_variable_names_the_folder(copies: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(minilm.DIR_ENV, str(copies["float16"]))
    assert minilm.MiniLM(["cpu"]).path == copies["float16"]
    monkeypatch.delenv(minilm.DIR_ENV)
    assert minilm.MiniLM(["cpu"]).path == minilm.model_dir()


@pytest.mark.slow
@pytest.mark.parallel  # answers only, no timing: CI runs it in the parallel workers
def test_a_server_serves_the_folder_the_variable_names(copies: dict[str, Path], request: pytest.FixtureRequest) -> None:
    server = start_server("--backend", "minilm", env={minilm.DIR_ENV: str(copies["float16"])}, ready=False, timeout=300)
    try:
        want = request.getfixturevalue("fp16_vectors")  # in process while the server loads (once per module)
        server.wait_ready(300)
        r = httpx.post(
            server.url + "/v1/embeddings", json={"input": TEXTS, "model": "minilm", "timeout_ms": 60000}, timeout=120
        )
        assert r.status_code == 200, r.text
        got = np.array([d["embedding"] for d in r.json()["data"]])
        np.testing.assert_allclose(got, want, atol=1e-5)
    finally:
        server.stop()


def test_model_spec_option_path_is_accepted(copies: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(minilm, "pick_devices", lambda n: ["cpu"])
    s = Settings(backend="minilm")
    spec = dataclasses.replace(s.models[0], options={"path": str(copies["float16"])})
    assert minilm.MiniLM.from_settings(spec, s).path == copies["float16"]
