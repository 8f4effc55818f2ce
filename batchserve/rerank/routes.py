"""`POST /v1/rerank` and `/rerank` (Cohere's v1 shape) and `POST /v2/rerank` (Cohere's v2 shape) on the one
request path (`http/endpoint.py`), as `/v1/embeddings`: parse the body (`parse.py`, by the route's shape) and
pick a reranking model → (the skeleton takes one rate-limit token per document) → each (query, document) pair
through the door as one input (`InferenceService.infer_many`: one admission for the request, each pair its own
item), so the pairs of concurrent callers share batches → sort by score, cut at top_n (`render.py`, by the
route's shape). Errors in OpenAI's shape."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from starlette.routing import Route

from batchserve.backends.hf import pair_input
from batchserve.core.fairqueue import ItemResult
from batchserve.http.dialects import OPENAI
from batchserve.http.endpoint import Answer, Call, Endpoint
from batchserve.http.model_choice import RERANKING, EncoderHost, choose
from batchserve.rerank.parse import V1, V2, ParsedRerank, Shape, parse
from batchserve.rerank.render import answer, answer_v2


@dataclass(slots=True)
class Rerank:
    """A parsed request and its (query, document) pairs."""

    req: ParsedRerank
    pairs: list[str]


def parse_request(rt: EncoderHost, call: Call, body: bytes, shape: Shape = V1) -> Rerank:
    s = rt.settings
    req = parse(body, s.max_input_chars, s.max_timeout_ms, shape)
    choose(rt, call, RERANKING, req.model, req.timeout_s, req.service_tier)
    pairs = [pair_input(req.query, doc) for doc in req.documents]
    return Rerank(req, pairs)


async def score(rt: EncoderHost, call: Call, r: Rerank) -> tuple[list[ItemResult], int]:
    """Each pair its own item, admitted together, and their tokens."""
    return await rt.service.infer_counted(call.work, r.pairs)


def render(rt: EncoderHost, call: Call, r: Rerank, done: tuple[list[ItemResult], int]) -> Answer:
    results, tokens = done
    req = r.req
    return Answer(
        answer([x.output for x in results], req.documents, req.top_n, req.return_documents, call.work.model, tokens)
    )


def render_v2(rt: EncoderHost, call: Call, r: Rerank, done: tuple[list[ItemResult], int]) -> Answer:
    results, tokens = done
    return Answer(answer_v2([x.output for x in results], r.req.top_n, tokens))


rerank: Endpoint[EncoderHost, Rerank, tuple[list[ItemResult], int]] = Endpoint(
    OPENAI, parse_request, score, render, tokens=lambda r: len(r.pairs)
)
rerank_v2: Endpoint[EncoderHost, Rerank, tuple[list[ItemResult], int]] = Endpoint(
    OPENAI, partial(parse_request, shape=V2), score, render_v2, tokens=lambda r: len(r.pairs)
)

ROUTES = [
    Route("/v1/rerank", rerank, methods=["POST"]),
    Route("/rerank", rerank, methods=["POST"]),
    Route("/v2/rerank", rerank_v2, methods=["POST"]),
]
