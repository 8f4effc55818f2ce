"""The OpenAPI 3.1 document served at `GET /openapi.json` (docs/contract.md#api), generated from the declared shapes.

Each wing declares its routes as `Operation`s (method, path, summary, the request's type, the answers' types per
status, its error dialect) next to the msgspec `Struct`s its parser decodes (`<wing>/shapes.py`), and
`app.create_app` builds the document from the operations of the routes it mounts. Every schema in the document
comes from `msgspec.json.schema_components` over those types: the shapes a request is decoded into are the
shapes the document describes, so the two cannot drift apart. Error answers take their dialect's shape
(`DocDialect`): `{error, message, request_id}` (docs/contract.md#errors) on batchserve's routes, narrowed per
status to the codes that status carries; OpenAI's `{"error": {...}}` on the OpenAI routes; KServe v2's
`{"error": message}`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

JSON = "application/json"
VERSION = "0.1.0"
REF = "#/components/schemas/{name}"

# Every code the server answers, by status (the table in docs/contract.md#errors lists them).
ERROR_CODES: dict[int, tuple[str, ...]] = {
    400: ("INVALID_REQUEST", "TIMEOUT_TOO_SHORT"),
    401: ("UNAUTHORIZED",),
    404: ("MODEL_NOT_FOUND", "REQUEST_NOT_FOUND", "NOT_FOUND", "BATCH_NOT_FOUND", "FILE_NOT_FOUND"),
    405: ("METHOD_NOT_ALLOWED",),
    408: ("REQUEST_TIMEOUT",),
    409: ("CONFLICT",),
    413: ("PAYLOAD_TOO_LARGE",),
    429: ("RATE_LIMITED",),
    431: ("HEADERS_TOO_LARGE",),
    500: ("INFERENCE_FAILED", "INTERNAL_ERROR"),
    501: ("NOT_IMPLEMENTED",),
    503: ("SERVICE_OVERLOADED", "DRAINING", "NO_HEALTHY_WORKER", "JOBS_UNAVAILABLE"),
    504: ("DEADLINE_EXCEEDED",),
}
ERROR_WHEN: dict[int, str] = {
    400: "the body or a parameter is not what the route takes (the message names the field), or a timeout too short",
    401: "API keys are configured and the key is missing or wrong",
    404: "unknown model or version, unknown request, job or file id, or unknown route",
    405: "the route does not take this method",
    408: "the body did not arrive in time",
    409: "the request conflicts with an earlier one (same idempotency key, different body; a job still running)",
    413: "body or input over the configured limit (checked before the whole body is buffered)",
    429: "the caller's key or tier is over its rate",
    431: "the request's headers are over the limit",
    500: "the backend failed on this input (after isolation and retry), or an unexpected server error",
    501: "the route is not served by this configuration",
    503: "admission refused: queue full, predicted wait past the deadline, no healthy worker, shutting down",
    504: "the request's deadline passed before it could be answered",
}
RETRYABLE = frozenset({429, 503})
# What every operation may answer whatever it declares: anything unexpected is logged and answered 500
# INTERNAL_ERROR in the operation's dialect (`http/endpoint.py`, and the router's handler for the plain routes).
ALWAYS = (500,)


# -- declarations ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Header:
    """An answer header (its value's type is declared like any shape)."""

    name: str
    description: str
    type: Any = str


REQUEST_ID = Header("X-Request-ID", "the caller's X-Request-ID when it sent a valid one, else the generated id")
RETRY_AFTER = Header(
    "Retry-After", "seconds to wait before retrying (retry_after_ms rounded up)", Annotated[int, msgspec.Meta(ge=1)]
)
RATE_HEADERS = (
    Header(
        "X-RateLimit-Limit",
        "the key's bucket size: the most requests it may send at once (the bucket refills at the tier's or key's "
        "rate per second)",
        float,
    ),
    Header("X-RateLimit-Remaining", "whole requests left in the key's bucket, never above the limit", float),
    Header("X-RateLimit-Reset", "seconds until the bucket is full again", float),
)


@dataclass(frozen=True)
class DocAnswer:
    """One documented answer of an operation: its status, and its body's type per media type
    (JSON unless said; `None`: no body)."""

    status: int
    description: str
    shape: Any = None
    media: str = JSON
    also: tuple[tuple[str, Any], ...] = ()  # more media types of the same answer: (media, type)
    headers: tuple[Header, ...] = (REQUEST_ID,)


@dataclass(frozen=True)
class Param:
    name: str
    where: Literal["path", "query", "header"]  # a path parameter is required, any other optional
    type: Any = str
    description: str = ""


@dataclass(frozen=True)
class DocDialect:
    """How a family of routes words its errors: the error body's type, and whether it is narrowed per status to
    the codes that status carries (the native shape's machine-readable `error`)."""

    name: str
    shape: Any
    per_status: bool = False


@dataclass(frozen=True)
class Operation:
    """One route as the document shows it: what it takes and every answer it gives, errors included. `errors`:
    every other status the route really answers (the skeleton's: 401 where it identifies, 429 where it takes
    tokens, 413 where it reads a body; tests/unit/test_app.py checks them against the route's `Endpoint`); 500
    is added to every operation (`ALWAYS`). There is no `default` answer: a status not declared is a defect,
    which the property-based run (tests/integration/http/test_schemathesis.py) reports."""

    method: str
    path: str
    operation_id: str
    summary: str
    answers: tuple[DocAnswer, ...]
    dialect: DocDialect
    errors: tuple[int, ...] = ()
    request: Any = None  # the body's type (`None`: no body)
    request_media: str = JSON
    request_also: tuple[tuple[str, Any], ...] = ()
    params: tuple[Param, ...] = ()
    description: str = ""
    public: bool = False  # no API key asked (health, metrics, the document itself)
    tags: tuple[str, ...] = ()


MODEL_ERRORS = (400, 401, 404, 413, 429, 500, 503, 504)  # every route whose inputs ride the batcher: `model_post`


def model_post(
    path: str, op_id: str, summary: str, answer: DocAnswer, dialect: DocDialect, request: Any, **more: Any
) -> Operation:
    """A POST whose inputs ride the batcher: its one 200 `answer`, and the errors every such route gives (a bad
    body, no key, no such model, too large, the caller's rate, overload, its deadline)."""
    return Operation("POST", path, op_id, summary, (answer,), dialect, errors=MODEL_ERRORS, request=request, **more)


def versioned_posts(path: str, op_id: str, *args: Any) -> tuple[Operation, Operation]:
    """`model_post` at `path` (`/v1/...`) and at the same path without its version, as other servers serve it."""
    bare = "/" + path.split("/", 2)[2]
    return model_post(path, op_id, *args), model_post(bare, op_id + "Unversioned", *args)


def one_of(*types: type, description: str = "") -> msgspec.Meta:
    """`Annotated[Any, one_of(A, B)]`: a value of any of these types, for the untagged unions msgspec does not
    decode (two object types with no tag field): the document says `anyOf` over their components; the types join
    the document through `build`'s `also_documented`."""
    refs = [{"$ref": REF.format(name=t.__name__)} for t in types]
    return msgspec.Meta(description=description or None, extra_json_schema={"anyOf": refs})


# -- the generated error shapes of the native dialect ----------------------------------------------------------
def _native_error_by_status(base: type) -> dict[int, type]:
    """`Error<status>`: the native error body with `error` narrowed to that status's codes (so a test can check
    status and code agree), and `retry_after_ms` required where retrying helps."""
    fields = {f.name: f for f in msgspec.structs.fields(base)}
    retry = fields["retry_after_ms"]
    out: dict[int, type] = {}
    for status, codes in ERROR_CODES.items():
        spec: list[Any] = [
            ("error", Annotated[Literal[codes], msgspec.Meta(description="machine-readable code")]),
            ("message", fields["message"].type),
            ("request_id", fields["request_id"].type),
            ("retry_after_ms", Annotated[int, msgspec.Meta(ge=1)])
            if status in RETRYABLE
            else ("retry_after_ms", retry.type, retry.default),
        ]
        name = f"{base.__name__}{status}"
        out[status] = msgspec.defstruct(name, spec, forbid_unknown_fields=True, omit_defaults=True)
        out[status].__doc__ = f"{base.__name__} of status {status}: {ERROR_WHEN[status]}"
    return out


# -- the document ---------------------------------------------------------------------------------------------
class _Collector(list[Any]):
    """Types in the order met, each later replaced by its schema (a `$ref` for Structs)."""

    def add(self, t: Any) -> int:
        self.append(t)
        return len(self) - 1


def build(operations: Iterable[Operation], also_documented: Sequence[Any] = ()) -> dict[str, Any]:
    """The whole document from these operations (operations on one path are merged). `also_documented`: types
    named only through `one_of` (their components must exist)."""
    ops = list(operations)
    types = _Collector()
    dialects = {op.dialect.name: op.dialect for op in ops}.values()
    by_status = {d.name: _native_error_by_status(d.shape) for d in dialects if d.per_status}
    plan = [(op, _operation_plan(op, types, by_status.get(op.dialect.name))) for op in ops]
    types += also_documented
    types += [d.shape for d in dialects]  # the unnarrowed shape is always a component (tests and clients name it)

    schemas, components = msgspec.json.schema_components(types, ref_template=REF)
    paths: dict[str, dict[str, Any]] = {}
    for op, p in plan:
        paths.setdefault(op.path, {})[op.method.lower()] = _resolve(p, schemas)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "batchserve",
            "version": VERSION,
            "description": "Dynamic-batching inference server: single synchronous requests in, GPU batches "
            "inside. Every error is JSON: {error, message, request_id} (plus retry_after_ms) "
            "on batchserve's own routes, OpenAI's {error: {message, type, param, code}} on "
            "/v1/embeddings, /v1/rerank, /v1/chat/completions and /v1/completions, KServe v2's {error} on "
            "/v2; a Retry-After header wherever retrying later can help.",
        },
        # OAS 3.1's own dialect (JSON Schema 2020-12 plus OpenAPI's vocabulary), its default: tools such as
        # Swagger UI refuse any other value with a warning.
        "jsonSchemaDialect": "https://spec.openapis.org/oas/3.1/dialect/base",
        "paths": paths,
        "components": {
            "schemas": dict(sorted(components.items())),
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "an API key, when the server has keys configured",
                }
            },
        },
        "security": [{"bearer": []}, {}],
    }


@dataclass(frozen=True, slots=True)
class _Schema:
    """A placeholder for the schema of the collected type at `index`, filled in by `_resolve`."""

    index: int


def _content(types: _Collector, media: str, shape: Any, also: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    return {m: {"schema": _Schema(types.add(t))} for m, t in ((media, shape), *also)}


def _operation_plan(op: Operation, types: _Collector, narrowed: dict[int, type] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"operationId": op.operation_id, "summary": op.summary}
    if op.description:
        out["description"] = op.description
    if op.tags:
        out["tags"] = list(op.tags)
    if op.public:
        out["security"] = []
    params = [
        {
            "name": p.name,
            "in": p.where,
            "required": p.where == "path",
            **({"description": p.description} if p.description else {}),
            "schema": _Schema(types.add(p.type)),
        }
        for p in op.params
    ]
    if params:
        out["parameters"] = params
    if op.request is not None:
        out["requestBody"] = {
            "required": True,
            "content": _content(types, op.request_media, op.request, op.request_also),
        }
    answers = list(op.answers)
    for status in sorted({*op.errors, *ALWAYS} - {a.status for a in answers}):  # in the dialect's error shape
        shape = narrowed[status] if narrowed is not None else op.dialect.shape
        codes = f"{' / '.join(ERROR_CODES[status])}: " if narrowed is not None else ""
        headers: tuple[Header, ...] = (REQUEST_ID, RETRY_AFTER) if status in RETRYABLE else (REQUEST_ID,)
        headers += RATE_HEADERS if status == 429 else ()
        answers.append(DocAnswer(status, codes + ERROR_WHEN[status], shape, headers=headers))
    responses: dict[str, Any] = {}
    for a in answers:
        answer: dict[str, Any] = {"description": a.description}
        if a.headers:
            answer["headers"] = {
                h.name: {"description": h.description, "schema": _Schema(types.add(h.type))} for h in a.headers
            }
        if a.shape is not None:
            answer["content"] = _content(types, a.media, a.shape, a.also)
        responses[str(a.status)] = answer
    out["responses"] = responses  # every status it answers, and no `default`: an undeclared status is a defect
    return out


def _resolve(node: Any, schemas: Sequence[dict[str, Any]]) -> Any:
    if isinstance(node, _Schema):
        return schemas[node.index]
    if isinstance(node, dict):
        return {k: _resolve(v, schemas) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve(v, schemas) for v in node]
    return node
