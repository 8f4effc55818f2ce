"""minilm's folder and GPU limits (issue 25) without its weights: a folder without them is refused in one line, and
the batch limits a GPU gets from its free memory (made-up figures). The copies of the real weights are
tests/integration/backends/test_minilm_dir.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchserve.backends import minilm
from batchserve.config import Settings


def test_a_folder_without_the_weights_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match=r"lacks model.safetensors, tokenizer.json \(\$BATCHSERVE_MINILM_DIR"):
        minilm.MiniLM(["cpu"], path=tmp_path)


def test_gpu_batch_limits_follow_the_free_memory() -> None:
    gb = 10**9
    assert minilm.gpu_batch_limits(138 * gb) == (512, 65536)  # a large GPU: the caps
    # 0.8 GB for a pass: 24,414 tokens, floored to a multiple of 1,024
    assert minilm.gpu_batch_limits(8 * gb) == (512, 23552)
    assert minilm.gpu_batch_limits(gb) == (128, 2048)  # 3,051 tokens floored to 2,048; 16 tokens an input
    assert minilm.gpu_batch_limits(0) == (64, 1024)  # never under 1,024 tokens


def test_on_cuda_unset_limits_are_sized_for_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(minilm, "pick_devices", lambda n: ["cuda:0"])
    monkeypatch.setattr(minilm, "free_memory", lambda device: 138 * 10**9)
    s = Settings(backend="minilm")
    minilm.MiniLM.from_settings(s.models[0], s)
    assert (s.max_batch_size, s.max_batch_tokens) == (512, 65536)
    given = Settings(backend="minilm", max_batch_size=64, given={"max_batch_size": "--max-batch-size"})
    minilm.MiniLM.from_settings(given.models[0], given)
    assert (given.max_batch_size, given.max_batch_tokens) == (64, 65536)  # what the user set stays
    cpu = Settings(backend="minilm")
    monkeypatch.setattr(minilm, "pick_devices", lambda n: ["cpu"])
    minilm.MiniLM.from_settings(cpu.models[0], cpu)
    assert (cpu.max_batch_size, cpu.max_batch_tokens) == (100, 0)  # the CPU's defaults


def test_the_cache_folder_is_weights_cache_as_for_smollm2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """It was `--weights-cache` for smollm2 but only $BATCHSERVE_CACHE_DIR for minilm: `--weights-cache` (set)
    now places minilm's extracted weights too, $BATCHSERVE_CACHE_DIR stays an alias, XDG the fallback."""
    monkeypatch.delenv("BATCHSERVE_CACHE_DIR", raising=False)
    monkeypatch.delenv("BATCHSERVE_MINILM_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    given = Settings(backend="minilm", weights_cache=str(tmp_path / "wc"), given={"weights_cache": "--weights-cache"})
    assert minilm.cache_root(given) == tmp_path / "wc"
    assert minilm.cache_root(Settings(backend="minilm")) == tmp_path / "xdg" / "batchserve"
    monkeypatch.setenv("BATCHSERVE_CACHE_DIR", str(tmp_path / "alias"))
    assert minilm.cache_root(Settings(backend="minilm")) == tmp_path / "alias"
    assert minilm.cache_root(given) == tmp_path / "wc"  # the flag wins over the alias
    # from_settings extracts under it: model_dir is asked with the settings
    asked: list[Settings | None] = []
    monkeypatch.setattr(minilm, "model_dir", lambda settings=None: asked.append(settings) or tmp_path / "m")
    monkeypatch.setattr(minilm, "check_weights_dir", lambda path: None)
    monkeypatch.setattr(minilm.MiniLM, "__post_init__", lambda self: None)  # no weights in the made-up folder
    monkeypatch.setattr(minilm, "pick_devices", lambda n: ["cpu"])
    built = minilm.MiniLM.from_settings(given.models[0], given)
    assert asked == [given] and built.path == tmp_path / "m"
