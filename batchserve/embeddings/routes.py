"""`POST /v1/embeddings` (OpenAI's shape), on the one request path (`http/endpoint.py`): each input goes through
the door as its own item (one admission for the request), so inputs of concurrent callers share batches."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from starlette.routing import Route

from batchserve.backends import Backend
from batchserve.core.fairqueue import ItemResult
from batchserve.embeddings.parse import ParsedEmbedding, parse
from batchserve.embeddings.render import answer
from batchserve.http.dialects import OPENAI
from batchserve.http.endpoint import Answer, Call, Endpoint
from batchserve.http.model_choice import EMBEDDING, EncoderHost, choose

log = logging.getLogger("batchserve.embeddings")

COUNT_INLINE_CHARS = 8192  # token counting of more text than this runs on a thread, beside the inference


async def prompt_tokens(backend: Backend, inputs: list[str], counting: asyncio.Future | None) -> int:
    """usage.prompt_tokens from the backend's tokenizer; 0 when it cannot count (the vectors are still the answer)."""
    try:
        counts = await counting if counting is not None else backend.count_tokens(inputs)
    except Exception:
        log.warning("count_tokens of %s failed", backend.source.name, exc_info=True)
        return 0
    return sum(counts) if counts else 0


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


@dataclass(slots=True)
class Embed:
    """A parsed request and the model version that answers it."""

    req: ParsedEmbedding
    backend: Backend


def parse_request(rt: EncoderHost, call: Call, body: bytes) -> Embed:
    req = parse(body, rt.settings.max_input_chars, rt.settings.max_timeout_ms)
    return Embed(req, choose(rt, call, EMBEDDING, req.model, req.timeout_s, req.service_tier))


async def embed(rt: EncoderHost, call: Call, e: Embed) -> tuple[list[ItemResult], int]:
    """Every input as its own item, admitted together; the prompt tokens counted beside them."""
    inputs = e.req.inputs
    counting = None
    if sum(map(len, inputs)) > COUNT_INLINE_CHARS:
        counting = asyncio.ensure_future(asyncio.to_thread(e.backend.count_tokens, inputs))
        counting.add_done_callback(_retrieve)  # when the request fails first, nobody awaits it
    results = await rt.service.infer_many(call.work, inputs)
    tokens = await prompt_tokens(e.backend, inputs, counting)
    return results, tokens


def render(rt: EncoderHost, call: Call, e: Embed, done: tuple[list[ItemResult], int]) -> Answer:
    results, tokens = done
    return Answer(answer([r.output for r in results], e.req.base64, call.work.model, tokens, e.req.dimensions))


embeddings: Endpoint[EncoderHost, Embed, tuple[list[ItemResult], int]] = Endpoint(
    OPENAI, parse_request, embed, render, tokens=lambda e: len(e.req.inputs)
)

ROUTES = [Route("/v1/embeddings", embeddings, methods=["POST"])]
