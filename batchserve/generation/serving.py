"""One generation request on the one request path (`http/endpoint.py`): parse the OpenAI body, tokenize
(`complete.prepare`), `Engine.submit` (start, wait or 503), then deltas as one JSON answer or server-sent events
ending in `data: [DONE]`. A caller that hangs up cancels its sequence, freeing its KV blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import orjson

from batchserve.config import Settings
from batchserve.core.refusals import RefusalThrottle
from batchserve.core.service import InferenceService
from batchserve.errors import ApiError
from batchserve.generation.complete import prepare
from batchserve.decoding.build import enabled
from batchserve.decoding.engine import Engine
from batchserve.decoding.sequence import Delta, EngineSequence
from batchserve.generation.render import ResponseShape, sse
from batchserve.http.dialects import OPENAI
from batchserve.http.endpoint import Answer, Call, Endpoint, Gone, Stream
from batchserve.http.guards import Guard
from batchserve.http.plumbing import client_host


class GenerationHost(Protocol):
    """What the generation routes read from `app.state.rt` (the runtime, which app.py wires): this much only."""

    settings: Settings
    guard: Guard
    service: InferenceService  # the door: asked only whether the server is open (draining)
    generation: Engine | None  # None until loaded, or when generation is off
    startup_error: str
    refusals: RefusalThrottle  # callers refused often of late wait before their next body is read


async def next_or_gone(call: Call, seq: EngineSequence) -> Delta | None:
    """The sequence's next delta, or None if the caller hung up first."""
    getter = asyncio.ensure_future(seq.deltas.get())
    watcher = asyncio.ensure_future(call.hung_up())
    try:
        await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if getter.done():
        return getter.result()
    getter.cancel()
    return None


def who(call: Call) -> str:
    """Whose refusals count (`core/refusals.py`): a keyed caller's tenant, else the client address."""
    caller = call.caller
    return caller.tenant if caller is not None and caller.key_id else "anonymous@" + client_host(call.scope)


async def throttle(rt: GenerationHost, call: Call) -> None:
    """A caller refused often of late waits before its body is read (the body waits in the socket)."""
    if wait_s := rt.refusals.wait_s(who(call)):
        await asyncio.sleep(wait_s)


def read(rt: GenerationHost, call: Call, body: bytes) -> bytes:
    """The body as read: it is parsed with the prompt's tokenizing (`complete.prepare`, off the loop)."""
    call.work.model = rt.generation.cfg.model_id if rt.generation is not None else "unknown"
    return body


@dataclass(frozen=True)
class EngineBook:
    """Books answers in the engine's metrics and the SLO ledger, and client-side refusals in the throttle."""

    endpoint: str  # "chat" | "completions"

    def ok(self, rt: GenerationHost, call: Call) -> None:  # a sequence books its own outcome (`cleanup`)
        pass

    def refused(self, rt: GenerationHost, call: Call, err: ApiError) -> None:
        rt.guard.counted()
        rt.guard.settle(call.work.model, call.caller, err.status, 0.0)
        if rt.generation is not None:
            rt.generation.metrics.requests.labels(self.endpoint, str(err.status)).inc()
        if 400 <= err.status < 500 and err.status != 429:  # refused for what it sent (429 has its own limit)
            rt.refusals.refused(who(call))

    def gone(self, rt: GenerationHost, call: Call) -> None:
        rt.guard.counted()


async def run(rt: GenerationHost, call: Call, body: bytes, chat: bool) -> Answer | Stream:
    """Tokenize, submit to the engine (KV-cache admission), then the whole answer, or its stream."""
    engine = rt.generation
    if engine is None:
        raise not_serving(rt)
    rt.service.check_open(needs_workers=False)  # the engine is its own worker; draining still refuses
    req, prompt_ids, params = await prepare(rt.settings, engine, body, chat)
    call.run_at(req.service_tier, "service_tier")
    caller = call.who
    try:
        seq = engine.submit(prompt_ids, params, tier=caller.tier, streamed=req.stream, tenant=caller.tenant)
    except ApiError as err:
        if err.status == 503:
            rt.guard.shed(err)  # a refusal for capacity counts as the door's own
        raise
    endpoint = "chat" if chat else "completions"
    model = call.work.model
    answer = ResponseShape.new(chat, engine.cfg.model_id, len(prompt_ids))
    rt.service.hold()
    done = False
    first_s = 0.0  # arrival to the first delta: what the SLO ledger holds a generation answer to

    def cleanup(status: str) -> None:
        nonlocal done
        if done:
            return
        done = True
        call.booked = True
        rt.guard.counted()
        rt.service.release()
        if not seq.finished:
            engine.cancel(seq)
            status = "499"
        engine.metrics.requests.labels(endpoint, status).inc()
        rt.guard.settle(model, caller, int(status), first_s, 1, float(len(prompt_ids) + seq.tokens))

    try:
        first = await next_or_gone(call, seq)  # before any byte: a queue timeout can still be a 504
        first_s = time.monotonic() - call.work.arrived
        if first is None:  # the caller left
            cleanup("499")
            raise Gone()
        if first.error is not None:
            cleanup(str(first.error.status))
            raise first.error
        if req.stream:
            return Stream(stream_events(seq, first, answer, req.include_usage), cleanup)
        cleanup("200")  # not streamed: the one delta is the whole text, at the end
        return Answer(orjson.dumps(answer.full(first.text, first.finish_reason or "stop", seq.tokens)))
    except BaseException:
        cleanup("500")
        raise


async def stream_events(
    seq: EngineSequence, first: Delta, answer: ResponseShape, include_usage: bool
) -> AsyncIterator[bytes]:
    yield sse(answer.chunk("", role=True))  # a text completion's chunk has no role
    delta = first
    while True:
        # Every delta already waiting goes in this one chunk: a loop behind the steps writes once per turn, not
        # once per token (per-chunk sends were a streaming server's largest CPU cost).
        text = delta.text
        while delta.finish_reason is None and delta.error is None and not seq.deltas.empty():
            delta = seq.deltas.get_nowait()
            text += delta.text
        if text:
            yield sse(answer.chunk(text))
        if delta.error is not None:
            yield sse(orjson.loads(OPENAI.error_body(delta.error, "")))
            break
        if delta.finish_reason is not None:
            yield sse(answer.chunk(None, delta.finish_reason))
            if include_usage:
                yield sse(answer.usage_chunk(seq.tokens))
            break
        delta = await seq.deltas.get()
    yield b"data: [DONE]\n\n"


def not_serving(rt: GenerationHost) -> ApiError:
    if not enabled(rt.settings):
        return ApiError(
            404,
            "MODEL_NOT_FOUND",
            "generation is off on this server (start it with --backend smollm2 or --generation on)",
            param="model",
            reason="model_not_found",
        )
    if rt.startup_error:
        return ApiError(
            503, "NO_HEALTHY_WORKER", f"the server failed to start: {rt.startup_error}", reason="startup_failed"
        )
    return ApiError(
        503, "NO_HEALTHY_WORKER", "the generation model is still loading", retry_after_ms=5000, reason="warming_up"
    )


def render(rt: GenerationHost, call: Call, body: bytes, out: Answer | Stream) -> Answer | Stream:
    return out  # `run` makes the answer: a stream's end is booked by its sequence


def endpoint(chat: bool) -> Endpoint[GenerationHost, bytes, Answer | Stream]:
    """POST /v1/chat/completions (`chat`) or /v1/completions on the one request path."""
    name = "chat" if chat else "completions"
    return Endpoint(OPENAI, read, partial(run, chat=chat), render, book=EngineBook(name), before_body=throttle)
