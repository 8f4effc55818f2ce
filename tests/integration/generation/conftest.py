"""What several generation test modules share: SmolLM2 loaded once in the test process, for the answers of
transformers `generate` that the served answers must equal (a load is seconds of the suite; each module once
loaded its own)."""

from __future__ import annotations

from typing import Callable

import pytest

Reference = Callable[[list[str], int], dict[str, str]]


@pytest.fixture(scope="session")
def generate_reference() -> Reference:
    """`(prompts, max_new) -> {prompt: answer}`: each prompt alone through transformers `generate`, greedy,
    shaped and decoded as the batch backend does."""
    import torch

    from batchserve.backends.smollm2 import load_model, load_tokenizer, prompt_ids, source_dir
    from batchserve.config import Settings

    source = source_dir(Settings(backend="smollm2"))
    tokenizer, model = load_tokenizer(source), load_model("cpu", source)

    def answers(prompts: list[str], max_new: int) -> dict[str, str]:
        out = {}
        with torch.inference_mode():
            for text in prompts:
                ids = torch.tensor(prompt_ids(tokenizer, [text]))
                new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                     do_sample=False, pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:]
                out[text] = tokenizer.decode(new, skip_special_tokens=True).strip()
        return out

    return answers
