"""A causal LM folder served with `--model` (issue 36): a Llama-style model the test builds (random weights with
a wide init so greedy choices are clear-cut, hidden size 32, 2 layers, a chat template: `tests/hf_folders.py`) on
the generation engine's slot stepper. Greedy chat and completions over HTTP, whole and streamed, equal
transformers' `model.generate` on the same folder token for token (the count, the text, the finish reason); the
folder's generation_config.json sampling defaults are logged at start and apply when a request leaves them out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests import hf_folders
from tests.conftest import LiveServer, start_server

CHATS = ["hello world", "what is the capital of france", "the cat and the dog play in the big green tree"]
PROMPTS = ["the cat", "paris is", "write a question about the sea and the sky"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_folders.causal_lm(
        tmp_path_factory.mktemp("lm") / "tiny-llama", generation={"temperature": 0.7, "top_p": 0.9, "do_sample": True}
    )


@pytest.fixture(scope="module")
def server(folder: Path):
    s = start_server("--model", str(folder), "--generation-max-context", "256", timeout=240)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(folder: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(str(folder)).eval(), AutoTokenizer.from_pretrained(str(folder))


def generate(reference: tuple[Any, Any], ids: list[int]) -> tuple[str, int, str]:
    """(text, completion tokens, finish reason) of greedy `generate` from these prompt ids."""
    import torch

    model, tok = reference
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
    new = out[0, len(ids) :].tolist()
    ended = bool(new) and new[-1] == tok.eos_token_id
    # A random model emits stray byte-level tokens: an answer may end inside a UTF-8 character, which `decode`
    # writes as U+FFFD and the server's incremental decoder (tokenizers' DecodeStream) holds back unsent.
    return tok.decode(new, skip_special_tokens=True).rstrip("\ufffd"), len(new), "stop" if ended else "length"


def chat_ids(reference: tuple[Any, Any], text: str) -> list[int]:
    enc = reference[1].apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def streamed(server: LiveServer, path: str, body: dict) -> tuple[str, str]:
    text, finish = "", ""
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = orjson.loads(line[6:])["choices"][0]
            text += choice.get("delta", {}).get("content") or choice.get("text") or ""
            finish = choice.get("finish_reason") or finish
    return text, finish


@pytest.mark.parametrize("i", range(len(CHATS)))
def test_greedy_chat_equals_generate_whole_and_streamed(server: LiveServer, reference: tuple[Any, Any], i: int) -> None:
    want_text, want_tokens, want_finish = generate(reference, chat_ids(reference, CHATS[i]))
    body = {"messages": [{"role": "user", "content": CHATS[i]}], "temperature": 0, "max_tokens": MAX_TOKENS}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["model"] == "tiny-llama"
    assert got["usage"]["completion_tokens"] == want_tokens
    assert got["choices"][0]["message"]["content"] == want_text
    assert got["choices"][0]["finish_reason"] == want_finish
    assert streamed(server, "/v1/chat/completions", body) == (want_text, want_finish)


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_greedy_completions_equal_generate_whole_and_streamed(
    server: LiveServer, reference: tuple[Any, Any], i: int
) -> None:
    ids = reference[1](PROMPTS[i], add_special_tokens=False)["input_ids"]
    want_text, want_tokens, want_finish = generate(reference, ids)
    body = {"prompt": PROMPTS[i], "temperature": 0, "max_tokens": MAX_TOKENS}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    got = r.json()
    assert (got["choices"][0]["text"], got["usage"]["completion_tokens"], got["choices"][0]["finish_reason"]) == (
        want_text,
        want_tokens,
        want_finish,
    )
    assert streamed(server, "/v1/completions", body) == (want_text, want_finish)


def test_the_folders_sampling_defaults_are_logged_and_applied(server: LiveServer, reference: tuple[Any, Any]) -> None:
    assert any(
        "sampling defaults temperature=0.7 top_p=0.9 from the model's generation_config.json" in line
        for line in server.log_lines
    ), server.log()

    # Left out, temperature and top_p are the folder's: a seeded answer equals the one asking 0.7 / 0.9 outright,
    # and differs from OpenAI's 1.0 / 1.0 for some seed.
    def text(seed: int, **params: float) -> str:
        body = {"prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "seed": seed, **params}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    seeds = range(4)
    assert [text(s) for s in seeds] == [text(s, temperature=0.7, top_p=0.9) for s in seeds]
    assert [text(s) for s in seeds] != [text(s, temperature=1.0, top_p=1.0) for s in seeds]


def test_the_models_card_names_the_folders_backend(server: LiveServer) -> None:
    cards = httpx.get(server.url + "/v1/models").json()["data"]
    chat = next(c for c in cards if c["id"] == "tiny-llama")
    assert chat["backend"] == "hf-continuous-batching", cards
    assert not any(c["backend"].startswith("smollm2") for c in cards), cards
