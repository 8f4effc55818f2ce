"""The guarded protocol writes a response of known length in one transport write (head and body together),
streams its head at once, and keeps the bytes and their order exactly as uvicorn would write them.

In-process: the real `GuardedHttpToolsProtocol` on a real event loop, a transport that records its writes, and
small ASGI apps; the live-server tests elsewhere cover the same paths end to end but cannot see how many writes
an answer took (loopback merges them).
"""

from __future__ import annotations

import asyncio

import pytest
import uvicorn
from uvicorn.server import ServerState

from batchserve.http.uvicorn_protocol import (
    ConnectionGuard,
    ConnectionLimits,
    GuardedHttpToolsProtocol,
)
from batchserve.http.endpoint import whole_answer_sender


class RecordingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False
        self.closed_by_answer = False  # closed before the connection was lost: the answer said close

    def write(self, data: bytes) -> None:  # type: ignore[override]
        assert not self.closed, "write after close"
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default=None):  # type: ignore[override]
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...


async def exchange(app, request: bytes, settle: int = 20) -> RecordingTransport:
    config = uvicorn.Config(app, lifespan="off", access_log=False, log_level="warning")
    config.load()
    guard = ConnectionGuard.create(ConnectionLimits())
    state = ServerState()
    state.default_headers = [(b"date", b"Thu, 26 Nov 2026 09:00:00 GMT"), (b"server", b"uvicorn")]
    protocol = GuardedHttpToolsProtocol(config=config, server_state=state, app_state={}, guard=guard)
    transport = RecordingTransport()
    protocol.connection_made(transport)
    protocol.data_received(request)
    for _ in range(settle):  # the app runs as a task: let it finish
        await asyncio.sleep(0)
    transport.closed_by_answer = transport.closed
    protocol.connection_lost(None)
    if guard._sweep is not None:
        guard._sweep.cancel()
    return transport


def fixed_body_app(body: bytes, chunks: int = 1):
    async def app(scope, receive, send):
        await receive()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))],
            }
        )
        step = -(-len(body) // chunks)
        for i in range(chunks):
            await send(
                {"type": "http.response.body", "body": body[i * step : (i + 1) * step], "more_body": i < chunks - 1}
            )

    return app


GET = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"


def split(raw: bytes) -> tuple[bytes, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return head, body


def test_a_small_answer_leaves_in_one_write():
    t = asyncio.run(exchange(fixed_body_app(b'{"output":"x"}'), GET))
    assert len(t.writes) == 1, t.writes
    head, body = split(t.writes[0])
    assert head.startswith(b"HTTP/1.1 200 OK") and b"content-length: 14" in head
    assert body == b'{"output":"x"}'
    assert b"connection: close" not in head and not t.closed_by_answer  # keep-alive as before


def test_a_body_in_parts_follows_its_head_in_order():
    body = b"abcdefghij" * 10
    t = asyncio.run(exchange(fixed_body_app(body, chunks=3), GET))
    assert len(t.writes) == 3  # head with the first part, then one write a part
    head, rest = split(b"".join(t.writes))
    assert rest == body and t.writes[0].startswith(b"HTTP/1.1 200")


def test_a_head_request_still_gets_its_head():
    t = asyncio.run(exchange(fixed_body_app(b"hello"), b"HEAD / HTTP/1.1\r\nhost: x\r\n\r\n"))
    assert len(t.writes) == 1
    head, body = split(t.writes[0])
    assert head.startswith(b"HTTP/1.1 200") and body == b""


def test_a_stream_sends_its_head_before_its_first_chunk():
    seen: list[int] = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        seen.append(len(transport_ref[0].writes))  # the head is out before the app produces anything
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    transport_ref: list[RecordingTransport] = []
    original = RecordingTransport.__init__

    def remember(self) -> None:
        original(self)
        transport_ref.append(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RecordingTransport, "__init__", remember)
        t = asyncio.run(exchange(app, GET))
    assert seen == [1] and t.writes[0].startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in t.writes[0]
    assert b"".join(t.writes).endswith(b"0\r\n\r\n")


def test_a_large_body_is_not_copied_to_join_its_head():
    body = b"x" * 200_000
    t = asyncio.run(exchange(fixed_body_app(body), GET))
    assert len(t.writes) == 2 and t.writes[1] == body


def test_an_answer_before_the_body_closes_after_one_write():
    async def refuse(scope, receive, send):  # answers without reading the declared body
        await send({"type": "http.response.start", "status": 413, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"{}"})

    t = asyncio.run(exchange(refuse, b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n"))
    assert len(t.writes) == 1 and b"connection: close" in t.writes[0] and t.writes[0].endswith(b"{}")
    assert t.closed_by_answer


# -- send_whole: the inference route's answer, written without the ASGI messages -----------------------------
HEADERS = [
    (b"content-type", b"application/json"),
    (b"x-request-id", b"abc-1"),
    (b"server-timing", b"queue;dur=1.0, compute;dur=100.2"),
]


def asgi_app(body: bytes):
    async def app(scope, receive, send):
        await receive()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*HEADERS, (b"content-length", b"%d" % len(body))],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


def whole_app(body: bytes, read_body: bool = True):
    async def app(scope, receive, send):
        if read_body:
            await receive()
        send_whole = whole_answer_sender(send)
        assert send_whole is not None
        await send_whole(200, b"".join(b"%s: %s\r\n" % h for h in HEADERS), body)

    return app


@pytest.mark.parametrize(
    "request_bytes",
    [
        GET,
        b"HEAD / HTTP/1.1\r\nhost: x\r\n\r\n",
        b"GET / HTTP/1.0\r\n\r\n",  # no keep-alive: connection: close, and the connection closes
        b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello",
    ],
)
def test_send_whole_writes_the_bytes_send_would_in_one_write(request_bytes):
    body = b'{"output":"olleh"}'
    expected = asyncio.run(exchange(asgi_app(body), request_bytes))
    got = asyncio.run(exchange(whole_app(body), request_bytes))
    assert len(got.writes) == 1 and b"date: Thu, 26 Nov 2026" in got.writes[0]
    assert got.writes[0] == b"".join(expected.writes)
    assert got.closed_by_answer == expected.closed_by_answer


def test_send_whole_before_the_body_was_read_closes_the_connection():
    t = asyncio.run(
        exchange(whole_app(b"{}", read_body=False), b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n")
    )
    assert len(t.writes) == 1 and b"connection: close\r\n" in t.writes[0] and t.closed_by_answer


def test_other_servers_get_the_asgi_messages():
    async def plain_send(message):
        pass

    assert whole_answer_sender(plain_send) is None
