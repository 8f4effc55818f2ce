"""The reference row: the smallest dynamic batcher on batchserve's own stack, for one simulated device.

Why: "how close is batchserve to the hardware's best?" needs a floor measured on the same machine, uvicorn
configuration and client. This is that floor: a Starlette endpoint puts (input, future) on a list; one task
takes everything waiting (up to 100) as soon as the device is free, runs the batch (sleep 100 ms in a thread,
outputs reversed) and resolves the futures. No admission, tiers, metrics, deadlines, records or retries: for
one device, "take everything when the device frees" is also the ideal policy (`bench/ideal.py`).

Run: `python -m bench.minimal_batcher --port 0`; it logs "Uvicorn running on http://127.0.0.1:PORT".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

BATCH_S, MAX_BATCH = 0.1, 100
waiting: list[tuple[str, asyncio.Future]] = []
arrived = asyncio.Event()


def run_batch(texts: list[str]) -> list[str]:
    time.sleep(BATCH_S)
    return [t[::-1] for t in texts]


async def batcher(waiting: list[tuple[str, asyncio.Future]] = waiting, arrived: asyncio.Event = arrived) -> None:
    """Take what waits (up to MAX_BATCH) whenever the device is free; `bench/raw_apps.py` runs it on its own list."""
    while True:
        await arrived.wait()
        batch, waiting[:] = waiting[:MAX_BATCH], waiting[MAX_BATCH:]
        if not waiting:
            arrived.clear()
        started = time.perf_counter()
        outputs = await asyncio.to_thread(run_batch, [text for text, _ in batch])
        compute_ms = (time.perf_counter() - started) * 1000
        for (_, future), output in zip(batch, outputs):
            if not future.done():
                future.set_result((output, compute_ms, len(batch)))


async def inference(request: Request) -> Response:
    started = time.perf_counter()
    text = orjson.loads(await request.body())["input"]
    future = asyncio.get_running_loop().create_future()
    waiting.append((text, future))
    arrived.set()
    output, compute_ms, size = await future
    request_id = "req_" + secrets.token_hex(8)
    latency_ms = (time.perf_counter() - started) * 1000
    return Response(
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
        media_type="application/json",
        headers={"X-Request-ID": request_id},
    )


async def readyz(request: Request) -> Response:
    return Response(b'{"status":"ready"}', media_type="application/json")


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    task = asyncio.get_running_loop().create_task(batcher())
    yield
    task.cancel()


def create_app() -> Starlette:
    return Starlette(
        routes=[
            Route("/v1/inference", inference, methods=["POST"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/healthz", readyz, methods=["GET"]),
        ],
        lifespan=lifespan,
    )


def main() -> None:
    p = argparse.ArgumentParser(description="the minimal asyncio batcher: the reference row")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8002)
    a = p.parse_args()
    # The same uvicorn settings as batchserve/http/server.py.
    uvicorn.run(
        create_app(),
        host=a.host,
        port=a.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="info",
        timeout_graceful_shutdown=5,
        backlog=4096,
    )


if __name__ == "__main__":
    main()
