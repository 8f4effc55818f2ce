"""THE request path, written once: every HTTP route runs through `Endpoint`.

    request id → identify + rate tokens → bounded body read → parse (the wing's) → tokens by the body →
    handle (the wing's: the call to the door, with the disconnect watch) → render (the wing's) →
    account (ledger + metrics) → one write
      ╰─ on any exit: ApiError → the dialect's rendering, counted; the caller gone → counted as a 499;
         anything unexpected → logged, a 500 in the dialect, counted

A wing declares an endpoint as its dialect (`http/dialects.py`) and three functions: `parse` (body → request;
may pick the model), `handle` (request → result, through the door) and `render` (result → the answer's bytes).
It never reads a body, takes rate tokens, renders an error or counts an answer itself (tests/unit/test_structure.py
keeps it so). The skeleton is a plain ASGI app, so `app.FastPath` runs it without Starlette's Request/Response,
and under our protocol it writes a whole answer in one write (`send_whole`)."""

from __future__ import annotations

import logging
import time
from functools import partial
from types import MappingProxyType
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import msgspec
import orjson
from starlette.datastructures import QueryParams
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from batchserve import errors
from batchserve.config import Settings
from batchserve.core.tiers import ASKABLE, NAMES as TIER_NAMES
from batchserve.core.work import Work
from batchserve.errors import ApiError, ClientGone
from batchserve.http.dialects import Dialect
from batchserve.http.disconnect import hung_up, watch
from batchserve.http.guards import Guard, Caller
from batchserve.http.plumbing import (
    REQUEST_ID_OK,
    body_chunks,
    new_request_id,
    read_body_from,
    request_id_from,
    send_json,
)
from batchserve.http.uvicorn_protocol import FIRST_BYTE, GuardedCycle
from batchserve.logsafe import printable

log = logging.getLogger("batchserve.http")

# An inference gateway's headers (llm-d's endpoint picker), read only from a `--gateway-ips` peer (`identify`).
GATEWAY_HEADERS = (
    b"x-llm-d-inference-fairness-id",
    b"x-gateway-inference-fairness-id",
    b"x-llm-d-inference-objective",
    b"x-gateway-inference-objective",
)
GATEWAY_NAMES = tuple(name.decode() for name in GATEWAY_HEADERS)
MAX_LANE_CHARS = 128  # a fairness id longer than this names no lane
READ_HEADERS = (b"x-request-id", b"authorization", b"content-type", b"content-length", *GATEWAY_HEADERS)
NO_HEADERS: Mapping[str, str] = MappingProxyType({})
JSON_MEDIA = b"application/json"


class Served(Protocol):
    """What the skeleton reads from `app.state.rt`; each wing's host Protocol adds what its own functions read."""

    settings: Settings
    guard: Guard


def identify(guard: Guard, call: Call, any_key_anonymous: bool = False) -> Caller:
    """The caller by its key (401 / 403), its tier, tenant and owner set on the request's work, and a trusted
    gateway's headers read; shared by HTTP and gRPC. `any_key_anonymous`: with no keys configured any key is
    anonymous, as the OpenAI clients always send one."""
    headers, work = call.headers, call.work
    caller = call.caller = guard.identify(headers.get("authorization"), call.scope, any_key_anonymous)
    work.tier, work.tenant, work.owner = caller.tier, caller.tenant, caller.owner
    if guard.gateways and any(name in headers for name in GATEWAY_NAMES) and guard.via_gateway(call.scope):
        # Believed from a `--gateway-ips` peer only: its fairness id names the fair queue's lane (so the gateway's
        # per-tenant fairness and ours are one), and its objective the tier the request runs at, within its key's.
        fairness = headers.get("x-llm-d-inference-fairness-id") or headers.get("x-gateway-inference-fairness-id")
        if fairness and len(fairness) <= MAX_LANE_CHARS and fairness.isprintable():
            work.tenant = "gateway:" + fairness
        objective = headers.get("x-llm-d-inference-objective") or headers.get("x-gateway-inference-objective")
        if objective in ASKABLE:
            call.run_at(objective, "x-llm-d-inference-objective")
    return caller


def answer_head(answer: Answer, call: Call) -> bytes:
    """The answer's header lines for the one-write answer; where the request asked for a priority, the tier it
    ran at (as OpenAI answers `service_tier`)."""
    work = call.work
    head = b"content-type: %s\r\nx-request-id: %s\r\n" % (answer.media, work.request_id.encode())
    for name, value in answer.headers:
        head += b"%s: %s\r\n" % (name, value)
    for key, text in call.answer_headers.items():
        head += b"%s: %s\r\n" % (key.encode(), text.encode())
    if work.asked:
        head += b"x-service-tier: %s\r\n" % TIER_NAMES[work.tier].encode()
    return head


class Call(msgspec.Struct, eq=False):
    """One HTTP request on its way through the skeleton: what the wing's functions read, and the request's
    `Work`, handed down to the door and read back by the accounting. A Struct, built in C: cheaper per request
    than a class with an `__init__`."""

    scope: Scope
    receive: Receive
    work: Work
    headers: dict[str, str]  # the request headers the endpoint reads, by lower-case name
    caller: Caller | None = None
    answer_headers: Mapping[str, str] = NO_HEADERS  # on every answer: the X-RateLimit-* headers
    booked: bool = False  # the wing booked this answer itself (a generation sequence books its own outcome)

    def gone(self) -> Callable[[], bool]:
        """The door's "has the caller hung up?" check: under uvicorn, a C-level partial reading the cycle's
        `disconnected` flag (no Python call per read); other ASGI servers get a watcher task."""
        receive = self.receive
        cycle = getattr(receive, "__self__", None)
        if cycle is not None and isinstance(getattr(cycle, "disconnected", None), bool):
            return partial(getattr, cycle, "disconnected")
        return watch(receive)

    def hung_up(self) -> Awaitable[None]:
        """Returns when the caller hangs up: for a wing that waits on something other than the door."""
        return hung_up(self.receive)

    def run_at(self, value: str | int | None, field: str) -> None:
        """The request's own priority (`Work.ask`): its Work and its caller both move to the tier it runs at."""
        if value is None:
            return
        caller = self.who
        self.caller = caller.at(self.work.ask(value, caller.tier, caller.ceiling, field))

    def path(self, name: str) -> str:
        """A path parameter of the route (`batch_id` of `/v1/batches/{batch_id}`)."""
        return str(self.scope["path_params"][name])

    def query(self) -> QueryParams:
        return QueryParams(self.scope.get("query_string", b""))

    def body(self) -> AsyncIterator[bytes]:
        """The body as it streams in, for a route that reads it itself (`body=False`): a job, a file."""
        return body_chunks(self.receive)

    @property
    def who(self) -> Caller:
        """The caller, on an endpoint that identifies (every model route)."""
        if self.caller is None:
            raise RuntimeError("this endpoint does not identify its callers")
        return self.caller


class Answer(msgspec.Struct, gc=False):
    """A whole answer. `headers` are values the route built itself, so they skip uvicorn's per-header checks."""

    body: bytes
    media: bytes = JSON_MEDIA
    headers: tuple[tuple[bytes, bytes], ...] = ()
    status: int = 200


def json_answer(body: object, status: int = 200, headers: tuple[tuple[bytes, bytes], ...] = ()) -> Answer:
    return Answer(orjson.dumps(body), headers=headers, status=status)


def as_json(rt: object, call: Call, req: object, body: object) -> Answer:
    """The `render` of a route whose `handle` gives the answer's JSON value."""
    return Answer(orjson.dumps(body))


@dataclass(slots=True)
class Stream:
    """An answer written as it is made (server-sent events). `close(status)` runs exactly once, with "200",
    "500" or "499": the wing's own accounting of a stream, whose outcome is known only at its end."""

    chunks: AsyncIterator[bytes]
    close: Callable[[str], None] = lambda status: None
    media: bytes = b"text/event-stream"


class Gone(Exception):
    """Raised by a wing's function when the caller left (a stream that noticed first)."""


Req = TypeVar("Req")
Res = TypeVar("Res")
Host = TypeVar("Host", bound=Served, contravariant=True)


class Book(Protocol[Host]):
    """How an endpoint's answers are counted: `MODEL`, `COUNTED`, `UNCOUNTED`, or a wing's own. The one place
    an answer is counted; a wing that books an answer itself marks `call.booked` and is not counted again."""

    def ok(self, rt: Host, call: Call) -> None: ...

    def refused(self, rt: Host, call: Call, err: ApiError) -> None: ...

    def gone(self, rt: Host, call: Call) -> None: ...


class ModelBook:
    """The answers of a model route: the model's metrics and the SLO ledger, by the caller's tier and tenant."""

    def ok(self, rt: Served, call: Call) -> None:
        work, caller = call.work, call.caller
        if caller is not None:
            rt.guard.ok(work.model, time.monotonic() - work.arrived, caller, work.inputs, work.cost)

    def refused(self, rt: Served, call: Call, err: ApiError) -> None:
        rt.guard.refused(call.work.model, err, call.caller, call.work.inputs)

    def gone(self, rt: Served, call: Call) -> None:
        rt.guard.gone(call.work.model)


class Uncounted:
    """A public route that asks for no work (health, metadata): not counted, so probes do not inflate the
    request rate."""

    def ok(self, rt: Served, call: Call) -> None:
        pass

    def refused(self, rt: Served, call: Call, err: ApiError) -> None:
        pass

    def gone(self, rt: Served, call: Call) -> None:
        pass


class Counted(Uncounted):
    """A route that serves no model: in the answered count only (not the model metrics, nor the SLO ledger)."""

    def ok(self, rt: Served, call: Call) -> None:
        rt.guard.counted()

    def refused(self, rt: Served, call: Call, err: ApiError) -> None:
        rt.guard.counted()


MODEL = ModelBook()
COUNTED = Counted()
UNCOUNTED = Uncounted()


def whole_answer_sender(send: object) -> Callable[[int, bytes, bytes], Awaitable[None]] | None:
    """`send_whole` of the guarded cycle behind an ASGI `send`, or None under another server (then send ASGI
    messages)."""
    cycle = getattr(send, "__self__", None)
    return cycle.send_whole if isinstance(cycle, GuardedCycle) and not cycle.access_log else None


@dataclass(frozen=True)
class Endpoint(Generic[Host, Req, Res]):
    """One route's declaration, and the ASGI app that serves it.

    `tokens`: rate-limit tokens known only from the request (N inputs cost N): an empty bucket is refused (429)
    before the body is read, and the N tokens taken once parsed; None takes one token before the body. `rate`
    False: identified but takes no token (GET /v1/usage: how a refused caller finds out why). `identify` False:
    a public route. `ops_key`: served only with `--metrics-key` when one is set. `before_body`: what waits
    before the body is read (the generation routes' refusal throttle)."""

    dialect: Dialect
    parse: Callable[[Host, Call, bytes], Req]
    handle: Callable[[Host, Call, Req], Awaitable[Res]]
    render: Callable[[Host, Call, Req, Res], Answer | Stream]
    tokens: Callable[[Req], int] | None = None
    identify: bool = True
    rate: bool = True
    ops_key: bool = False
    book: Book[Host] = MODEL
    body: bool = True
    before_body: Callable[[Host, Call], Awaitable[None]] | None = None
    headers: tuple[bytes, ...] = ()
    names: dict[bytes, str] = field(init=False, repr=False, compare=False)
    take_one: bool = field(init=False, repr=False, compare=False)  # one token before the body
    take_by_body: bool = field(init=False, repr=False, compare=False)  # check before, N tokens after the parse

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", {name: name.decode() for name in (*READ_HEADERS, *self.headers)})
        object.__setattr__(self, "take_one", self.identify and self.rate and self.tokens is None)
        object.__setattr__(self, "take_by_body", self.identify and self.rate and self.tokens is not None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rt: Host = scope["app"].state.rt
        guard = rt.guard
        names = self.names
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            key = names.get(name.lower())
            if key is not None and key not in headers:
                headers[key] = value.decode("latin-1")
        work = Work("", scope.get(FIRST_BYTE) or time.monotonic())
        call = Call(scope, receive, work, headers)
        caller = None
        try:
            if self.ops_key:
                guard.check_ops_key(headers.get("authorization"))
            if self.identify:  # one rate token taken, or the bucket checked when tokens go by the body
                caller = identify(guard, call, self.dialect.any_key_anonymous)
                if self.take_one and caller.key_id:  # an anonymous caller has no bucket: no headers
                    call.answer_headers = guard.take(caller)
                elif self.take_by_body:
                    guard.check(caller)
            # The request id once the caller may send; a refusal above makes it when it renders.
            given = headers.get("x-request-id")  # `request_id_from`, inlined: every request
            work.request_id = given if given and REQUEST_ID_OK.match(given) else new_request_id()
            if self.before_body is not None:
                await self.before_body(rt, call)
            body = b""
            if self.body:
                body = await read_body_from(receive, rt.settings.max_body_bytes, headers.get("content-length"))
            if caller is not None:  # after the body: elsewhere than uvicorn the check reads `receive` itself
                work.gone = call.gone()
            req = self.parse(rt, call, body)
            if self.take_by_body and caller is not None and self.tokens is not None:
                call.answer_headers = guard.take(caller, self.tokens(req))
            answer = self.render(rt, call, req, await self.handle(rt, call, req))
        except ApiError as err:
            await self.send_refusal(rt, call, err, send)
            return
        except (ClientGone, ClientDisconnect, Gone):
            if not call.booked:
                self.book.gone(rt, call)
            return
        except Exception:
            log.exception("unhandled error on %s %s", scope["method"], printable(scope["path"]))
            await self.send_refusal(rt, call, errors.internal_error(), send, rate_headers=False)
            return
        if isinstance(answer, Stream):
            if not call.booked:
                self.book.ok(rt, call)
            await self.stream(answer, call, send)
            return
        send_whole = whole_answer_sender(send)
        if send_whole is not None:
            await send_whole(answer.status, answer_head(answer, call), answer.body)
        else:
            await self.send_messages(answer, call, send)
        if not call.booked:  # booked once written: the ledger's clock runs from the first byte to the last
            self.book.ok(rt, call)

    async def send_refusal(self, rt: Host, call: Call, err: ApiError, send: Send, rate_headers: bool = True) -> None:
        """Answer `err` in the endpoint's dialect, booked as refused; with the rate-limit headers where the
        error brings none of its own."""
        if not call.work.request_id:
            call.work.request_id = request_id_from(call.headers.get("x-request-id"))
        if not call.booked:
            self.book.refused(rt, call, err)
        out, err_headers = self.dialect.render(err, call.work.request_id)
        if rate_headers and call.answer_headers and not err.headers:
            err_headers.update(call.answer_headers)
        await send_json(send, err.status, out, err_headers)

    @staticmethod
    async def send_messages(answer: Answer, call: Call, send: Send) -> None:
        """The answer as ASGI messages, under a server other than batchserve's own protocol."""
        work = call.work
        raw = [(b"content-type", answer.media), (b"x-request-id", call.work.request_id.encode()), *answer.headers]
        if work.asked:
            raw.append((b"x-service-tier", TIER_NAMES[work.tier].encode()))
        if call.answer_headers:
            raw += [(k.encode(), v.encode()) for k, v in call.answer_headers.items()]
        raw.append((b"content-length", b"%d" % len(answer.body)))
        await send({"type": "http.response.start", "status": answer.status, "headers": raw})
        await send({"type": "http.response.body", "body": answer.body})

    @staticmethod
    async def stream(answer: Stream, call: Call, send: Send) -> None:
        """Its head, then each chunk as it comes; `close` says how it ended."""
        status = "500"
        raw = [(b"content-type", answer.media), (b"x-request-id", call.work.request_id.encode())]
        raw += [(k.encode(), v.encode()) for k, v in call.answer_headers.items()]
        if call.work.asked:
            raw.append((b"x-service-tier", TIER_NAMES[call.work.tier].encode()))
        raw.append((b"cache-control", b"no-cache"))
        gone = call.gone()
        try:
            await send({"type": "http.response.start", "status": 200, "headers": raw})
            async for chunk in answer.chunks:
                if gone():  # uvicorn drops what is sent to a closed connection: stop making it
                    raise Gone()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                del chunk  # the transport keeps what it could not write yet: not held while the next is made
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            status = "200"
        except (OSError, ClientDisconnect, Gone):
            status = "499"
        except Exception:  # the head went out: nothing more can be said on this connection
            log.exception("a streamed answer failed on %s", printable(call.scope["path"]))
        finally:
            answer.close(status)


def no_body(rt: object, call: Call, body: bytes) -> None:
    """The `parse` of a route that takes no body (a GET)."""
    return None


def public(
    dialect: Dialect,
    handle: Callable[[Host, Call, None], Awaitable[Res]],
    render: Callable[[Host, Call, None, Res], Answer | Stream] = as_json,
) -> Endpoint[Host, None, Res]:
    """A GET that anyone may make and that asks for no work (health, metadata): no caller, no body, not counted."""
    return Endpoint(dialect, no_body, handle, render, identify=False, book=UNCOUNTED, body=False)


def operational(
    dialect: Dialect,
    handle: Callable[[Host, Call, None], Awaitable[Res]],
    render: Callable[[Host, Call, None, Res], Answer | Stream] = as_json,
) -> Endpoint[Host, None, Res]:
    """A GET of the node's own state: only with `--metrics-key` when one is set, since it names workers, queue
    depths and rates that callers need not see; not counted."""
    return Endpoint(dialect, no_body, handle, render, identify=False, ops_key=True, book=UNCOUNTED, body=False)
