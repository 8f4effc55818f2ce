"""`POST /v1/rerank` and `/rerank` (Cohere's v1 shape) and `POST /v2/rerank` (Cohere's v2 shape) on the one
request path (`http/endpoint.py`), as `/v1/embeddings`: each (query, document) pair is one input through the door
(one rate-limit token each, one admission for the request), so the pairs of concurrent callers share batches; the
answer sorted by score and cut at top_n. Errors in OpenAI's shape."""

from __future__ import annotations

from functools import partial
from typing import Any

from starlette.routing import Route

from batchserve.backends.hf import pair_input
from batchserve.http.encoder_wing import EncoderJob, encoder_endpoint
from batchserve.http.endpoint import Call
from batchserve.http.model_choice import RERANKING, EncoderHost, choose
from batchserve.rerank.parse import V1, V2, ParsedRerank, Shape, parse
from batchserve.rerank.render import answer, answer_v2


Rerank = EncoderJob[ParsedRerank]  # `inputs`: the (query, document) pairs


def parse_request(rt: EncoderHost, call: Call, body: bytes, shape: Shape = V1) -> Rerank:
    req = parse(body, rt.settings.max_input_chars, rt.settings.max_timeout_ms, shape)
    choose(rt, call, RERANKING, req.model, req.timeout_s, req.service_tier)
    return EncoderJob(req, [pair_input(req.query, doc) for doc in req.documents])


def render(r: Rerank, scores: list[Any], tokens: int, model: str) -> bytes:
    return answer(scores, r.req.documents, r.req.top_n, r.req.return_documents, model, tokens)


rerank = encoder_endpoint(parse_request, render)
rerank_v2 = encoder_endpoint(
    partial(parse_request, shape=V2), lambda r, scores, tokens, model: answer_v2(scores, r.req.top_n, tokens)
)

ROUTES = [
    Route("/v1/rerank", rerank, methods=["POST"]),
    Route("/rerank", rerank, methods=["POST"]),
    Route("/v2/rerank", rerank_v2, methods=["POST"]),
]
