"""`POST /v1/classify` and `/classify` (vLLM's shape) and `POST /predict` (TEI's shape) on the one request path
(`http/endpoint.py`), as `/v1/embeddings` and `/v1/rerank`: parse the body (`parse.py`, by the route's shape) and
pick a classification model → (the skeleton takes one rate-limit token per input) → each text or pair through
the door as one input (`InferenceService.infer_many`: one admission for the request, each input its own item,
costed by its tokens on the fair queue and counted on the ledger like every other), so the inputs of concurrent
callers share batches → the answer (`render.py`, by the route's shape). Errors in OpenAI's shape."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from starlette.routing import Route

from batchserve.backends.hf import pair_input, single_input
from batchserve.classify.parse import Classify, parse_classify, parse_predict
from batchserve.classify.render import answer, answer_predict
from batchserve.core.fairqueue import ItemResult
from batchserve.http.dialects import OPENAI
from batchserve.http.endpoint import Answer, Call, Endpoint
from batchserve.http.model_choice import CLASSIFICATION, EncoderHost, choose


Parse = Callable[[bytes, int, float], Classify]


@dataclass(slots=True)
class Classified:
    """A parsed request and its inputs as the door takes them."""

    req: Classify
    inputs: list[str]


def parse_request(rt: EncoderHost, call: Call, body: bytes, parse: Parse = parse_classify) -> Classified:
    """`parse`: the route's body shape, vLLM's (`/v1/classify`, the default) or TEI's (`/predict`)."""
    s = rt.settings
    req = parse(body, s.max_input_chars, s.max_timeout_ms)
    choose(rt, call, CLASSIFICATION, req.model, req.timeout_s, req.service_tier)
    inputs = [single_input(seq) if isinstance(seq, str) else pair_input(*seq) for seq in req.sequences]
    return Classified(req, inputs)


async def classify(rt: EncoderHost, call: Call, job: Classified) -> tuple[list[ItemResult], int]:
    """Each input its own item, admitted together, and their tokens."""
    return await rt.service.infer_counted(call.work, job.inputs)


def render(rt: EncoderHost, call: Call, job: Classified, done: tuple[list[ItemResult], int]) -> Answer:
    results, tokens = done
    return Answer(answer([r.output for r in results], call.work.model, tokens))


def render_predict(rt: EncoderHost, call: Call, job: Classified, done: tuple[list[ItemResult], int]) -> Answer:
    results, _ = done
    return Answer(answer_predict([r.output for r in results], job.req.raw_scores, job.req.batch))


classify_endpoint: Endpoint[EncoderHost, Classified, tuple[list[ItemResult], int]] = Endpoint(
    OPENAI, parse_request, classify, render, tokens=lambda job: len(job.inputs)
)
predict_endpoint: Endpoint[EncoderHost, Classified, tuple[list[ItemResult], int]] = Endpoint(
    OPENAI, partial(parse_request, parse=parse_predict), classify, render_predict, tokens=lambda job: len(job.inputs)
)

ROUTES = [
    Route("/v1/classify", classify_endpoint, methods=["POST"]),
    Route("/classify", classify_endpoint, methods=["POST"]),
    Route("/predict", predict_endpoint, methods=["POST"]),
]
