"""The OpenAI-compatible generation endpoints: POST /v1/chat/completions and /v1/completions (streamed or not,
see `serving.py`), and GET /internal/generation. Their declared shapes and operations are in `shapes.py`."""

from __future__ import annotations

from typing import Any

from starlette.routing import Route

from batchserve.decoding.build import enabled
from batchserve.decoding.engine import Engine
from batchserve.generation.serving import GenerationHost, endpoint
from batchserve.http.dialects import NATIVE
from batchserve.http.endpoint import Call, Endpoint, operational


chat_completions = endpoint(chat=True)
completions = endpoint(chat=False)


def model_cards(engine: Engine | None) -> list[dict[str, Any]]:
    """Entries for GET /v1/models."""
    if engine is None:
        return []
    return [
        {
            "id": engine.cfg.model_id,
            "object": "model",
            "created": 0,
            "owned_by": "batchserve",
            "backend": f"{engine.cfg.backend}-continuous-batching",
            "max_tokens": engine.cfg.max_tokens,
        }
    ]


async def generation_status(rt: GenerationHost, call: Call, req: None) -> dict[str, Any]:
    engine = rt.generation
    if engine is None:
        return {"enabled": enabled(rt.settings), "ready": False}
    return {"enabled": True, "ready": True, **engine.stats()}


status: Endpoint[GenerationHost, None, dict[str, Any]] = operational(NATIVE, generation_status)


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/internal/generation", status, methods=["GET"]),
]
