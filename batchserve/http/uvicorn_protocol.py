"""uvicorn's httptools protocol, hardened: the native JSON error body for requests broken at the HTTP level,
bounded request heads, read timeouts and a connection cap (docs/hardening.md).

uvicorn answers a request its parser cannot read in plain text; clients rely on one error shape, so this answers
the same 400 as JSON `{"error": "INVALID_REQUEST", "message", "request_id"}`, and closes the connection (after a
parse error the stream cannot be trusted).

What httptools and uvicorn leave open, and how it is closed here:
- Head size. httptools buffers a header line whole before its callback sees it, so the head is measured in
  `data_received` as bytes arrive: past `max_header_bytes` (or `max_headers` lines) the answer is 431.
- Slow heads and bodies. One deadline per connection (head within `header_timeout_s`, body within
  `body_timeout_s` of the head), checked by one periodic sweep rather than a timer per request (408, or a silent
  close when not a byte of a request came).
- Idle floods. Past `max_connections`, the connection that has waited longest without a request in the app is
  evicted, so a health check on a fresh connection is always served and descriptors are never exhausted.
- Unread bodies. An answer given before the body was read whole (401, 413, ...) says `Connection: close` and
  lingers, as nginx does: a FIN follows the answer, the rest of the body is read and discarded (`LINGER_BYTES`,
  `LINGER_S` of silence, `LINGER_MAX_S` in all), then the connection closes. Closing at once makes the kernel
  reset it, and a client that writes its whole body before reading (httpx's async client) gets a reset, not a 413.
- Transfer codings other than `chunked` are refused with 501: the body would reach the app still encoded.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from batchserve import errors
from batchserve.errors import ApiError
from batchserve.http.budget import descriptor_limit, split
from batchserve.heap import release_free_memory
from batchserve.http.plumbing import new_request_id


@dataclass(frozen=True)
class ConnectionLimits:
    """Built from Settings by `http/server.py`."""

    max_header_bytes: int = 32768
    max_headers: int = 100
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 0  # 0 = the whole descriptor budget (`budget.py`)


@dataclass(eq=False)
class ConnectionGuard:
    """What the connections of one server share: the limits, the connections with no request in the app
    (oldest first: the eviction order) and the deadline sweep."""

    limits: ConnectionLimits
    cap: int
    waiting: dict[GuardedHttpToolsProtocol, None] = field(default_factory=dict)  # insertion-ordered
    sweep_s: float = 1.0
    _sweep: asyncio.TimerHandle | None = None
    peak: int = 0  # most connections open at once since the last heap trim
    trims: int = 0
    _last_open: int = 0  # open connections at the previous sweep

    @classmethod
    def create(cls, limits: ConnectionLimits) -> ConnectionGuard:
        shortest = min(limits.header_timeout_s, limits.body_timeout_s)
        cap = split(descriptor_limit(), limits.max_connections, 0, grpc_on=False).http
        return cls(limits, cap, sweep_s=min(1.0, max(0.02, shortest / 5)))

    def start_sweeping(self, loop: asyncio.AbstractEventLoop, connections: set) -> None:
        if self._sweep is None:
            self._sweep = loop.call_later(self.sweep_s, self._tick, loop, connections)

    def _tick(self, loop: asyncio.AbstractEventLoop, connections: set) -> None:
        now = loop.time()
        for conn in list(connections):
            deadline = getattr(conn, "deadline", 0.0)
            if deadline and deadline <= now:
                conn.expire()
        self._after_a_flood(loop, len(connections))
        self._sweep = loop.call_later(self.sweep_s, self._tick, loop, connections) if connections else None

    def _after_a_flood(self, loop: asyncio.AbstractEventLoop, open_now: int) -> None:
        """Once open connections have fallen to a quarter of a peak of TRIM_PEAK or more and stopped falling, give
        the heap they freed back to the OS (`heap.py`; a flood of idle connections otherwise keeps tens of MB for
        good). Trimming while they still close returns only part of it."""
        falling, self._last_open = open_now < self._last_open, open_now
        if open_now > self.peak:
            self.peak = open_now
        elif self.peak >= TRIM_PEAK and open_now <= self.peak // 4 and (open_now == 0 or not falling):
            self.peak = open_now
            self.trims += 1
            loop.run_in_executor(None, release_free_memory)

    def make_room(self, newcomer: GuardedHttpToolsProtocol, open_now: int) -> bool:
        """Past the cap: close the connection that has waited longest without a request, so the newcomer is
        served. False when every other connection has a request in the app (the newcomer is then closed)."""
        if open_now <= self.cap:
            return True
        for victim in self.waiting:
            if victim is not newcomer:
                victim.close_quietly()
                return True
        return False


TRIM_PEAK = 1024  # open connections that make a peak worth trimming the heap after
COALESCE_MAX_BYTES = 65536  # a larger body is not copied to go out with its head
# Scope key carrying the time.monotonic() of a request's first byte: its deadline and SLO latency start there,
# as the client's clock does.
FIRST_BYTE = "batchserve.first_byte"
# Lingering close (module docstring): the cap must exceed any upload refused by Content-Length, or it gets a reset.
LINGER_BYTES = 1 << 30
LINGER_S = 5.0
LINGER_MAX_S = 30.0


def _can_write_eof(transport: asyncio.Transport) -> bool:
    try:
        return transport.can_write_eof()
    except NotImplementedError:  # a transport that cannot half-close: close at once
        return False


@dataclass(slots=True, eq=False)
class _Lingering:
    """Transport of a cycle answered before its body was read whole: `close` lingers (`linger`); the rest is the
    transport's."""

    transport: asyncio.Transport
    protocol: GuardedHttpToolsProtocol

    def close(self) -> None:
        self.protocol.linger()

    def __getattr__(self, name: str) -> object:
        return getattr(self.transport, name)


@dataclass(slots=True, eq=False)
class _HeadHeld:
    """Stands in for the transport while uvicorn writes a response head: the head is kept, not sent."""

    head: bytes | None = None

    def write(self, data: bytes) -> None:
        self.head = data if self.head is None else self.head + data


@dataclass(slots=True, eq=False)
class _HeadFirst:
    """Transport while uvicorn writes the first body bytes: the held head goes out in the same write (or alone,
    before anything else the cycle does to the transport)."""

    transport: asyncio.Transport
    head: bytes | None

    def flush(self) -> None:
        if self.head is not None and not self.transport.is_closing():
            self.transport.write(self.head)
        self.head = None

    def write(self, data: bytes) -> None:
        if self.head is not None and len(data) <= COALESCE_MAX_BYTES:
            data, self.head = self.head + data, None
        self.flush()
        self.transport.write(data)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()


class GuardedCycle(RequestResponseCycle):
    """uvicorn's request cycle, with two changes:
    - one write per answer: the head of a response of known length is held and written with its first body
      bytes, so a small JSON answer is one syscall and one TCP segment rather than two (streams send it at once);
    - an answer started before the request body was read whole closes the connection instead of reusing it."""

    held_head: bytes | None = None

    def answer_before_body(self) -> None:
        """No keep-alive, and the close lingers. The connection is found through `on_response` (its bound method)
        rather than kept on the cycle, which would make a reference cycle per request for the garbage collector."""
        self.keep_alive = False
        protocol = getattr(self.on_response, "__self__", None)
        if isinstance(protocol, GuardedHttpToolsProtocol) and not isinstance(self.transport, _Lingering):
            self.transport = _Lingering(self.transport, protocol)  # type: ignore[assignment]

    async def send(self, message):
        if self.more_body and not self.response_started:
            self.answer_before_body()
        transport = self.transport
        if not self.response_started:
            self.transport = held = _HeadHeld()  # type: ignore[assignment]
            try:
                await super().send(message)
            finally:
                self.transport = transport
            if held.head is not None:
                if self.chunked_encoding is False and self.expected_content_length > 0:
                    self.held_head = held.head  # a whole body of known length follows: it goes out with it
                else:
                    transport.write(held.head)  # a stream (or an empty body): the head goes out now
            return
        head = self.held_head
        if head is None:
            await super().send(message)
            return
        self.held_head = None
        self.transport = first = _HeadFirst(transport, head)  # type: ignore[assignment]
        try:
            await super().send(message)
        finally:
            self.transport = transport
            first.flush()  # a HEAD answer, or an error: the head still goes out, in order

    async def send_whole(self, status: int, head: bytes, body: bytes) -> None:
        """A whole answer of known length in one write, for a route whose headers are known safe (`head`: header
        lines ending in CRLF, no Content-Length): the bytes `send` would write, without its per-header regular
        expressions and message dicts, which cost the hot inference route a measurable share of its CPU."""
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        if self.response_started:
            raise RuntimeError("the response has already started")
        if self.more_body:
            self.answer_before_body()
        self.response_started = True
        self.waiting_for_100_continue = False
        parts = [STATUS_LINE[status]]
        for name, value in self.default_headers:
            parts += (name, b": ", value, b"\r\n")
        parts += (head, b"content-length: %d\r\n" % len(body))
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        if self.scope["method"] != "HEAD":
            parts.append(body)
        self.transport.write(b"".join(parts))
        self.response_complete = True
        self.message_event.set()
        if not self.keep_alive:
            self.transport.close()
        self.on_response()


class _Refused(Exception):
    """Raised from a parser callback to stop the parser; `send_400_response` then answers the refusal."""


def json_error_answer(err: ApiError) -> bytes:
    """A whole error answer in the native shape, written by the protocol itself (the app never saw it)."""
    request_id = new_request_id()
    body = orjson.dumps({"error": err.code, "message": err.message, "request_id": request_id})
    head = b"content-type: application/json\r\nx-request-id: %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
    return STATUS_LINE[err.status] + head % (request_id.encode(), len(body)) + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """One connection. `guard` is bound per server with functools.partial (`http/server.py`)."""

    def __init__(self, *args: Any, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard
        self.limits = guard.limits
        self.in_head = True  # reading a request head (or waiting for one), not a body
        self.head_bytes = 0
        self.deadline = 0.0  # loop time by which the head or body in progress must have arrived; 0 = none
        self.refusal: ApiError | None = None
        self.lingering = False  # answered before its body was read: the rest is read and discarded, then close
        self.linger_left = 0
        self.linger_end = 0.0
        self.first_byte = 0.0  # time.monotonic() of the request head's first byte: where its clock starts

    # -- connection life ----------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        guard = self.guard
        guard.waiting[self] = None
        # Jittered first deadline (1-1.5 header timeouts): a flood of silent connections is closed, and comes
        # back, spread over half a timeout rather than in one burst of accepts that would stall the loop.
        self.deadline = self.loop.time() + self.limits.header_timeout_s * (1.0 + 0.5 * random.random())
        guard.start_sweeping(self.loop, self.connections)
        if not guard.make_room(self, len(self.connections)):
            self.close_quietly()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.cycle is not None and isinstance(self.cycle.transport, _Lingering):
            self.cycle.transport = self.transport  # no cycle -> wrapper -> protocol -> cycle left behind
        self.guard.waiting.pop(self, None)
        self.deadline = 0.0
        super().connection_lost(exc)

    def close_quietly(self) -> None:
        self.guard.waiting.pop(self, None)
        self.deadline = 0.0
        if not self.transport.is_closing():
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self.pipeline:
            self.guard.waiting[self] = None  # idle keep-alive: evictable, oldest first

    # -- reading ------------------------------------------------------------------------------------------
    def linger(self) -> None:
        """nginx's lingering close (module docstring), for an answer given before the body was read whole."""
        transport = self.transport
        if self.lingering or transport.is_closing():
            return
        if self.in_head or not _can_write_eof(transport):  # the body has ended already: nothing to wait for
            transport.close()
            return
        self.lingering = True
        self.linger_left = LINGER_BYTES
        self.guard.waiting.pop(self, None)
        self.linger_end = self.loop.time() + LINGER_MAX_S
        self.deadline = self.loop.time() + LINGER_S
        transport.write_eof()
        self.flow.resume_reading()  # reading was paused while the unread body filled its buffer

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            self.linger_left -= len(data)
            if self.linger_left < 0:
                self.close_quietly()
                return
            self.deadline = min(self.linger_end, self.loop.time() + LINGER_S)  # the body still comes: wait on
            super().data_received(data)  # parsed only to see where the body ends (`on_message_complete`)
            return
        if not self.in_head:
            super().data_received(data)
            return
        if self.head_bytes == 0:  # a request begins: its clock starts here, not when the app is called
            self.first_byte = time.monotonic()
            if not self.deadline:  # on a kept-alive connection
                self.deadline = self.loop.time() + self.limits.header_timeout_s
        room = self.limits.max_header_bytes - self.head_bytes
        if len(data) <= room:
            self.head_bytes += len(data)
            super().data_received(data)
            return
        # The head may end inside this read: feed what fits; if it is still open after that, it is too big.
        view = memoryview(data)
        self.head_bytes += room
        super().data_received(view[:room])  # type: ignore[arg-type]  # httptools feeds any buffer; uvicorn says bytes
        if self.in_head:
            if self.parser is not None and not self.transport.is_closing():
                self.refuse(
                    errors.headers_too_large(f"the request head is over the {self.limits.max_header_bytes}-byte limit")
                )
            return
        if self.parser is not None and not self.transport.is_closing():
            self.data_received(view[room:])

    def on_header(self, name: bytes, value: bytes) -> None:
        # uvicorn's, plus the header count and the transfer coding.
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        elif name == b"transfer-encoding" and value.strip().lower() != b"chunked":
            self.refusal = errors.not_implemented("only the chunked transfer coding is supported")
            raise _Refused
        self.headers.append((name, value))
        if len(self.headers) > self.limits.max_headers:
            self.refusal = errors.headers_too_large(f"the request has over {self.limits.max_headers} headers")
            raise _Refused

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self.scope[FIRST_BYTE] = self.first_byte  # type: ignore[literal-required]  # an extension key of ours
        self.in_head = False
        self.guard.waiting.pop(self, None)
        self.deadline = self.loop.time() + self.limits.body_timeout_s
        if self.cycle is not None and type(self.cycle) is RequestResponseCycle:
            self.cycle.__class__ = GuardedCycle  # same object, one method more: no allocation

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self.lingering:  # the refused body has ended: every byte of it was read, so the close is clean
            self.close_quietly()
            return
        self.in_head = True
        self.head_bytes = 0
        self.deadline = 0.0

    # -- refusing -----------------------------------------------------------------------------------------
    def expire(self) -> None:
        """The sweep found this connection past its deadline."""
        cycle = self.cycle if self.cycle is not None and not self.cycle.response_complete else None  # in the app
        if self.in_head and cycle is not None and not self.lingering:
            # The next request of a pipelining client trickles in while the app still answers this one: its
            # clock starts once the answer is out.
            self.deadline = self.loop.time() + self.limits.header_timeout_s
            return
        # Lingering over, not a byte of a request (nobody to answer), or an answer under way: close.
        if self.lingering or (self.in_head and self.head_bytes == 0) or (cycle is not None and cycle.response_started):
            self.close_quietly()
            return
        late, limit_s = "head", self.limits.header_timeout_s
        if cycle is not None:
            # The app is waiting on the body: it sees a disconnect, and writes nothing after this answer.
            cycle.disconnected = True
            cycle.message_event.set()
            late, limit_s = "body", self.limits.body_timeout_s
        self.refuse(errors.request_timeout(f"the request {late} did not arrive within {limit_s:g} s"))

    def refuse(self, err: ApiError) -> None:
        self.refusal = err
        self.send_400_response("")

    def send_400_response(self, msg: str) -> None:
        """uvicorn calls this on a parse error (and so, through `_Refused`, on a refusal from a callback)."""
        if self.lingering:  # the answer is out already: the discarded rest did not parse
            self.close_quietly()
            return
        err = self.refusal or errors.invalid(f"malformed HTTP request: {msg}")
        if not self.transport.is_closing():
            self.transport.write(json_error_answer(err))
        self.close_quietly()
