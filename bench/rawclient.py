"""A cheap open-loop HTTP/1.1 sender for `bench.loadgen` (`--client raw`): the same schedule and the same
measurements as the aiohttp sender, at a fraction of its CPU.

Why: on a 2-core machine the load generator competes with the servers (and, in `bench.fleet`, with nginx and
three servers); aiohttp's client costs about 0.25 ms of CPU per request, which at 2,000+ RPS is a quarter of
the machine and shows up as send lag. Here one `asyncio.Protocol` per keep-alive connection writes a prebuilt
request and parses the answer's status line, `Content-Length` and `Connection` itself; no task, future or
response object is made per request. One request at a time per connection (no pipelining, which would queue
answers behind each other); a new connection is opened when none is idle, up to `connections`.

Outcomes match the aiohttp sender's: latency from the scheduled send time for a 200 with the right output,
"mismatch", "<status> <error code>", "client_timeout", "conn:<exception name>".
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import numpy as np
import orjson

SWEEP_S = 0.1  # how often requests past the client timeout are looked for


Judge = Callable[[str, int, dict], "str | None"]  # (input text, status, answer): None if right, else the outcome


def reversed_output(text: str, status: int, answer: dict) -> str | None:
    """The sim's answer: a 200 whose output is the input reversed."""
    if status != 200:
        return f"{status} {answer.get('error', '?')}"
    return None if answer.get("output") == text[::-1] else "mismatch"


@dataclass
class RawOutcome:
    latency_s: np.ndarray  # NaN unless answered 200 with the right output
    lag_s: np.ndarray
    server_ms: np.ndarray
    errors: list[tuple[int, str]]  # (schedule index, outcome)


class _Conn(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self, sender: _Sender) -> None:
        self.sender = sender
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.j = -1  # position (in the sender's share) of the request in flight, -1 when idle
        self.sent_at = 0.0
        self.body_at = -1  # where the body starts once the head is read
        self.need = -1  # total bytes of head + body once known
        self.status = 0
        self.close_after = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def start(self, j: int, request: bytes) -> None:
        assert self.transport is not None
        self.j, self.sent_at = j, time.monotonic()
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()  # the answer's clock stops when its bytes arrive, before any parsing
        self.buf += data
        if self.need < 0:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
            self.status = int(lines[0].split(" ", 2)[1])
            length, self.close_after = 0, False
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value)
                elif name == "connection" and "close" in value.lower():
                    self.close_after = True
                elif name == "transfer-encoding":
                    self.fail("client:chunked answer")
                    return
            self.body_at, self.need = end + 4, end + 4 + length
        if len(self.buf) >= self.need:
            body = bytes(self.buf[self.body_at : self.need])
            del self.buf[: self.need]
            j, status = self.j, self.status
            self.j, self.need, self.body_at = -1, -1, -1
            self.sender.answered(self, j, status, body, now)

    def fail(self, outcome: str) -> None:
        j, self.j = self.j, -1
        if j >= 0:
            self.sender.failed(j, outcome)
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.sender.lost(self)
        if self.j >= 0:
            j, self.j = self.j, -1
            self.sender.failed(j, f"conn:{type(exc).__name__ if exc else 'ServerDisconnectedError'}")


class _Sender:
    def __init__(
        self,
        url: str,
        k: int,
        text_of: Callable[[int], str],
        idx: np.ndarray,
        timeout_s: float,
        connections: int,
        headers: dict[str, str] | None,
        extra: dict | None,
        judge: Judge,
    ) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        head = f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        for name, value in (headers or {}).items():
            if name.lower() != "content-type":
                head += f"{name}: {value}\r\n"
        self.head = head + "Content-Length: "
        self.text_of, self.idx, self.extra, self.judge = text_of, idx, extra, judge
        self.timeout_s, self.connections = timeout_s, connections
        self.latency, self.lag, self.server_ms = np.full(k, np.nan), np.full(k, np.nan), np.full(k, np.nan)
        self.due = np.zeros(k)
        self.errors: list[tuple[int, str]] = []
        self.idle: list[_Conn] = []
        self.busy: set[_Conn] = set()
        self.opening = 0
        self.waiting: deque[tuple[int, bytes]] = deque()
        self.pending = 0
        self.all_done = asyncio.Event()
        self.sending_done = False

    def request(self, j: int) -> bytes:
        text = self.text_of(int(self.idx[j]))
        body = orjson.dumps({"input": text, **self.extra} if self.extra else {"input": text})
        return (self.head + f"{len(body)}\r\n\r\n").encode() + body

    def send(self, j: int, due: float) -> None:
        self.due[j] = due
        self.lag[j] = time.monotonic() - due
        self.pending += 1
        self.dispatch(j, self.request(j))

    def dispatch(self, j: int, request: bytes) -> None:
        if self.idle:
            conn = self.idle.pop()
            self.busy.add(conn)
            conn.start(j, request)
        elif len(self.busy) + self.opening < self.connections:
            self.opening += 1
            asyncio.get_running_loop().create_task(self.connect(j, request))
        else:
            self.waiting.append((j, request))

    async def connect(self, j: int, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Conn(self), self.host, self.port), self.timeout_s
            )
        except Exception as exc:  # noqa: BLE001 - refused, timed out, or anything else: this request failed
            self.opening -= 1
            self.failed(j, "client_timeout" if isinstance(exc, asyncio.TimeoutError) else f"conn:{type(exc).__name__}")
            self.next_waiting()
            return
        self.opening -= 1
        self.busy.add(conn)
        conn.start(j, request)

    def next_waiting(self) -> None:
        if self.waiting:
            self.dispatch(*self.waiting.popleft())

    def answered(self, conn: _Conn, j: int, status: int, body: bytes, end: float) -> None:
        try:
            answer = orjson.loads(body) if body else {}
        except orjson.JSONDecodeError:
            answer = None
        i = int(self.idx[j])
        if not isinstance(answer, dict):
            self.errors.append((i, "non-JSON answer" if answer is None else f"{status} non-object"))
        elif (wrong := self.judge(self.text_of(i), status, answer)) is not None:
            self.errors.append((i, wrong))
        else:
            self.latency[j] = end - self.due[j]
            self.server_ms[j] = answer.get("latency_ms", math.nan)
        self.done_one()
        if conn.close_after:
            self.busy.discard(conn)
            if conn.transport is not None:
                conn.transport.close()
            self.next_waiting()
        elif self.waiting:
            conn.start(*self.waiting.popleft())
        else:
            self.busy.discard(conn)
            self.idle.append(conn)

    def failed(self, j: int, outcome: str) -> None:
        self.errors.append((int(self.idx[j]), outcome))
        self.done_one()

    def lost(self, conn: _Conn) -> None:
        self.busy.discard(conn)
        if conn in self.idle:
            self.idle.remove(conn)
        self.next_waiting()

    def done_one(self) -> None:
        self.pending -= 1
        if self.sending_done and self.pending == 0:
            self.all_done.set()

    def sweep(self) -> None:
        """Answer `client_timeout` for requests past the client timeout (their connection is dropped)."""
        limit = time.monotonic() - self.timeout_s
        for conn in [c for c in self.busy if c.j >= 0 and c.sent_at < limit]:
            conn.fail("client_timeout")

    def close(self) -> None:
        for conn in [*self.idle, *self.busy]:
            if conn.transport is not None:
                conn.transport.close()


async def drive_raw(
    url: str,
    sched: np.ndarray,
    idx: np.ndarray,
    t0: float,
    text_of: Callable[[int], str],
    timeout_s: float,
    connections: int,
    headers: dict[str, str] | None = None,
    extra: dict | None = None,
    judge: Judge = reversed_output,
) -> RawOutcome:
    """Send request i (body `{"input": text_of(i), **extra}`) at t0 + sched[i] for every i in idx, whatever
    the answers; return when every one is answered or has failed (`judge` tells a right answer)."""
    sender = _Sender(url, len(idx), text_of, idx, timeout_s, connections, headers, extra, judge)

    async def sweeper() -> None:
        while not sender.all_done.is_set():
            await asyncio.sleep(SWEEP_S)
            sender.sweep()

    sweeping = asyncio.create_task(sweeper())
    try:
        for j, i in enumerate(idx):
            due = t0 + float(sched[i])
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            sender.send(j, due)
        sender.sending_done = True
        if sender.pending == 0:
            sender.all_done.set()
        await sender.all_done.wait()
    finally:
        sweeping.cancel()
        sender.close()
    return RawOutcome(sender.latency, sender.lag, sender.server_ms, sender.errors)
