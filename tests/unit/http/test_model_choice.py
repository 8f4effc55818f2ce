"""Which model answers a request for embeddings or reranking (`http/model_choice.py`), one function for
/v1/embeddings, /v1/rerank and OpenAI batches of embeddings lines: the one named, or the first served that does
the work; each refusal with its status, `param` and OpenAI's code."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from batchserve.config import ModelSpec
from batchserve.http.model_choice import ModelRegistry, CLASSIFICATION, EMBEDDING, RERANKING, Task, pick_model
from batchserve.errors import ApiError


@dataclass
class Rt:
    registry: ModelRegistry
    backends: dict[str, Any] = field(default_factory=dict)


def rt(*specs: tuple[ModelSpec, str | None]) -> Rt:
    """A runtime of these versions, each with a loaded backend of that output kind (None: still warming)."""
    return Rt(
        ModelRegistry([s for s, _ in specs]),
        {s.id: SimpleNamespace(output_kind=kind) for s, kind in specs if kind is not None},
    )


ECHO, EMBED, EMBED2 = ModelSpec("echo", backend="sim"), ModelSpec("embed"), ModelSpec("embed2")
RR = ModelSpec("rr", task="reranking")
CLF = ModelSpec("clf", task="classification")


@pytest.mark.parametrize(
    "task, requested, want",
    [
        (EMBEDDING, None, "embed@v1"),  # the first that embeds, though echo is configured first
        (EMBEDDING, "embed2", "embed2@v1"),
        (EMBEDDING, "embed2@v1", "embed2@v1"),
        (RERANKING, None, "rr@v1"),
        (RERANKING, "rr", "rr@v1"),
        (CLASSIFICATION, None, "clf@v1"),
    ],
)
def test_the_named_model_or_the_first_that_does_the_work(task: Task, requested: str | None, want: str):
    runtime = rt((ECHO, "json"), (EMBED, "embedding"), (EMBED2, "embedding"), (RR, "json"), (CLF, "json"))
    model_id, backend = pick_model(runtime, task, requested, "key")
    assert model_id == want and backend is runtime.backends[want]


@pytest.mark.parametrize(
    "task, specs, requested, status, reason, words",
    [
        (EMBEDDING, [(ECHO, "json")], None, 404, "model_not_found", "no model serves embeddings"),
        (EMBEDDING, [(EMBED, None)], None, 503, None, "warming up"),  # none loaded yet: it may be the embedder
        (EMBEDDING, [(ECHO, "json"), (EMBED, None)], None, 503, None, "warming up"),
        (
            EMBEDDING,
            [(ModelSpec("lm", backend="hf", task="generation"), None)],
            None,
            404,
            "model_not_found",
            "no model serves embeddings",
        ),  # a folder read as a causal LM will not embed, loaded or not
        (RERANKING, [(ECHO, "json")], None, 404, "model_not_found", "no model serves reranking"),
        (EMBEDDING, [(EMBED, "embedding")], "nope", 404, "model_not_found", "'nope' does not exist here"),
        (
            EMBEDDING,
            [(ECHO, "json"), (EMBED, "embedding")],
            "echo",
            400,
            "model_not_embedding",
            "the model 'echo@v1' does not produce embeddings (its outputs are json)",
        ),
        (RERANKING, [(ECHO, "json"), (RR, "json")], "echo", 400, "model_not_reranker", "'echo@v1' does not rerank"),
        (CLASSIFICATION, [(RR, "json")], None, 404, "model_not_found", "no model serves classification"),
        (CLASSIFICATION, [(RR, "json"), (CLF, "json")], "rr", 400, "model_not_classifier", "'rr@v1' does not classify"),
        (RERANKING, [(CLF, "json")], None, 404, "model_not_found", "no model serves reranking"),
        (EMBEDDING, [(EMBED, None)], "embed", 503, None, "warming up"),
        (RERANKING, [(RR, None)], "rr", 503, None, "warming up"),
    ],
)
def test_refusals(task: Task, specs: list, requested: str | None, status: int, reason: str | None, words: str):
    with pytest.raises(ApiError) as caught:
        pick_model(rt(*specs), task, requested, "key")
    err = caught.value
    assert (err.status, err.reason) == (status, reason) and words in err.message, err
    assert err.param == ("model" if status != 503 else None)
