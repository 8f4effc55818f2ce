"""The OpenAI request and answer shapes of the generation routes: parsing and validating a body (400 with the
offending `param`), and the JSON / SSE answers. Errors are `ApiError`s, in OpenAI's shape by `http/dialects.py`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson

from batchserve.generation.engine import SamplingParams
from batchserve.http.openai_error import JSON, bad, json_object

__all__ = ["JSON", "bad", "parse", "Answer", "sse"]

ROLES = ("system", "user", "assistant", "developer")


# -- parsing ------------------------------------------------------------------------------------------------
@dataclass
class GenRequest:
    model: str | None  # optional: the one generation model served here (curl users leave it out)
    prompt: list[dict[str, str]] | str | list[int]  # chat messages, text, or token ids
    params: SamplingParams
    stream: bool
    include_usage: bool
    max_tokens_given: bool = True  # False: params.max_tokens is the cap, and may shrink to fit the context


def _number(data: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad(name, f"'{name}' must be a number")
    if value < lo or value > hi or (lo_open and value == lo):
        raise bad(name, f"'{name}' must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], not {value!r}")
    return float(value)


def _int(data: dict, name: str) -> int | None:
    value = data.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise bad(name, f"'{name}' must be an integer")
    return value


def _text(content: Any, where: str) -> str:
    """Message content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(where, "only text content parts ({'type': 'text', 'text': ...}) are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(where, "message content must be a string or a list of text parts")


def parse(
    body: bytes, chat: bool, max_tokens_cap: int, default_temperature: float = 1.0, default_top_p: float = 1.0
) -> GenRequest:
    """The body as a request; temperature and top_p left out take the defaults (the model's
    generation_config.json, `engine.SamplingDefaults`)."""
    data = json_object(body)
    model = data.get("model")  # optional: the one generation model served here (curl users leave it out)
    if model is not None and (not isinstance(model, str) or not model):
        raise bad("model", "'model' must be a non-empty string when given (see GET /v1/models)")
    prompt: Any
    if chat:
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad("messages", "'messages' must be a non-empty list of {role, content}")
        prompt = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise bad(f"messages[{i}].role", f"each message needs a role among {', '.join(ROLES)}")
            role = "system" if m["role"] == "developer" else m["role"]
            prompt.append({"role": role, "content": _text(m.get("content"), f"messages[{i}].content")})
        for name in ("tools", "functions", "tool_choice", "function_call"):
            if data.get(name):
                raise bad(name, f"'{name}' is not supported by this server", "unsupported_parameter")
        fmt = data.get("response_format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise bad("response_format", "only response_format {'type': 'text'} is supported", "unsupported_parameter")
    else:
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        token_ids = (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
        )
        if not (isinstance(prompt, str) and prompt) and not token_ids:
            raise bad("prompt", "'prompt' must be a non-empty string or a list of token ids (one prompt per request)")
        for name in ("echo", "suffix"):
            if data.get(name):
                raise bad(name, f"'{name}' is not supported by this server", "unsupported_parameter")
        if data.get("best_of") not in (None, 1):
            raise bad("best_of", "only best_of 1 is supported", "unsupported_parameter")
    if data.get("n") not in (None, 1):
        raise bad("n", "only n = 1 is supported", "unsupported_parameter")
    if data.get("logprobs") not in (None, False) or data.get("top_logprobs") is not None:
        raise bad("logprobs", "logprobs are not supported by this server", "unsupported_parameter")
    if data.get("logit_bias"):
        raise bad("logit_bias", "logit_bias is not supported by this server", "unsupported_parameter")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(data, name, 0.0, -2.0, 2.0) != 0.0:
            raise bad(name, f"'{name}' other than 0 is not supported by this server", "unsupported_parameter")
    max_tokens = _int(data, "max_completion_tokens") if chat else None
    max_tokens = max_tokens if max_tokens is not None else _int(data, "max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise bad("max_tokens", "'max_tokens' must be at least 1")
    stop = data.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop)
    ):
        raise bad("stop", "'stop' must be a non-empty string or a list of at most 4 of them")
    seed = _int(data, "seed")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", "'stream' must be a boolean")
    options = data.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise bad("stream_options", "'stream_options' must be an object, and only with 'stream': true")
    ignore_eos = data.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad("ignore_eos", "'ignore_eos' must be a boolean")
    params = SamplingParams(
        max_tokens=min(max_tokens or max_tokens_cap, max_tokens_cap),
        temperature=_number(data, "temperature", default_temperature, 0.0, 2.0),
        top_p=_number(data, "top_p", default_top_p, 0.0, 1.0, lo_open=True),
        seed=seed,
        stop=tuple(stop or ()),
        ignore_eos=ignore_eos,
    )
    return GenRequest(
        model, prompt, params, stream, bool(options and options.get("include_usage")), max_tokens is not None
    )


# -- answers ------------------------------------------------------------------------------------------------
@dataclass
class Answer:
    """The fixed parts of one response, and how a chunk of text is shaped for this endpoint."""

    chat: bool
    id: str
    model: str
    created: int
    prompt_tokens: int

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def full(self, text: str, finish_reason: str, completion_tokens: int) -> dict[str, Any]:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(completion_tokens),
        }

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self.usage(completion_tokens),
        }


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"
