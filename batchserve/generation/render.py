"""The OpenAI answers of the generation routes: a whole chat or text completion (JSON), or its server-sent
event chunks, in the declared shapes (`shapes.ChatCompletion`, `shapes.Completion`). What a request may say is
`parse.py`'s."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass
class ResponseShape:
    """The fixed parts of one response, and how a chunk of text is shaped for this endpoint."""

    chat: bool
    id: str
    model: str
    created: int
    prompt_tokens: int

    @classmethod
    def new(cls, chat: bool, model: str, prompt_tokens: int) -> ResponseShape:
        """A new response's parts: its id (OpenAI's prefix for the endpoint) and creation time."""
        prefix = "chatcmpl-" if chat else "cmpl-"
        return cls(chat, prefix + secrets.token_hex(12), model, int(time.time()), prompt_tokens)

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def full(self, text: str, finish_reason: str, completion_tokens: int) -> dict[str, Any]:
        part = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {
            **self._head("chat.completion" if self.chat else "text_completion", part, finish_reason),
            "usage": self.usage(completion_tokens),
        }

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> dict[str, Any]:
        if not self.chat:
            return self._head("text_completion", {"text": text or ""}, finish_reason)
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        return self._head("chat.completion.chunk", {"delta": delta}, finish_reason)

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj, None), "usage": self.usage(completion_tokens)}

    def _head(self, obj: str, part: dict[str, Any] | None, finish_reason: str | None = None) -> dict[str, Any]:
        """What every answer and chunk of this response starts with, and its one choice (`part`; None: no choice)."""
        choices = [] if part is None else [{"index": 0, **part, "logprobs": None, "finish_reason": finish_reason}]
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"
