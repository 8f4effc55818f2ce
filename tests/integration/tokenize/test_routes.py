"""`POST /tokenize` and `/detokenize` over real HTTP on a cross-encoder folder the test builds
(tests/hf_folders.py): the ids equal the folder's own tokenizer's (`AutoTokenizer`), special tokens included,
and whole past the model's length; detokenize inverts them; TEI's `{inputs}` gets one list of {id, text} per
input; a model without a tokenizer, a text over --max-input-chars and an id outside the vocabulary are 400s."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from tests import hf_folders
from tests.conftest import LiveServer, start_server

PLUGIN = """
def batch(inputs):
    return [len(t) for t in inputs]
"""
TEXT = "the cat is on the road"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_folders.cross_encoder(tmp_path_factory.mktemp("hf") / "rr")


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory):
    plug = tmp_path_factory.mktemp("plug")
    (plug / "tokplug.py").write_text(PLUGIN)
    config = plug / "bs.toml"
    config.write_text(
        f'[[models]]\nname = "rr"\nbackend = "hf"\npath = "{folder}"\n\n'
        '[[models]]\nname = "plain"\nbackend = "tokplug:batch"\n'
    )
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(plug), os.environ.get("PYTHONPATH")]))}
    s = start_server(
        "--config", str(config), "--max-input-chars", "4000", "--jobs-db", str(plug / "jobs.db"), env=env, timeout=120
    )
    yield s
    s.stop()


def test_tokenize_equals_the_folders_tokenizer_and_detokenize_inverts_it(server: LiveServer, folder: Path) -> None:
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(str(folder))
    long = " ".join([TEXT] * 40)  # past the model's 128 tokens: counted whole
    for text in (TEXT, long):
        r = httpx.post(server.url + "/tokenize", json={"model": "rr", "prompt": text})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens"] == own(text)["input_ids"] and body["count"] == len(body["tokens"])
        assert body["max_model_len"] == 128
    assert body["count"] > 128
    bare = httpx.post(server.url + "/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()
    assert bare["tokens"] == own(TEXT, add_special_tokens=False)["input_ids"]
    r = httpx.post(server.url + "/detokenize", json={"model": "rr", "tokens": bare["tokens"]})
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == own.decode(bare["tokens"]) == TEXT


def test_tei_inputs_get_a_list_of_tokens_each(server: LiveServer, folder: Path) -> None:
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(str(folder))
    r = httpx.post(server.url + "/tokenize", json={"inputs": [TEXT, "hello world"]})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert [[t["id"] for t in one] for one in answer] == [own(TEXT)["input_ids"], own("hello world")["input_ids"]]
    assert [t["text"] for t in answer[1]] == own.convert_ids_to_tokens(own("hello world")["input_ids"])


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/tokenize", {"model": "plain", "prompt": "x"}, "model"),
        ("/tokenize", {"prompt": "x" * 4001}, "prompt"),
        ("/tokenize", {"prompt": "x", "inputs": "y"}, "prompt"),
        ("/detokenize", {"tokens": [10**6]}, "tokens"),
    ],
)
def test_bad_requests_are_400_naming_the_field(server: LiveServer, path: str, body: dict, param: str) -> None:
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
