"""The CPU-per-request baseline: a bare Starlette endpoint that answers at once.

Why: "server CPU per request" only means something next to what the HTTP stack alone costs. This app runs
on the same uvicorn configuration as batchserve (uvloop, httptools, access log off, same backlog), parses the
same JSON body with orjson and answers the same shape of JSON with the input reversed, with no batching,
threads, metrics or bookkeeping. batchserve's CPU per request divided by this one is the overhead ratio.

Run: `python -m bench.bare_app --port 0`; it logs "Uvicorn running on http://127.0.0.1:PORT" like the server.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


HOLD_S = 0.0  # --hold-ms: answer after this long, to cost what holding a connection open costs a batcher


async def inference(request: Request) -> Response:
    data = orjson.loads(await request.body())
    if HOLD_S:
        await asyncio.sleep(HOLD_S)
    text = data["input"]
    request_id = "req_" + secrets.token_hex(8)
    body = {
        "request_id": request_id,
        "output": text[::-1],
        "model": "bare@v1",
        "latency_ms": 0,
        "queue_ms": 0,
        "compute_ms": 0,
        "batch_size": 1,
    }
    return Response(orjson.dumps(body), media_type="application/json", headers={"X-Request-ID": request_id})


async def readyz(request: Request) -> Response:
    return Response(b'{"status":"ready"}', media_type="application/json")


def create_app() -> Starlette:
    return Starlette(
        routes=[
            Route("/v1/inference", inference, methods=["POST"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/healthz", readyz, methods=["GET"]),
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser(description="bare Starlette baseline for CPU per request")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument(
        "--hold-ms",
        type=float,
        default=0.0,
        help="answer each request after this delay (the batcher's latency), to separate the CPU cost "
        "of many open, waiting connections from the cost of batching",
    )
    a = p.parse_args()
    global HOLD_S
    HOLD_S = a.hold_ms / 1000
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
