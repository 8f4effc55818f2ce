"""`POST /v1/classify` and `/classify` (vLLM's shape) and `POST /predict` (TEI's shape) on the one request path
(`http/endpoint.py`), as `/v1/embeddings` and `/v1/rerank`: each text or pair is one input through the door (one
rate-limit token each, one admission for the request), so the inputs of concurrent callers share batches. Errors
in OpenAI's shape."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from starlette.routing import Route

from batchserve.backends.hf import pair_input, single_input
from batchserve.classify.parse import Classify, parse_classify, parse_predict
from batchserve.classify.render import answer, answer_predict
from batchserve.http.encoder_wing import EncoderJob, encoder_endpoint
from batchserve.http.endpoint import Call
from batchserve.http.model_choice import CLASSIFICATION, EncoderHost, choose


Parse = Callable[[bytes, int, float], Classify]


def parse_request(rt: EncoderHost, call: Call, body: bytes, parse: Parse = parse_classify) -> EncoderJob[Classify]:
    """`parse`: the route's body shape, vLLM's (`/v1/classify`, the default) or TEI's (`/predict`)."""
    req = parse(body, rt.settings.max_input_chars, rt.settings.max_timeout_ms)
    choose(rt, call, CLASSIFICATION, req.model, req.timeout_s, req.service_tier)
    inputs = [single_input(seq) if isinstance(seq, str) else pair_input(*seq) for seq in req.sequences]
    return EncoderJob(req, inputs)


classify_endpoint = encoder_endpoint(parse_request, lambda job, outputs, tokens, model: answer(outputs, model, tokens))
predict_endpoint = encoder_endpoint(
    partial(parse_request, parse=parse_predict),
    lambda job, outputs, tokens, model: answer_predict(outputs, job.req.raw_scores, job.req.batch),
)

ROUTES = [
    Route("/v1/classify", classify_endpoint, methods=["POST"]),
    Route("/classify", classify_endpoint, methods=["POST"]),
    Route("/predict", predict_endpoint, methods=["POST"]),
]
