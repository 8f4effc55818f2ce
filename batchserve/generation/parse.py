"""The body of `POST /v1/chat/completions` and `/v1/completions`, decoded into its declared shape (`shapes.py`)
and checked: 400 in OpenAI's shape naming the offending `param`. Shared by the routes and by OpenAI batch lines
(`generation/complete.py`). What the answer looks like is `render.py`'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from batchserve.errors import ApiError
from batchserve.generation import shapes
from batchserve.decoding.stepper import SamplingParams
from batchserve.http.plumbing import decode
from batchserve.http.openai_error import bad, refused


@dataclass
class GenRequest:
    model: str | None  # optional: the one generation model served here (curl users leave it out)
    prompt: list[dict[str, str]] | str | list[int]  # chat messages, text, or token ids
    params: SamplingParams
    stream: bool
    include_usage: bool
    max_tokens_given: bool = True  # False: params.max_tokens is the cap, and may shrink to fit the context
    service_tier: str | None = None  # the priority it asks for (`Work.ask`)


_CHAT = msgspec.json.Decoder(shapes.ChatCompletionRequest)
_COMPLETION = msgspec.json.Decoder(shapes.CompletionRequest)


def _unsupported(name: str, message: str) -> ApiError:
    return bad(name, message, "unsupported_parameter")


def parse(
    body: bytes, chat: bool, max_tokens_cap: int, default_temperature: float = 1.0, default_top_p: float = 1.0
) -> GenRequest:
    """The body decoded into its declared shape (`shapes.ChatCompletionRequest` / `CompletionRequest`), then
    the checks types cannot say: the parameters this server does not do, one prompt per request. Temperature and
    top_p left out take the defaults (the model's generation_config.json, `decoding.build.SamplingDefaults`)."""
    req: shapes.ChatCompletionRequest | shapes.CompletionRequest = (
        decode(_CHAT, body, refused) if chat else decode(_COMPLETION, body, refused)
    )
    prompt: Any
    max_tokens = req.max_tokens
    if isinstance(req, shapes.ChatCompletionRequest):
        prompt = [
            {"role": "system" if m.role == "developer" else m.role, "content": _text(m.content)} for m in req.messages
        ]
        for name in ("tools", "functions", "tool_choice", "function_call"):
            if getattr(req, name):
                raise _unsupported(name, f"'{name}' is not supported by this server")
        if req.response_format is not None and req.response_format.type != "text":
            raise _unsupported("response_format", "only response_format {'type': 'text'} is supported")
        if req.max_completion_tokens is not None:
            max_tokens = req.max_completion_tokens
    else:
        prompt = req.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list) and not (prompt and all(isinstance(t, int) for t in prompt)):
            raise bad("prompt", "'prompt' must be a non-empty string or a list of token ids (one prompt per request)")
        for name in ("echo", "suffix"):
            if getattr(req, name):
                raise _unsupported(name, f"'{name}' is not supported by this server")
        if req.best_of not in (None, 1):
            raise _unsupported("best_of", "only best_of 1 is supported")
    if req.n not in (None, 1):
        raise _unsupported("n", "only n = 1 is supported")
    if req.logprobs not in (None, False) or req.top_logprobs is not None:
        raise _unsupported("logprobs", "logprobs are not supported by this server")
    if req.logit_bias:
        raise _unsupported("logit_bias", "logit_bias is not supported by this server")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0):
            raise _unsupported(name, f"'{name}' other than 0 is not supported by this server")
    if req.stream_options is not None and not req.stream:
        raise bad("stream_options", "'stream_options' must be an object, and only with 'stream': true")
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    params = SamplingParams(
        max_tokens=min(max_tokens or max_tokens_cap, max_tokens_cap),
        temperature=default_temperature if req.temperature is None else req.temperature,
        top_p=default_top_p if req.top_p is None else req.top_p,
        seed=req.seed,
        stop=tuple(stop or ()),
        ignore_eos=req.ignore_eos,
    )
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return GenRequest(req.model, prompt, params, req.stream, include_usage, max_tokens is not None, req.service_tier)


def _text(content: str | list[shapes.ContentPart]) -> str:
    """Message content: a string, or a list of text parts."""
    return content if isinstance(content, str) else "".join(part.text for part in content)
