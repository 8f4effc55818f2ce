"""KServe Open Inference Protocol v2 over gRPC (`--grpc-port`): the service Triton's gRPC clients call.

The same model view as the HTTP v2 routes (`parse.py`, `render.py`) and the same request path: the caller
identified as HTTP does, one rate-limit token per element, every element through the door as its own item (so gRPC
callers share batches with every HTTP route), each answer counted by the guard.

The listener is held to HTTP's connection limits (docs/hardening.md): its own share of the descriptor budget as a
connection cap, idle and handshake timeouts, at most MAX_STREAMS calls per connection, and the request message read
within `--body-timeout-s` (each method is registered client-streaming so the read is ours to bound: unary clients
send the same bytes). No refusal names a Python exception.

Refusals are gRPC status codes (`STATUS_CODES`) with the message as details and, where retrying later helps,
`retry-after-ms` in the trailing metadata.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, NoReturn, Protocol

import grpc
from google.protobuf.message import DecodeError
from grpc import aio
from starlette.types import Message

from batchserve import __version__, errors
from batchserve.config import Settings
from batchserve.errors import ApiError, ClientGone
from batchserve.core.tiers import NAMES as TIER_NAMES
from batchserve.core.work import Work
from batchserve.http.budget import connection_budget
from batchserve.http.endpoint import GATEWAY_NAMES, MODEL, Call, identify
from batchserve.http.plumbing import first_values, request_id_from
from batchserve.kserve import render
from batchserve.kserve.parse import bad, bytes_elements, texts_of
from batchserve.kserve.grpc_messages import SERVICE, Messages, load
from batchserve.kserve.host import KServeHost, find_model
from batchserve.kserve.shapes import EXTENSIONS, INPUT_NAME, MAX_DIMS, MAX_ELEMENTS, OUTPUT_NAME

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

log = logging.getLogger("batchserve.grpc")
protos: Messages = load()  # cli.py loads them first, so an unfit protobuf is one line and exit 2 before start

MAX_STREAMS = 100  # calls open at once on one connection (HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS)
MAX_AGE_S = 3600.0  # a connection is asked to close (GOAWAY) after about this long, so none is held for ever
KEEPALIVE_S = 60.0  # pings on a connection with calls open find a vanished peer
KEEPALIVE_TIMEOUT_S = 20.0
METADATA = ("authorization", "x-request-id", *GATEWAY_NAMES)

STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


# The v2 messages as this module reads them (their classes are made from the .proto at start, so untyped).
class ModelRef(Protocol):
    """ModelReadyRequest, ModelMetadataRequest."""

    name: str
    version: str


class Contents(Protocol):
    bytes_contents: Sequence[bytes]


class InferInputTensor(Protocol):
    name: str
    datatype: str
    shape: Sequence[int]
    contents: Contents


class OutputRequest(Protocol):
    name: str


class Parameter(Protocol):
    int64_param: int

    def WhichOneof(self, group: str) -> str | None: ...  # noqa: N802 - protobuf's name


class ModelInferRequest(Protocol):
    """The fields of the gRPC message (grpc_inference.proto) the servicer reads."""

    id: str
    model_name: str
    model_version: str
    inputs: Sequence[InferInputTensor]
    raw_input_contents: Sequence[bytes]
    outputs: Sequence[OutputRequest]
    parameters: Mapping[str, Parameter]


def parse_request(req: ModelInferRequest, max_chars: int) -> tuple[list[str], list[int], float | None]:
    """The request's strings (row-major), its shape, and its `timeout` parameter in microseconds (or None)."""
    if len(req.inputs) != 1:
        raise bad(f"'inputs' must hold exactly one tensor, named '{INPUT_NAME}' (see ModelMetadata)")
    tensor = req.inputs[0]
    if tensor.name != INPUT_NAME:
        raise bad(f"unknown input '{tensor.name[:64]}': this model's one input is '{INPUT_NAME}'")
    if tensor.datatype != "BYTES":
        raise bad(f"input '{INPUT_NAME}' must have datatype BYTES (strings), not {tensor.datatype[:16]}")
    shape = list(tensor.shape)
    if len(shape) > MAX_DIMS or any(d < 0 or d > MAX_ELEMENTS for d in shape):
        raise bad("'shape' must be at most 8 non-negative dimensions")
    count = math.prod(shape)
    if count < 1 or count > MAX_ELEMENTS:
        raise bad(f"input '{INPUT_NAME}' must hold 1 to {MAX_ELEMENTS} elements, its shape {shape} holds {count}")
    raw_contents = req.raw_input_contents
    if raw_contents:
        if len(raw_contents) != 1 or tensor.contents.bytes_contents:
            raise bad("give the input either as raw_input_contents (one entry) or as contents, not both")
        elements = bytes_elements(raw_contents[0], count, "raw_input_contents[0]")
    else:
        elements = list(tensor.contents.bytes_contents)
        if len(elements) != count:
            raise bad(f"input '{INPUT_NAME}' holds {len(elements)} element(s), its shape {shape} says {count}")
    texts = texts_of(elements, max_chars)
    for out in req.outputs:
        if out.name != OUTPUT_NAME:
            raise bad(f"unknown output '{out.name[:64]}': this model's one output is '{OUTPUT_NAME}'")
    timeout_us: float | None = None
    if "timeout" in req.parameters:
        param = req.parameters["timeout"]
        if param.WhichOneof("parameter_choice") != "int64_param" or param.int64_param <= 0:
            raise bad("'parameters.timeout' must be a positive int64 of microseconds")
        timeout_us = float(param.int64_param)
    return texts, shape, timeout_us


def output_tensor(outputs: Sequence[object], shape: list[int], kind: str) -> tuple[str, list[int], bytes]:
    """(datatype, shape, raw contents) of the answer: the HTTP route's tensor, packed as its binary extension."""
    tensor, flat = render.output_tensor(list(outputs), shape, kind)
    return tensor["datatype"], tensor["shape"], render.to_binary(tensor["datatype"], flat)


Read = Callable[[], Awaitable[object]]  # the call's request message, read within the body timeout


class InferenceServicer:
    """The six v2 methods over the runtime's door. Each is handed `read` for its request message, so a method
    can refuse a caller before its message is read."""

    def __init__(self, rt: KServeHost) -> None:
        self.rt = rt

    async def ServerLive(self, read: Read, context: aio.ServicerContext) -> object:  # noqa: N802 - v2's names
        await read()
        return protos.ServerLiveResponse(live=True)

    async def ServerReady(self, read: Read, context: aio.ServicerContext) -> object:  # noqa: N802
        await read()
        return protos.ServerReadyResponse(ready=self.rt.not_ready_reason() is None)

    async def ModelReady(self, read: Read, context: aio.ServicerContext) -> object:  # noqa: N802
        request: ModelRef = await read()  # type: ignore[assignment]
        try:
            spec = find_model(self.rt, request.name, request.version)
        except ApiError as err:
            if err.status != 404:  # no name at all: the 400 that names the field
                raise
            return protos.ModelReadyResponse(ready=False)  # as HTTP's tritonclient reads a 404: not ready
        ready = self.rt.not_ready_reason() is None and spec.id in self.rt.backends
        return protos.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, read: Read, context: aio.ServicerContext) -> object:  # noqa: N802
        await read()
        return protos.ServerMetadataResponse(name="batchserve", version=__version__, extensions=EXTENSIONS)

    async def ModelMetadata(self, read: Read, context: aio.ServicerContext) -> object:  # noqa: N802
        request: ModelRef = await read()  # type: ignore[assignment]
        spec = find_model(self.rt, request.name, request.version)
        return protos.ModelMetadataResponse(**render.metadata_of(self.rt, spec))

    async def ModelInfer(self, read: Read, context: aio.ServicerContext) -> object:  # noqa: N802
        rt = self.rt
        s, guard = rt.settings, rt.guard
        metadata = first_values(context.invocation_metadata() or (), METADATA)
        work = Work(request_id_from(metadata.get("x-request-id")), time.monotonic(), gone=context.cancelled)
        # The HTTP skeleton's request value and its steps: identified as HTTP, booked by the model book.
        call = Call({"client": peer_address(context.peer())}, no_body, work, metadata)
        try:
            caller = identify(guard, call)
            guard.check(caller)  # as HTTP's `enter`: a caller who may not send is refused before its message is read
            request: ModelInferRequest = await read()  # type: ignore[assignment]
            spec = find_model(rt, request.model_name, request.model_version, field="model_name")
            work.model = spec.id
            texts, shape, timeout_us = parse_request(request, s.max_input_chars)
            work.inputs = len(texts)
            if "priority" in request.parameters:  # the tier it asks to run at, within its key's (`Work.ask`)
                asked = request.parameters["priority"]
                kind = asked.WhichOneof("parameter_choice")
                if kind not in ("string_param", "int64_param", "uint64_param"):  # a name, or a Triton level
                    raise bad("'parameters.priority' must be a tier name or Triton's priority level")
                call.run_at(getattr(asked, kind), "parameters.priority")
            backend = rt.backends.get(spec.id)
            if backend is None:
                raise errors.warming_up()
            timeout_ms = rt.registry.deadlines[spec.id].timeout_s * 1000 if timeout_us is None else timeout_us / 1000
            remaining = context.time_remaining()  # the client's own gRPC deadline, when it set one
            if remaining is not None:
                timeout_ms = min(timeout_ms, remaining * 1000)
            if timeout_ms > s.max_timeout_ms:
                raise bad(f"'parameters.timeout' is over --max-timeout-ms ({s.max_timeout_ms:.0f} ms)")
            guard.take(call.who, len(texts))
            try:
                results = await rt.service.infer_many(work.due_in(timeout_ms / 1000), texts)
            except ClientGone:
                MODEL.gone(rt, call)
                return protos.ModelInferResponse()  # nobody reads it: the call was cancelled
            datatype, out_shape, raw = output_tensor([r.output for r in results], shape, backend.output_kind)
            MODEL.ok(rt, call)
        except ApiError as err:
            MODEL.refused(rt, call, err)
            await abort(context, err, work.request_id)
        except Exception:  # as the HTTP skeleton: logged, an INTERNAL status that says nothing of it, counted
            log.exception("unhandled error in ModelInfer")
            failed = errors.internal_error()
            MODEL.refused(rt, call, failed)
            await abort(context, failed, work.request_id)
        head: tuple[tuple[str, str], ...] = (("x-request-id", work.request_id),)
        if work.asked:
            head += (("x-service-tier", TIER_NAMES[work.tier]),)
        await context.send_initial_metadata(head)
        tensor = {"name": OUTPUT_NAME, "datatype": datatype, "shape": out_shape}
        return protos.ModelInferResponse(
            model_name=spec.name, model_version=spec.version, id=request.id, outputs=[tensor], raw_output_contents=[raw]
        )


async def read_request(context: aio.ServicerContext, message: type, timeout_s: float) -> object:
    """The call's one request message, decoded: 408 when not arrived whole within `timeout_s` of the call, 400
    when it is missing or not `message`."""
    try:  # asyncio.timeout, not wait_for: on 3.11 wait_for can drop a cancellation (the call's end, a stop)
        async with asyncio.timeout(timeout_s):
            raw = await context.read()
    except TimeoutError:
        raise errors.request_timeout(f"the request message did not arrive within {timeout_s:g} s") from None
    if not isinstance(raw, bytes):  # aio.EOF: the client half-closed without a message
        raise bad("the call carried no request message")
    try:
        return message.FromString(raw)  # type: ignore[attr-defined]
    except DecodeError:
        raise bad(f"the request message is not a valid {message.__name__} (protobuf)") from None


Impl = Callable[[Read, aio.ServicerContext], Awaitable[object]]


def method_handler(name: str, impl: Impl, message: type, timeout_s: float) -> grpc.RpcMethodHandler:
    """One method, registered client-streaming so that reading its request is `read_request`'s, bounded in time.
    An unexpected error is logged and answered INTERNAL without its name, never gRPC's "Unexpected <class ...>"."""

    async def call(requests: object, context: aio.ServicerContext) -> object:
        async def read() -> object:
            return await read_request(context, message, timeout_s)

        try:
            return await impl(read, context)
        except ApiError as err:  # ModelInfer counts and answers its own; these are the other methods'
            await abort(context, err)
        except aio.AbortError:
            raise
        except Exception:
            log.exception("unhandled error in %s", name)
            await abort(context, errors.internal_error())

    return grpc.stream_unary_rpc_method_handler(call, response_serializer=lambda m: m.SerializeToString())


async def no_body() -> Message:
    """The `receive` of a gRPC call's `Call`: its message is read by gRPC itself, never through this."""
    return {"type": "http.disconnect"}


def peer_address(peer: str) -> tuple[str, int] | None:
    """(host, port) of gRPC's peer string (`ipv4:127.0.0.1:5000`, `ipv6:[::1]:5000`), None when it names none."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    return host.strip("[]"), int(port) if port.isdigit() else 0


def grpc_status(err: ApiError, request_id: str = "") -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """The ApiError in gRPC's words, as `http/dialects.py` renders it for HTTP: status code, details, and the
    request id and retry hint as trailing metadata."""
    trailing: list[tuple[str, str]] = [("x-request-id", request_id)] if request_id else []
    if err.retry_after_ms is not None:
        trailing.append(("retry-after-ms", str(err.retry_after_ms)))
    return STATUS_CODES.get(err.status, grpc.StatusCode.INTERNAL), err.message, tuple(trailing)


async def abort(context: aio.ServicerContext, err: ApiError, request_id: str = "") -> NoReturn:
    """End the call with the status that fits the refusal (raises, as `context.abort` does)."""
    await context.abort(*grpc_status(err, request_id))
    raise AssertionError("context.abort returned")  # it raises; this keeps the type checker told


def server_options(s: Settings, max_connections: int) -> list[tuple[str, int]]:
    """grpcio's server arguments that hold its connections to HTTP's limits (docs/hardening.md)."""

    def ms(seconds: float) -> int:
        return max(1, round(seconds * 1000))

    return [
        ("grpc.max_receive_message_length", s.max_body_bytes),
        ("grpc.max_metadata_size", s.max_header_bytes),
        ("grpc.max_allowed_incoming_connections", max_connections),  # past it, a new connection is closed at once
        ("grpc.server_handshake_timeout_ms", ms(s.header_timeout_s)),  # the HTTP/2 preface and SETTINGS
        ("grpc.max_connection_idle_ms", ms(s.keep_alive_timeout_s)),  # no call open: GOAWAY, then closed
        ("grpc.max_connection_age_ms", ms(MAX_AGE_S)),
        ("grpc.max_connection_age_grace_ms", ms(s.body_timeout_s + s.max_timeout_ms / 1000)),
        ("grpc.max_concurrent_streams", MAX_STREAMS),
        ("grpc.keepalive_time_ms", ms(KEEPALIVE_S)),
        ("grpc.keepalive_timeout_ms", ms(KEEPALIVE_TIMEOUT_S)),
        ("grpc.keepalive_permit_without_calls", 0),  # a client's pings on an idle connection are bad pings
        ("grpc.http2.max_ping_strikes", 2),  # a client pinging too often is sent GOAWAY (gRPC's default, said)
    ]


async def start_grpc(rt: KServeHost, host: str, port: int) -> tuple[aio.Server, int]:
    """The gRPC server on `host:port` (0 = a free port), on the running event loop: (server, bound port)."""
    s = rt.settings
    cap = connection_budget(s).grpc
    server = aio.server(options=server_options(s, cap))
    servicer = InferenceServicer(rt)
    handlers = {
        m.name: method_handler(m.name, getattr(servicer, m.name), m.request, s.body_timeout_s) for m in protos.methods
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = server.add_insecure_port(address)
    await server.start()
    log.info("gRPC (KServe v2) listening on %s:%d; at most %d connections", host, bound, cap)
    return server, bound
