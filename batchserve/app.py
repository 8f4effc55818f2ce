"""The ASGI app: every wing's routes on one Starlette router, the OpenAPI document built from their
declared operations, and the runtime's life (load and warm at start-up, drain and stop at shutdown).

Where the request path lives: `inference/routes.py` (POST /v1/inference, top to bottom), `core/service.py`
(the door: admission, the batcher's queue, the deadline), `core/batcher.py` (which items form the next batch, and
when), `gpu_pool.py` (the worker thread per device that runs it and resolves the futures).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping

import orjson
from starlette.applications import Starlette
from starlette.datastructures import State
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from batchserve.backends.loading import LoadedModels
from batchserve.classify import routes as classify_routes
from batchserve.classify import shapes as classify_shapes
from batchserve.config import Settings
from batchserve.embeddings import routes as embeddings_routes
from batchserve.embeddings import shapes as embeddings_shapes
from batchserve.http.dialects import http_error, internal_error, unexpected_error
from batchserve.http.endpoint import Endpoint
from batchserve.generation import routes as generation_routes
from batchserve.generation import shapes as generation_shapes
from batchserve.http import docs_page, openapi, usage
from batchserve.inference import routes as inference
from batchserve.inference import shapes as inference_shapes
from batchserve.jobs import file_routes
from batchserve.jobs import routes as jobs_routes
from batchserve.jobs import shapes as jobs_shapes
from batchserve.kserve import routes as kserve_routes
from batchserve.kserve import shapes as kserve_shapes
from batchserve.logsafe import printable
from batchserve.ops import routes as ops
from batchserve.ops import shapes as ops_shapes
from batchserve.rerank import routes as rerank_routes
from batchserve.rerank import shapes as rerank_shapes
from batchserve.tokenize import routes as tokenize_routes
from batchserve.tokenize import shapes as tokenize_shapes
from batchserve.runtime import Runtime
from batchserve.tracing import RequestSpans, Tracing

log = logging.getLogger("batchserve")

# The routes and the declared operations of each wing, in routing order (inference first: the hot path).
WINGS = (
    (inference.ROUTES, inference_shapes.OPERATIONS),
    (ops.ROUTES, ops_shapes.OPERATIONS),
    (jobs_routes.ROUTES + file_routes.ROUTES, jobs_shapes.OPERATIONS),
    (generation_routes.ROUTES, generation_shapes.OPERATIONS),
    (embeddings_routes.ROUTES, embeddings_shapes.OPERATIONS),
    (rerank_routes.ROUTES, rerank_shapes.OPERATIONS),
    (classify_routes.ROUTES, classify_shapes.OPERATIONS),
    (tokenize_routes.ROUTES, tokenize_shapes.OPERATIONS),
    (kserve_routes.ROUTES, kserve_shapes.OPERATIONS),
    (usage.ROUTES, usage.OPERATIONS),
    (docs_page.ROUTES, docs_page.OPERATIONS),
)


class AppState(State):
    """Starlette's `app.state`, each value also kept as a plain attribute. Every request reads `app.state.rt`, and
    State's `__getattr__` runs only after the ordinary lookup has raised an AttributeError (about 1 % of the
    inference route's CPU); in the instance's own `__dict__` the read is an ordinary attribute's."""

    def __setattr__(self, key: str, value: object) -> None:
        super().__setattr__(key, value)  # State's own dict, as Starlette and its users expect
        object.__setattr__(self, key, value)

    def __delattr__(self, key: str) -> None:
        super().__delattr__(key)
        object.__delattr__(self, key)


def openapi_document() -> dict:
    """/openapi.json, generated from the declared shapes of the mounted routes (`http/openapi.py`)."""
    return openapi.build((op for _, declared in WINGS for op in declared), also_documented=jobs_shapes.ALSO_DOCUMENTED)


class FastPath:
    """Every route on the skeleton answered ahead of Starlette's middleware and router, which cost as much CPU as
    the rest of a bare endpoint; everything else goes to the Starlette app. An `Endpoint` renders its own errors,
    so the error middleware has nothing to add for it."""

    def __init__(
        self,
        app: Starlette,
        fast: Mapping[tuple[str, str], ASGIApp],
        patterns: tuple[Callable[[str, str], ASGIApp | None], ...] = (),
    ) -> None:
        self.app = app
        self.fast = fast
        self.patterns = patterns  # (method, path) -> endpoint or None: hot routes with path parameters

    @property
    def state(self) -> State:  # for code that unwraps the app to reach the runtime
        return self.app.state

    @property
    def routes(self) -> list[BaseRoute]:
        return self.app.routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        app: ASGIApp = self.app
        if scope["type"] == "http":
            endpoint = self.fast.get((scope["method"], scope["path"]))
            if endpoint is None:
                for match in self.patterns:
                    if (endpoint := match(scope["method"], scope["path"])) is not None:
                        break
            if endpoint is not None:
                scope["app"] = self.app
                app = endpoint
        try:
            await app(scope, receive, send)
        except Exception:  # as Starlette's ServerErrorMiddleware: log, answer JSON 500
            if scope["type"] != "http":
                raise
            # Starlette re-raises after its own 500 and uvicorn would then close the connection, resetting a request
            # already sent on it (keep-alive). Logged here instead, the connection lives on.
            log.exception("unhandled error on %s %s", scope["method"], printable(scope["path"]))
            await internal_error(send)  # when nothing was answered yet; nothing when it was


def fast_routes(routes: list[BaseRoute]) -> dict[tuple[str, str], ASGIApp]:
    """(method, path) -> endpoint of every `Endpoint` route at a path with no parameters, so a new wing's routes
    take the fast path by construction (HEAD stays with Starlette, which answers it from GET)."""
    return {
        (method, route.path): route.endpoint
        for route in routes
        if isinstance(route, Route) and isinstance(route.endpoint, Endpoint) and not route.param_convertors
        for method in route.methods or ()
        if method != "HEAD"
    }


def create_app(
    settings: Settings, loaded: LoadedModels | None = None, on_startup_failure: Callable[[str, int], None] | None = None
) -> FastPath | RequestSpans:
    """The app; wrapped in a span per request when OpenTelemetry is on."""
    tracing = Tracing.from_env()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        rt = Runtime.create(settings, loaded)
        rt.on_startup_failure = on_startup_failure
        rt.tracing = rt.service.tracing = tracing
        app.state.rt = rt
        starting = asyncio.create_task(rt.start())
        grpc_server = None
        if settings.grpc_port >= 0:  # its port opens with the HTTP one: health answers while the models warm
            from batchserve.kserve.grpc_service import start_grpc  # grpc loads only when it is asked for

            grpc_server, _ = await start_grpc(rt, settings.host, settings.grpc_port)
        try:
            yield
        finally:
            starting.cancel()
            if grpc_server is not None:
                await grpc_server.stop(grace=1.0)
            await rt.stop()
            if tracing is not None:
                await asyncio.to_thread(tracing.shutdown)  # export the last spans (the SDK blocks on it)

    app = Starlette(
        routes=[route for routes, _ in WINGS for route in routes],
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error, Exception: unexpected_error},
    )
    # No 307 to the path without its trailing slash: Starlette builds that Location from the caller's Host
    # header (an open redirect off any proxy that passes Host through). A 404 that names the path instead.
    app.router.redirect_slashes = False
    app.state = AppState()
    app.state.openapi = orjson.dumps(openapi_document())
    fast = FastPath(app, fast_routes(app.routes), (kserve_routes.fast_route,))
    return RequestSpans(fast, tracing) if tracing is not None else fast
