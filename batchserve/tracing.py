"""OpenTelemetry traces (docs/contract.md#observability), with the standard SDK and its OTLP/HTTP exporter, on only when
`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set.

Off, nothing of it runs and the SDK is not even imported (the `otel` extra is optional). On:

- `RequestSpans`: a SERVER span per HTTP request named `METHOD route` (the route's template), its parent from an
  incoming `traceparent`, with GenAI semantic-convention attributes on the OpenAI routes.
- The door (`core/service.py`) sets the model, tier and outcome on the request span and records each item's
  queue wait as a child span `queue`.
- The workers (`gpu_pool.py`) record a span per batch, `batch <model>`, linked to the request span of every item
  it carried (a batch serves many traces: links, not a parent). The generation engine's stepper
  (`generation/inference_records.py`) records the same spans per sequence.

Everything the SDK's environment variables configure is left to them.
"""

from __future__ import annotations

import functools
import logging
import os
import time

from batchserve.http.uvicorn_protocol import FIRST_BYTE
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar
from collections.abc import Callable, Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from batchserve.core.batch import BatchRun
    from opentelemetry.trace import SpanContext, Tracer

P = ParamSpec("P")
R = TypeVar("R")
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
# GenAI semantic conventions: the operation each OpenAI-compatible route performs.
GENAI_OPERATIONS = {
    "/v1/embeddings": "embeddings",
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
}


def wall_ns(monotonic_s: float) -> int:
    """A `time.monotonic()` instant as the epoch nanoseconds spans are stamped with."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


log = logging.getLogger("batchserve.tracing")


def _never_raises(method: Callable[P, R]) -> Callable[P, R | None]:
    """A fault of tracing's own is logged, never allowed to cost an answer."""

    @functools.wraps(method)
    def guarded(*args: P.args, **kwargs: P.kwargs) -> R | None:
        try:
            return method(*args, **kwargs)
        except Exception:
            log.exception("tracing failed in %s", method.__name__)
            return None

    return guarded


class Tracing:
    """The tracer and the three places that make spans (request, queue wait, batch)."""

    def __init__(self, tracer: Tracer, shutdown: Callable[[], object] = lambda: None) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode

        self.tracer = tracer
        self.shutdown = shutdown  # exports what is left (called once the server has drained)
        self._trace, self._link, self._kind = trace, Link, SpanKind
        self._context = SpanContext  # the handles callers carry are opaque to them (`object`): narrowed here
        self._error = Status(StatusCode.ERROR)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Tracing | None:
        """A tracer exporting over OTLP/HTTP when an OTLP endpoint is configured, else None (tracing off)."""
        if not any(environ.get(name) for name in ENDPOINT_VARIABLES):
            return None
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from batchserve import __version__

        attributes = {"service.version": __version__}
        if not environ.get("OTEL_SERVICE_NAME") and "service.name=" not in environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
            attributes["service.name"] = "batchserve"  # the SDK's default is "unknown_service"
        provider = TracerProvider(resource=Resource.create(attributes))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        return cls(provider.get_tracer("batchserve", __version__), provider.shutdown)

    # -- the door ----------------------------------------------------------------------------------------------
    @_never_raises
    def admitted(self, model: str, tier: str) -> SpanContext | None:
        """Note the model and tier on the request's span; the span context each of its items carries."""
        span = self._trace.get_current_span()
        context = span.get_span_context()
        if not context.is_valid:
            return None
        if span.is_recording():
            span.set_attributes({"gen_ai.request.model": model, "batchserve.model": model, "batchserve.tier": tier})
        return context

    @_never_raises
    def answered(self, model: str, arrived: float, queue_s: float, batch: object, outcome: str) -> None:
        """The item's outcome on the request span, and its queue wait as a child span linked to its batch."""
        span = self._trace.get_current_span()
        if not span.is_recording():
            return
        span.set_attribute("batchserve.outcome", outcome)
        if outcome == "ok":
            span.set_attribute("gen_ai.response.model", model)
            start = wall_ns(arrived)
            began = getattr(span, "start_time", None)
            if isinstance(began, int):  # the same instant read through two pairs of clock readings: never before it
                start = max(start, began)
            links = [self._link(batch)] if isinstance(batch, self._context) else None
            queue = self.tracer.start_span(
                "queue", start_time=start, links=links, attributes={"batchserve.queue_ms": round(queue_s * 1000, 3)}
            )
            queue.end(end_time=start + int(queue_s * 1e9))

    # -- the workers ---------------------------------------------------------------------------------------------
    @_never_raises
    def batch(self, run: BatchRun) -> SpanContext | None:
        """A span for one batch run, linked to the request spans of the items it carried."""
        contexts = {c.span_id: c for c in run.requests if isinstance(c, self._context)}
        links = [self._link(c) for c in contexts.values()]
        span = self.tracer.start_span(
            f"batch {run.model}",
            start_time=wall_ns(run.started),
            links=links,
            kind=self._kind.INTERNAL,
            attributes={
                "batchserve.model": run.model,
                "gen_ai.request.model": run.model,
                "batchserve.batch.size": run.size,
                "batchserve.worker": run.worker,
                "batchserve.batch.cause": run.cause,
                **(run.attributes or {}),
            },
        )
        if run.failed is not None:
            span.set_status(self._error, run.failed[:200])
        span.end(end_time=wall_ns(run.ended))
        return span.get_span_context()


class RequestSpans:
    """ASGI middleware: one SERVER span per HTTP request, the caller's `traceparent` honoured."""

    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        from opentelemetry import context, propagate

        self.app = app
        self.tracing = tracing
        self._context, self._propagate = context, propagate

    @property
    def state(self) -> Any:  # for code that unwraps the app to reach the runtime
        return self.app.state  # type: ignore[attr-defined]

    @property
    def routes(self) -> Any:
        return self.app.routes  # type: ignore[attr-defined]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        carrier = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in scope["headers"]
            if k in (b"traceparent", b"tracestate")
        }
        parent = self._propagate.extract(carrier) if carrier else None
        path, method = scope["path"], scope["method"]
        tracing = self.tracing
        first_byte = scope.get(FIRST_BYTE)  # the request's clock starts there, its span too
        span = tracing.tracer.start_span(
            f"{method} {path}",
            context=parent,
            start_time=wall_ns(first_byte) if first_byte else None,
            kind=tracing._kind.SERVER,
            attributes={"http.request.method": method, "url.path": path, "url.scheme": scope.get("scheme", "http")},
        )
        operation = GENAI_OPERATIONS.get(path)
        if operation is not None:
            span.set_attribute("gen_ai.operation.name", operation)
        status = [500]

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        token = self._context.attach(tracing._trace.set_span_in_context(span))
        try:
            await self.app(scope, receive, send_status)
        finally:
            self._context.detach(token)
            route = route_template(path, scope.get("path_params"))
            span.update_name(f"{method} {route}")
            span.set_attributes({"http.route": route, "http.response.status_code": status[0]})
            if status[0] >= 500:
                span.set_status(tracing._error)
            span.end()


def route_template(path: str, params: Mapping[str, str] | None) -> str:
    """`/v2/models/sim/infer` with {"model": "sim"} → `/v2/models/{model}/infer` (a span name must not carry
    values: it would make every model, id or key a name of its own)."""
    if not params:
        return path
    parts = path.split("/")
    for name, value in params.items():
        parts = [f"{{{name}}}" if part == value else part for part in parts]
    return "/".join(parts)
