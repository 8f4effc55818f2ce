"""The ASGI app: every wing's routes on one Starlette router, the OpenAPI document built from their
contributions, and the runtime's life (load and warm at start-up, drain and stop at shutdown).

Where the request path lives: `http/inference.py` (POST /v1/inference, top to bottom), `core/service.py`
(the door: admission, the batcher's queue, the deadline), `batcher.py` (which items form the next batch, and
when), `gpu_pool.py` (the worker thread per device that runs it and resolves the futures).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator, Callable

import orjson
from starlette.applications import Starlette
from starlette.datastructures import State
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from batchserve.backends.loading import LoadedModels
from batchserve.config import Settings
from batchserve.embeddings import routes as embeddings_routes
from batchserve.embeddings import schema as embeddings_schema
from batchserve.http.body import internal_error
from batchserve.generation import routes as generation_routes
from batchserve.generation import schema as generation_schema
from batchserve.http import inference, ops, openapi
from batchserve.http import schema as http_schema
from batchserve.jobs import api as jobs_api
from batchserve.jobs import files_api
from batchserve.jobs import schema as jobs_schema
from batchserve.runtime import Runtime

log = logging.getLogger("batchserve")

# The routes and the OpenAPI contribution of each wing, in routing order (inference first: the hot path).
WINGS = (
    (inference.ROUTES, http_schema.INFERENCE),
    (ops.ROUTES, http_schema.OPS),
    (jobs_api.ROUTES + files_api.ROUTES, jobs_schema.OPENAPI),
    (generation_routes.ROUTES, generation_schema.OPENAPI),
    (embeddings_routes.ROUTES, embeddings_schema.OPENAPI),
)


def openapi_document() -> dict:
    return openapi.build(*(contribution for _, contribution in WINGS))


class FastPath:
    """The hot routes (`inference.FAST_ROUTES`) answered ahead of Starlette's middleware and router, which cost
    as much CPU as the rest of a bare endpoint; everything else goes to the Starlette app as usual. The hot
    endpoints render their own errors, so the error middleware has nothing to add for them."""

    def __init__(self, app: Starlette, fast: dict[tuple[str, str], ASGIApp]) -> None:
        self.app = app
        self.fast = fast

    @property
    def state(self) -> State:  # for code that unwraps the app to reach the runtime
        return self.app.state

    @property
    def routes(self) -> list[BaseRoute]:
        return self.app.routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            endpoint = self.fast.get((scope["method"], scope["path"]))
            if endpoint is not None:
                scope["app"] = self.app
                try:
                    await endpoint(scope, receive, send)
                except Exception:  # noqa: BLE001 - as Starlette's ServerErrorMiddleware: log, answer JSON 500
                    log.exception("unhandled error on %s %s", scope["method"], scope["path"])
                    await internal_error(send)
                return
        await self.app(scope, receive, send)


def create_app(settings: Settings, loaded: LoadedModels | None = None,
               on_startup_failure: Callable[[str], None] | None = None) -> FastPath:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        rt = Runtime.create(settings, loaded)
        rt.on_startup_failure = on_startup_failure
        app.state.rt = rt
        starting = asyncio.create_task(rt.start())
        try:
            yield
        finally:
            starting.cancel()
            await rt.stop()

    app = Starlette(routes=[route for routes, _ in WINGS for route in routes], lifespan=lifespan,
                    exception_handlers={HTTPException: ops.http_error, Exception: ops.internal_error})
    app.state.openapi = orjson.dumps(openapi_document())
    return FastPath(app, inference.FAST_ROUTES)
