"""The OpenAI-compatible generation endpoints: POST /v1/chat/completions and /v1/completions (streamed or not,
see `serving.py`), and GET /internal/generation. Their OpenAPI paths are in `schema.py`."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from batchserve.generation.engine import Engine, enabled
from batchserve.generation.wire import JSON
from batchserve.generation.serving import GenerationHost, endpoint
from batchserve.http.guards import operational


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
            "backend": "smollm2-continuous-batching",
            "max_tokens": engine.cfg.max_tokens,
        }
    ]


async def generation_status(request: Request) -> Response:
    rt: GenerationHost = request.app.state.rt
    engine = rt.generation
    if engine is None:
        return Response(orjson.dumps({"enabled": enabled(rt.settings), "ready": False}), media_type=JSON)
    return Response(orjson.dumps({"enabled": True, "ready": True, **engine.stats()}), media_type=JSON)


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/internal/generation", operational(generation_status), methods=["GET"]),
]
