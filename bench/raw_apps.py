"""The floor under the in-process hot path (bench/hotpath.py --floor): the bare endpoint and the minimal batcher
written as plain ASGI apps, as batchserve's inference route is.

Why: `bench/bare_app.py` and `bench/minimal_batcher.py` are Starlette apps, and Starlette's Request, Response
and router cost about as much as the rest of a bare endpoint; batchserve's hot route skips them. Compared with
these two instead, the gap says what batchserve's own policy costs (admission, tiers, deadlines, records,
metrics), and `minimal ASGI - bare ASGI` is what any batcher pays for holding a request across a batch on this
stack (a future, a suspended task, the batch loop's hand-off to a thread and back), whatever its policy.
Both answer the same JSON as their Starlette twins.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable

import orjson

from bench.minimal_batcher import batcher  # the same batch loop and device as the Starlette twin's

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
HEADERS = [(b"content-type", b"application/json")]


async def _body(receive: Receive) -> bytes:
    message = await receive()
    body = message.get("body", b"")
    while message.get("more_body", False):
        message = await receive()
        body += message.get("body", b"")
    return body


async def _answer(send: Send, out: bytes, request_id: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [*HEADERS, (b"x-request-id", request_id.encode()), (b"content-length", b"%d" % len(out))],
        }
    )
    await send({"type": "http.response.body", "body": out})


class BareAsgi:
    """`bench/bare_app.py`'s endpoint without Starlette: parse, answer at once."""

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        text = orjson.loads(await _body(receive))["input"]
        request_id = "req_" + secrets.token_hex(8)
        await _answer(
            send,
            orjson.dumps(
                {
                    "request_id": request_id,
                    "output": text[::-1],
                    "model": "bare@v1",
                    "latency_ms": 0,
                    "queue_ms": 0,
                    "compute_ms": 0,
                    "batch_size": 1,
                }
            ),
            request_id,
        )


class MinimalAsgi:
    """`bench/minimal_batcher.py` without Starlette: a future per request on a list, one task takes what waits
    (up to 100) when the device is free and runs it in a thread (100 ms)."""

    def __init__(self) -> None:
        self.waiting: list[tuple[str, asyncio.Future]] = []
        self.arrived = asyncio.Event()
        self.task: asyncio.Task | None = None

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(batcher(self.waiting, self.arrived))
        started = time.perf_counter()
        text = orjson.loads(await _body(receive))["input"]
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((text, future))
        self.arrived.set()
        output, compute_ms, size = await future
        request_id = "req_" + secrets.token_hex(8)
        latency_ms = (time.perf_counter() - started) * 1000
        await _answer(
            send,
            orjson.dumps(
                {
                    "request_id": request_id,
                    "output": output,
                    "model": "minimal@v1",
                    "latency_ms": round(latency_ms),
                    "queue_ms": round(latency_ms - compute_ms),
                    "compute_ms": round(compute_ms),
                    "batch_size": size,
                }
            ),
            request_id,
        )

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
