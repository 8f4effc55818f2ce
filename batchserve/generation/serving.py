"""One generation request's walk: authenticate and rate-limit (the same tenancy as /v1/inference) → the door
is open (not draining) → parse the OpenAI body → tokenize (`complete.prepare`, shared with batch lines) →
`Engine.submit` (KV-cache admission: start now, wait, or 503) → deltas from the engine, as one JSON answer or
as server-sent events ending in `data: [DONE]`. A caller that hangs up cancels its sequence, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Protocol
from collections.abc import AsyncIterator, Callable

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from batchserve.config import Settings
from batchserve.errors import ApiError
from batchserve.generation.complete import prepare
from batchserve.core.refusals import RefusalThrottle
from batchserve.core.service import InferenceService
from batchserve.generation.engine import Delta, Engine, Sequence, enabled
from batchserve.generation.wire import JSON, Answer, OpenAIError, error_response, sse
from batchserve.http.plumbing import client_host, read_body, request_id_of
from batchserve.http.guards import Guard
from batchserve.tenancy import Caller


class GenerationHost(Protocol):
    """What the generation routes read from `app.state.rt` (the runtime, which app.py wires): this much only."""

    settings: Settings
    guard: Guard
    service: InferenceService  # the door: asked only whether the server is open (draining)
    generation: Engine | None  # None until loaded, or when generation is off
    startup_error: str
    refusals: RefusalThrottle  # callers refused often of late wait before their next body is read


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


async def generate(request: Request, chat: bool) -> Response:
    rt: GenerationHost = request.app.state.rt
    endpoint = "chat" if chat else "completions"
    request_id = request_id_of(request)
    headers = {"X-Request-ID": request_id}
    engine = rt.generation
    who = "anonymous@" + client_host(request.scope)  # whose refusals count (`core/refusals.py`)
    arrived = time.monotonic()
    model = engine.cfg.model_id if engine is not None else "unknown"
    caller: Caller | None = None  # known once identified: a 429 or 503 is booked to it (the SLO ledger)
    try:
        try:
            guard = rt.guard
            caller = guard.identify(request.headers.get("authorization"), request.scope, openai=True)
            limits = guard.take(caller)
            who = caller.tenant if caller.key_id else who
            if wait_s := rt.refusals.wait_s(who):  # refused often of late: its body waits in the socket
                await asyncio.sleep(wait_s)
            headers.update(limits)
            body = await read_body(request, rt.settings.max_body_bytes)
        except ApiError as err:
            raise OpenAIError.from_api(err) from None
        except ClientDisconnect:
            return Response(status_code=499)
        if engine is None:
            raise not_serving(rt)
        try:
            rt.service.check_open(needs_workers=False)  # the engine is its own worker; draining still refuses
        except ApiError as err:
            raise OpenAIError.from_api(err) from None
        prep = await prepare(rt.settings, engine, body, chat)
        req, prompt_ids, params = prep.req, prep.prompt_ids, prep.params
        try:
            seq = engine.submit(prompt_ids, params, tier=caller.tier, streamed=req.stream, tenant=caller.tenant)
        except ApiError as err:
            if err.status == 503:
                rt.guard.shed(err)
            raise OpenAIError.from_api(err) from None
    except OpenAIError as err:
        rt.guard.counted()
        rt.guard.settle(model, caller, err.status, 0.0)
        if engine is not None:
            engine.metrics.requests.labels(endpoint, str(err.status)).inc()
        if 400 <= err.status < 500 and err.status != 429:  # refused for what it sent (429 has its own limit)
            rt.refusals.refused(who)
        return error_response(err, headers)

    answer = Answer(
        chat,
        ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12),
        engine.cfg.model_id,
        int(time.time()),
        len(prompt_ids),
    )
    rt.service.hold()
    done = False
    first_s = 0.0  # arrival to the first delta: what the SLO ledger holds a generation answer to

    def cleanup(status: str) -> None:
        nonlocal done
        if done:
            return
        done = True
        rt.guard.counted()
        rt.service.release()
        if not seq.finished:
            engine.cancel(seq)
            status = "499"
        engine.metrics.requests.labels(endpoint, status).inc()
        rt.guard.settle(model, caller, int(status), first_s, 1, float(len(prompt_ids) + seq.tokens))

    try:
        first = await next_or_gone(request, seq)  # before any byte: a queue timeout can still be a 504
        first_s = time.monotonic() - arrived
        if first is None:
            cleanup("499")
            return Response(status_code=499)
        if first.error is not None:
            cleanup(str(first.error.status))
            return error_response(OpenAIError.from_api(first.error), headers)
        if req.stream:
            return SequenceStream(stream_events(seq, first, answer, req.include_usage), lambda: cleanup("200"), headers)
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
        return Response(
            orjson.dumps(answer.full("".join(text), delta.finish_reason or "stop", seq.tokens)),
            headers=headers,
            media_type=JSON,
        )
    except BaseException:
        cleanup("500")
        raise


async def stream_events(seq: Sequence, first: Delta, answer: Answer, include_usage: bool) -> AsyncIterator[bytes]:
    yield sse(answer.chunk("", role=True) if answer.chat else answer.chunk(""))
    delta = first
    while True:
        # Every delta already waiting goes in this one chunk: when the loop falls behind the steps, each stream
        # writes once per turn of the loop rather than once per token (a write and its ASGI send stack per
        # chunk were the largest share of a streaming server's CPU).
        text = delta.text
        while delta.finish_reason is None and delta.error is None and not seq.deltas.empty():
            delta = seq.deltas.get_nowait()
            text += delta.text
        if text:
            yield sse(answer.chunk(text))
        if delta.error is not None:
            yield sse(OpenAIError.from_api(delta.error).body())
            break
        if delta.finish_reason is not None:
            yield sse(answer.chunk(None, delta.finish_reason) if answer.chat else answer.chunk("", delta.finish_reason))
            if include_usage:
                yield sse(answer.usage_chunk(seq.tokens))
            break
        delta = await seq.deltas.get()
    yield b"data: [DONE]\n\n"


def not_serving(rt: GenerationHost) -> OpenAIError:
    if not enabled(rt.settings):
        return OpenAIError(
            404,
            "generation is off on this server (start it with --backend smollm2 or --generation on)",
            "model",
            "model_not_found",
        )
    if rt.startup_error:
        return OpenAIError(503, f"the server failed to start: {rt.startup_error}", None, "startup_failed")
    return OpenAIError(503, "the generation model is still loading", None, "warming_up", headers={"Retry-After": "5"})
