"""OpenAI-compatible generation routes: POST /v1/chat/completions and /v1/completions, streamed or not.

The request path: authenticate and rate-limit (the same tenancy as /v1/inference) → parse and validate the
OpenAI body (400 with the offending `param`) → tokenize → `Engine.submit` (KV-cache admission: start now, wait,
or 503) → deltas from the engine, as one JSON answer or as server-sent events ending in `data: [DONE]`.
Errors on these routes use OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, so the official
clients raise their usual exceptions. A caller that hangs up cancels its sequence, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from batchserve import openai_schema
from batchserve.errors import ApiError
from batchserve.http_io import read_body, request_id_of
from batchserve.generation import Delta, Engine, SamplingParams, Sequence

JSON = "application/json"
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options", "ignore_eos"}
ROLES = ("system", "user", "assistant", "developer")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


@dataclass
class OpenAIError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = ""
    headers: dict[str, str] | None = None

    @classmethod
    def from_api(cls, err: ApiError) -> "OpenAIError":
        headers = dict(err.headers or {})
        if err.retry_after_ms is not None:
            headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_ms / 1000)))
        return cls(err.status, err.message, None, err.code.lower(), headers=headers)

    def body(self) -> dict[str, Any]:
        kind = self.type or ERROR_TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param, code)


def error_response(err: OpenAIError, headers: dict[str, str]) -> Response:
    return Response(orjson.dumps(err.body()), status_code=err.status, headers={**headers, **(err.headers or {})},
                    media_type=JSON)


# -- parsing ------------------------------------------------------------------------------------------------
@dataclass
class GenRequest:
    model: str | None
    prompt: list[dict[str, str]] | str | list[int]  # chat messages, text, or token ids
    params: SamplingParams
    stream: bool
    include_usage: bool


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


def parse(body: bytes, chat: bool, max_tokens_cap: int) -> GenRequest:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad(None, f"the body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(data, dict):
        raise bad(None, "the body must be a JSON object", "invalid_json")
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
        token_ids = isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
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
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4
                             or not all(isinstance(s, str) and s for s in stop)):
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
        temperature=_number(data, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(data, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        seed=seed, stop=tuple(stop or ()), ignore_eos=ignore_eos,
    )
    return GenRequest(model, prompt, params, stream, bool(options and options.get("include_usage")))


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
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def full(self, text: str, finish_reason: str, completion_tokens: int) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": self.usage(completion_tokens)}

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [],
                "usage": self.usage(completion_tokens)}


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class SequenceStream(StreamingResponse):
    """A streamed answer that always runs `cleanup` (cancel the sequence if unfinished, count it answered),
    even when the caller hangs up before the first byte is sent."""

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], None], headers: dict[str, str]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()


async def next_or_gone(request: Request, seq: Sequence) -> Delta | None:
    """The sequence's next delta, or None if the caller hung up first."""
    getter = asyncio.ensure_future(seq.deltas.get())
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if getter.done():
        return getter.result()
    getter.cancel()
    return None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# -- routes -------------------------------------------------------------------------------------------------
def engine_of(request: Request) -> Engine | None:
    return getattr(request.app.state.rt, "generation", None)


async def chat_completions(request: Request) -> Response:
    return await generate(request, chat=True)


async def completions(request: Request) -> Response:
    return await generate(request, chat=False)


async def generate(request: Request, chat: bool) -> Response:
    rt = request.app.state.rt
    endpoint = "chat" if chat else "completions"
    request_id = request_id_of(request)
    headers = {"X-Request-ID": request_id}
    engine = engine_of(request)
    try:
        try:
            # OpenAI clients always send a key: with no keys configured, any key is anonymous (as vLLM does)
            caller = rt.tenancy.identify(request.headers.get("authorization") if rt.tenancy.keys else None)
            headers.update(rt.tenancy.take_token(caller))
            body = await read_body(request, rt.settings.max_body_bytes)
        except ApiError as err:
            raise OpenAIError.from_api(err) from None
        except ClientDisconnect:
            return Response(status_code=499)
        if engine is None:
            raise not_serving(rt)
        if rt.draining:
            raise OpenAIError(503, "the server is shutting down; retry on another node", None, "draining",
                              headers={"Retry-After": "1"})
        req = parse(body, chat, engine.cfg.max_tokens)
        if req.model is not None and req.model not in model_aliases(rt, engine):
            raise OpenAIError(404, f"the model '{req.model}' does not exist here (see GET /v1/models)", "model",
                              "model_not_found")
        if chat:
            prompt_ids = engine.encode_chat(req.prompt)  # type: ignore[arg-type]
        else:
            prompt_ids = engine.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        if any(t >= engine.vocab_size for t in prompt_ids):
            raise bad("prompt", "a token id is outside the model's vocabulary")
        try:
            seq = engine.submit(prompt_ids, req.params, tier=caller.tier)
        except ApiError as err:
            if err.status == 503:
                rt.metrics.rejected.labels(err.code).inc()
            raise OpenAIError.from_api(err) from None
    except OpenAIError as err:
        if engine is not None:
            engine.metrics.requests.labels(endpoint, str(err.status)).inc()
        return error_response(err, headers)

    answer = Answer(chat, ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12), engine.cfg.model_id,
                    int(time.time()), len(prompt_ids))
    rt.inflight += 1
    done = False

    def cleanup(status: str) -> None:
        nonlocal done
        if done:
            return
        done = True
        rt.inflight -= 1
        if not seq.finished:
            engine.cancel(seq)
            status = "499"
        engine.metrics.requests.labels(endpoint, status).inc()

    try:
        first = await next_or_gone(request, seq)  # before any byte: a queue timeout can still be a 504
        if first is None:
            cleanup("499")
            return Response(status_code=499)
        if first.error is not None:
            cleanup(str(first.error.status))
            return error_response(OpenAIError.from_api(first.error), headers)
        if req.stream:
            return SequenceStream(stream_events(engine, seq, first, answer, req.include_usage),
                                  lambda: cleanup("200"), headers)
        text, delta = [first.text], first
        while delta.finish_reason is None and delta.error is None:
            nxt = await next_or_gone(request, seq)
            if nxt is None:
                cleanup("499")
                return Response(status_code=499)
            delta = nxt
            text.append(delta.text)
        if delta.error is not None:
            cleanup(str(delta.error.status))
            return error_response(OpenAIError.from_api(delta.error), headers)
        cleanup("200")
        return Response(orjson.dumps(answer.full("".join(text), delta.finish_reason or "stop", seq.tokens)),
                        headers=headers, media_type=JSON)
    except BaseException:
        cleanup("500")
        raise


async def stream_events(engine: Engine, seq: Sequence, first: Delta, answer: Answer,
                        include_usage: bool) -> AsyncIterator[bytes]:
    yield sse(answer.chunk("", role=True) if answer.chat else answer.chunk(""))
    delta = first
    while True:
        if delta.error is not None:
            yield sse(OpenAIError.from_api(delta.error).body())
            break
        if delta.text:
            yield sse(answer.chunk(delta.text))
        if delta.finish_reason is not None:
            yield sse(answer.chunk(None, delta.finish_reason) if answer.chat else answer.chunk("", delta.finish_reason))
            if include_usage:
                yield sse(answer.usage_chunk(seq.tokens))
            break
        delta = await seq.deltas.get()
    yield b"data: [DONE]\n\n"


def generation_disabled(rt: Any) -> bool:
    from batchserve.generation import enabled

    return not enabled(rt.settings)


def not_serving(rt: Any) -> OpenAIError:
    if generation_disabled(rt):
        return OpenAIError(404, "generation is off on this server (start it with --backend smollm2 or "
                                "--generation on)", "model", "model_not_found")
    if rt.startup_error:
        return OpenAIError(503, f"the server failed to start: {rt.startup_error}", None, "startup_failed")
    return OpenAIError(503, "the generation model is still loading", None, "warming_up", headers={"Retry-After": "5"})


def model_aliases(rt: Any, engine: Engine) -> set[str]:
    """Names a client may use for the generation model: its id, and the smollm2 registry ids."""
    names = {engine.cfg.model_id, "HuggingFaceTB/" + engine.cfg.model_id}
    for spec in rt.settings.models:
        if spec.backend == "smollm2":
            names.update({spec.name, spec.id})
    return names


def model_cards(rt: Any) -> list[dict[str, Any]]:
    """Entries for GET /v1/models."""
    engine = getattr(rt, "generation", None)
    if engine is None:
        return []
    return [{"id": engine.cfg.model_id, "object": "model", "created": 0, "owned_by": "batchserve",
             "backend": "smollm2-continuous-batching", "max_tokens": engine.cfg.max_tokens}]


async def generation_status(request: Request) -> Response:
    engine = engine_of(request)
    if engine is None:
        return Response(orjson.dumps({"enabled": generation_disabled(request.app.state.rt) is False,
                                      "ready": False}), media_type=JSON)
    return Response(orjson.dumps({"enabled": True, "ready": True, **engine.stats()}), media_type=JSON)


routes = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/internal/generation", generation_status, methods=["GET"]),
]
openai_schema.register()
