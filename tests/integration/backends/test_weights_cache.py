"""SmolLM2's GGUF is converted to transformers' format once (`--weights-cache`) and read from there afterwards:
the copy must hold exactly the GGUF's weights, tokenizer and generation settings, be made once, appear
atomically, and never stop a server from starting when the cache cannot be written."""

from __future__ import annotations

import logging
import re

import pytest

from batchserve.backends import content_key, smollm2
from batchserve.config import Settings

# In process, the copy's tensors against the GGUF's, no timing: CI runs it in the parallel workers.
pytestmark = [pytest.mark.slow, pytest.mark.parallel]


def test_the_converted_copy_is_the_gguf_made_once(tmp_path, monkeypatch, caplog):
    import torch
    import gguf
    import transformers

    parses: list[str] = []

    class CountedReader(gguf.GGUFReader):  # the real parser, counted (gguf_read_once memoizes it)
        def __init__(self, path, *args, **kwargs):
            parses.append(str(path))
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountedReader)
    gguf_model = smollm2.load_model("cpu", "")  # read from the GGUF itself
    assert len(parses) == 1, parses  # config and weights from one parse (transformers alone parses per read)
    from_gguf = smollm2.load_tokenizer("")
    assert len(parses) == 2, parses
    monkeypatch.undo()
    read_model = transformers.AutoModelForCausalLM.from_pretrained
    read_tokenizer = transformers.AutoTokenizer.from_pretrained

    # The conversion gets the model and tokenizer read above (~12 s of CI spared), nothing else changes.
    def model_already_read(path, *args, **kwargs):
        return gguf_model if kwargs.get("gguf_file") else read_model(path, *args, **kwargs)

    def tokenizer_already_read(path, *args, **kwargs):
        return from_gguf if kwargs.get("gguf_file") else read_tokenizer(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model_already_read)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer_already_read)
    with caplog.at_level(logging.INFO, logger="batchserve.smollm2"):
        copy_dir = smollm2.converted_dir(str(tmp_path / "cache"))
    monkeypatch.undo()
    assert re.search(r"converted \S+\.gguf in \d+\.\d s", caplog.text), caplog.text  # the time it took, logged
    assert copy_dir.startswith(str(tmp_path / "cache")) and "transformers" in copy_dir
    kept = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert kept == sorted([copy_dir.rsplit("/", 1)[1], content_key.DIGESTS])  # no staging left; the GGUF's digest

    copy = smollm2.load_model("cpu", copy_dir)
    expected, got = gguf_model.state_dict(), copy.state_dict()
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name
    assert copy.lm_head.weight.data_ptr() == copy.model.embed_tokens.weight.data_ptr()  # still tied
    assert smollm2.eos_ids(copy) == smollm2.eos_ids(gguf_model)

    from_copy = smollm2.load_tokenizer(copy_dir)
    prompts = ["What is the capital of France?", "Ünïcödé and\ttabs", "x" * 300]
    chats = [[{"role": "user", "content": p}] for p in prompts]
    assert [from_copy.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats] == [
        from_gguf.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats
    ]
    assert from_copy(prompts)["input_ids"] == from_gguf(prompts)["input_ids"]
    assert from_copy.pad_token_id == from_gguf.pad_token_id and from_copy.padding_side == "left"

    # Made once: a second start reads the copy and never the GGUF.
    def no_gguf(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_gguf)
    assert smollm2.converted_dir(str(tmp_path / "cache")) == copy_dir
    assert smollm2.source_dir(Settings(weights_cache=str(tmp_path / "cache"))) == copy_dir
    assert smollm2.source_dir(Settings(weights_cache=str(tmp_path / "cache"), smollm2_dir="/x")) == "/x"


def test_no_cache_or_an_unwritable_one_reads_the_gguf(tmp_path, caplog):
    assert smollm2.converted_dir("") == ""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="batchserve.smollm2"):
        assert smollm2.converted_dir(str(blocker / "cache")) == ""
    assert "not writable" in caplog.text


def test_a_gguf_is_parsed_once_inside_gguf_read_once(tmp_path):
    """transformers parses the GGUF afresh for each thing it reads (and rebuilds a tensor-name map per tensor):
    inside `gguf_read_once` both come from a memo, and the library's own functions are back afterwards, also
    after an error."""
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((2, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with smollm2.gguf_read_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first and isinstance(first, real_reader)
        assert [t.name for t in first.tensors] == ["token_embd.weight"]
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (real_reader, real_map)
    with pytest.raises(RuntimeError, match="in the load"), smollm2.gguf_read_once():
        raise RuntimeError("in the load")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (real_reader, real_map)
    assert gguf.GGUFReader(path) is not first  # outside, a fresh parse as before
