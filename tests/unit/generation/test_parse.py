"""The generation routes' bodies decoded into their declared shapes (`generation/shapes.py`): what a request
becomes, and each refusal's OpenAI `param` and `code` (the server's cases; the live ones with a real model are in
tests/integration/generation/test_routes.py)."""

from __future__ import annotations

import orjson
import pytest

from batchserve.errors import ApiError
from batchserve.generation.parse import parse

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def chat(**kw) -> bytes:
    return orjson.dumps({**CHAT, **kw})


def test_a_chat_request_and_its_defaults():
    r = parse(chat(stop="x", seed=3, stream=True, stream_options={"include_usage": True}), True, 512, 0.7, 0.9)
    assert r.prompt == [{"role": "user", "content": "hi"}] and r.model is None and r.stream and r.include_usage
    assert (r.params.temperature, r.params.top_p, r.params.max_tokens) == (0.7, 0.9, 512)
    assert r.params.stop == ("x",) and r.params.seed == 3 and not r.max_tokens_given
    parts = orjson.dumps(
        {"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    )
    assert parse(parts, True, 512).prompt == [{"role": "system", "content": "ab"}]
    r = parse(chat(max_tokens=3, max_completion_tokens=9000), True, 512)
    assert r.params.max_tokens == 512 and r.max_tokens_given


@pytest.mark.parametrize(
    "prompt,want",
    [
        ("hi", "hi"),
        ([1, 2], [1, 2]),
        (["hi"], "hi"),
        ([[5, 6]], [5, 6]),
    ],
)
def test_completion_prompts(prompt, want):
    assert parse(orjson.dumps({"prompt": prompt}), False, 64).prompt == want


@pytest.mark.parametrize(
    "body,is_chat,param,code",
    [
        (chat(temperature=2.5), True, "temperature", "invalid_value"),
        (chat(top_p=0), True, "top_p", "invalid_value"),
        (chat(max_tokens=0), True, "max_tokens", "invalid_value"),
        (chat(n=2), True, "n", "unsupported_parameter"),
        (chat(stop=["a", "b", "c", "d", "e"]), True, "stop", "invalid_value"),
        (orjson.dumps({"messages": []}), True, "messages", "invalid_value"),
        (orjson.dumps({"messages": [{"role": "wizard", "content": "hi"}]}), True, "messages[0].role", "invalid_value"),
        (orjson.dumps({"messages": [{"role": "user"}]}), True, "messages[0].content", "invalid_value"),
        (
            orjson.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            True,
            "messages[0].content",
            "invalid_value",
        ),
        (chat(logprobs=True), True, "logprobs", "unsupported_parameter"),
        (chat(seed="seven"), True, "seed", "invalid_value"),
        (chat(presence_penalty=1.0), True, "presence_penalty", "unsupported_parameter"),
        (chat(tools=[{"type": "function"}]), True, "tools", "unsupported_parameter"),
        (chat(response_format={"type": "json_object"}), True, "response_format", "unsupported_parameter"),
        (chat(stream_options={"include_usage": True}), True, "stream_options", "invalid_value"),
        (chat(model=""), True, "model", "invalid_value"),
        (b"{nope", True, None, "invalid_json"),
        (orjson.dumps({"prompt": ""}), False, "prompt", "invalid_value"),
        (orjson.dumps({"prompt": []}), False, "prompt", "invalid_value"),
        (orjson.dumps({"prompt": ["a", "b"]}), False, "prompt", "invalid_value"),
        (orjson.dumps({"prompt": [1, "a"]}), False, "prompt", "invalid_value"),
        (orjson.dumps({"prompt": "x", "echo": True}), False, "echo", "unsupported_parameter"),
        (orjson.dumps({"prompt": "x", "best_of": 2}), False, "best_of", "unsupported_parameter"),
    ],
)
def test_refusals_name_the_param(body: bytes, is_chat: bool, param: str | None, code: str):
    with pytest.raises(ApiError) as caught:
        parse(body, is_chat, 512)
    err = caught.value
    assert (err.status, err.param, err.reason) == (400, param, code), err.message
