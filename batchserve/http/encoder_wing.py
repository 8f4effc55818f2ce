"""What the wings that score each input on its own share (`/v1/classify`, `/predict`, `/v1/rerank`,
`/v2/rerank`): a parsed request beside the inputs the door takes for it, one run step (every input its own item,
admitted together, and their tokens) and the endpoint on the one request path, one rate-limit token per input."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from batchserve.core.fairqueue import ItemResult
from batchserve.http.dialects import OPENAI
from batchserve.http.endpoint import Answer, Call, Endpoint
from batchserve.http.model_choice import EncoderHost

R = TypeVar("R")
Counted = tuple[list[ItemResult], int]  # each input's result, in input order, and the inputs' tokens


@dataclass(slots=True)
class EncoderJob(Generic[R]):
    """A parsed request and its inputs as the door takes them (texts, or a pair joined as one)."""

    req: R
    inputs: list[str]


Render = Callable[[EncoderJob[R], list[Any], int, str], bytes]  # job, outputs, tokens, model id -> the body


async def run_each(rt: EncoderHost, call: Call, job: EncoderJob[R]) -> Counted:
    """Each input its own item, admitted together, and their tokens."""
    return await rt.service.infer_counted(call.work, job.inputs)


def encoder_endpoint(
    parse: Callable[[EncoderHost, Call, bytes], EncoderJob[R]], render: Render[R]
) -> Endpoint[EncoderHost, EncoderJob[R], Counted]:
    """The endpoint of a route: `render` writes the body from the outputs (in input order), tokens and model id."""

    def answer(rt: EncoderHost, call: Call, job: EncoderJob[R], done: Counted) -> Answer:
        results, tokens = done
        return Answer(render(job, [r.output for r in results], tokens, call.work.model))

    return Endpoint(OPENAI, parse, run_each, answer, tokens=lambda job: len(job.inputs))
