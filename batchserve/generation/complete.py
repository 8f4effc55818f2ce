"""The non-HTTP part of a generation request, shared by the online route (`serving.py`) and the lines of an
OpenAI batch (`jobs/lines.py`), so a batch line gets exactly the body the route would send: parse the OpenAI
body → check the model → size the prompt → tokenize (off the event loop) → the default max_tokens.
`complete` then runs one non-streamed sequence through `Engine.submit` (the same KV-cache admission).
"""

from __future__ import annotations

import dataclasses
from typing import cast

import orjson

from batchserve.config import Settings
from batchserve.decoding.engine import Engine
from batchserve.decoding.stepper import SamplingParams
from batchserve.generation.parse import GenRequest, parse
from batchserve.generation.render import ResponseShape
from batchserve.http.openai_error import bad, unknown_model


async def prepare(
    settings: Settings, engine: Engine, body: bytes, chat: bool
) -> tuple[GenRequest, list[int], SamplingParams]:
    """The parsed body, its prompt ids and sampling for `Engine.submit`; or the ApiError (4xx) the route answers."""
    defaults = engine.cfg.defaults
    req = parse(body, chat, engine.cfg.max_tokens, defaults.temperature, defaults.top_p)
    if req.model is not None and req.model not in model_aliases(settings, engine):
        raise unknown_model(req.model)
    if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], int):
        prompt_ids = list(req.prompt)
    else:
        # The size first, on characters (cheap), then the tokenizer, off the event loop.
        text = cast("list[dict[str, str]] | str", req.prompt)  # not token ids: those went above
        engine.check_prompt_chars(prompt_chars(text), req.params.max_tokens if req.max_tokens_given else 1)
        prompt_ids = await engine.tokenize(text)
    if any(t >= engine.vocab_size for t in prompt_ids):
        raise bad("prompt", "a token id is outside the model's vocabulary")
    params = req.params
    if not req.max_tokens_given and 0 < engine.max_context - len(prompt_ids) < params.max_tokens:
        # as OpenAI does: without max_tokens the answer may run to the end of the context
        params = dataclasses.replace(params, max_tokens=engine.max_context - len(prompt_ids))
    return req, prompt_ids, params


async def complete(
    settings: Settings,
    engine: Engine,
    body: bytes,
    chat: bool,
    tier: int,
    tenant: str = "",
    max_wait_s: float | None = None,
) -> bytes:
    """The non-streamed answer's JSON for `body`, as the route sends it, in `tenant`'s share; `max_wait_s`:
    how long it may wait in the engine's queue for capacity (a batch line: until its window closes).

    Raises ApiError: a 4xx for what the route answers with one (running it again cannot help), else the
    engine's (503 no KV capacity now, 504 waited too long, draining, 500): a batch line's caller retries those
    later rather than failing the line. Cancelling the caller frees the sequence's KV blocks.
    """
    req, prompt_ids, params = await prepare(settings, engine, body, chat)
    if req.stream:
        raise bad("stream", "a batch line is answered whole; leave out 'stream'")
    seq = engine.submit(prompt_ids, params, tier=tier, streamed=False, tenant=tenant, max_wait_s=max_wait_s)
    answer = ResponseShape.new(chat, engine.cfg.model_id, len(prompt_ids))
    try:
        delta = await seq.deltas.get()  # not streamed: one delta, the whole text, at the end
        if delta.error is not None:
            raise delta.error
        return orjson.dumps(answer.full(delta.text, delta.finish_reason or "stop", seq.tokens))
    finally:
        if not seq.finished:
            engine.cancel(seq, "batch_cancelled")


def prompt_chars(prompt: list[dict[str, str]] | str) -> int:
    """Characters of a text prompt, or of every message's content of a chat."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(m.get("content") or "") for m in prompt)


def model_aliases(settings: Settings, engine: Engine) -> set[str]:
    """Names a client may use for the generation model: its id, and the registry ids of the generating model."""
    names = {engine.cfg.model_id, "HuggingFaceTB/" + engine.cfg.model_id}
    for spec in settings.models:
        if spec.generates:
            names.update({spec.name, spec.id})
    return names
