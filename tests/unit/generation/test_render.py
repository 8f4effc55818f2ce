"""The generation routes' answers (`generation/render.py`) decoded back into their declared shapes
(`generation/shapes.py`): a whole chat and text completion, and the stream's chunks."""

from __future__ import annotations

import msgspec
import orjson
import pytest

from batchserve.generation import shapes
from batchserve.generation.render import ResponseShape, sse


@pytest.mark.parametrize("chat, shape", [(True, shapes.ChatCompletion), (False, shapes.Completion)])
def test_a_whole_answer_is_the_declared_shape(chat: bool, shape: type):
    body = orjson.dumps(ResponseShape(chat, "id1", "m", 7, 5).full("hi", "length", 3))
    answer = msgspec.json.decode(body, type=shape)
    assert (answer.id, answer.model, answer.created) == ("id1", "m", 7)
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == (5, 3, 8)
    choice = answer.choices[0]
    assert (choice.message.content if chat else choice.text) == "hi" and choice.finish_reason == "length"


def test_stream_chunks():
    chat = ResponseShape(True, "c", "m", 1, 2)
    first = chat.chunk("", role=True)["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": ""} and first["finish_reason"] is None
    assert chat.chunk(None, "stop")["choices"][0]["delta"] == {}
    assert chat.chunk("x")["object"] == "chat.completion.chunk"
    text = ResponseShape(False, "t", "m", 1, 2)
    assert text.chunk(None, "stop")["choices"][0] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}
    assert text.usage_chunk(4) | {"usage": None} == {
        "id": "t",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [],
        "usage": None,
    }
    assert text.usage_chunk(4)["usage"]["total_tokens"] == 6
    raw = sse({"a": 1})
    assert raw == b'data: {"a":1}\n\n'
