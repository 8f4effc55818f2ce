"""Open-loop Poisson load that keeps one record per request, for the fault drill and the overload run.

Why not `bench.loadgen`: it measures a steady window and keeps aggregates. A drill must say what happened to
*each* request around an event (a hang, a signal, the process exiting): its own input (poison or not), when it
was scheduled, sent and answered, its status and error code, and how it failed when there was no answer. So
this sender keeps per-request arrays, fires timed events (a signal) on the same clock, and samples the server
(`/internal/health`, RSS from /proc) alongside. Latency is counted from the *scheduled* send time (open loop:
a late client shows up as latency); `sent` tells the client's own lag apart.

All times are seconds from the run's start (t0) on `time.monotonic()`. Every loop is bounded: the schedule is
finite, every request has a client timeout, and the sampler stops with the run.
"""

from __future__ import annotations

import asyncio
import math
import gc
import os
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import aiohttp
import numpy as np
import orjson
import uvloop

from bench.procstat import process_cpu_s, raise_fd_limit, rss_mb

JSON_HEADERS = {"Content-Type": "application/json"}
SAMPLE_EVERY_S = 0.1


@dataclass
class Records:
    """One entry per request, index i = the i-th scheduled request."""

    sched: np.ndarray  # scheduled send offset
    kinds: list[str]  # "normal", or what the drill planted ("poison", "hang")
    sent: np.ndarray = field(init=False)  # actual send offset
    done: np.ndarray = field(init=False)  # offset of the answer (or of the failure), nan when never finished
    status: np.ndarray = field(init=False)  # HTTP status; 0 when no HTTP answer came
    code: list[str] = field(init=False)  # error code from the body, "" for 200
    failure: list[str] = field(init=False)  # why no answer: client_timeout, connect, disconnected, ...
    detail: list[str] = field(init=False)  # the client's exception text, for the report
    wrong: np.ndarray = field(init=False)  # a 200 whose output was not the input reversed
    new_conn: np.ndarray = field(init=False)  # 1: sent on a new connection, 0: on a reused keep-alive one
    queue_ms: np.ndarray = field(init=False)
    server_ms: np.ndarray = field(init=False)  # the server's own latency_ms (arrival to answer) of a 200
    batch_size: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.sched)
        self.sent, self.done = np.full(n, np.nan), np.full(n, np.nan)
        self.status, self.batch_size = np.zeros(n, np.int32), np.zeros(n, np.int32)
        self.queue_ms, self.wrong = np.full(n, np.nan), np.zeros(n, bool)
        self.new_conn = np.full(n, -1, np.int8)
        self.server_ms = np.full(n, np.nan)
        self.code, self.failure, self.detail = [""] * n, [""] * n, [""] * n

    @property
    def latency_ms(self) -> np.ndarray:
        return (self.done - self.sched) * 1000


@dataclass
class Sample:
    t: float
    rss_mb: float | None  # process samples carry rss_mb and cpu_s, health samples the rest
    cpu_s: float | None = None  # the server's utime + stime so far
    healthy: int | None = None
    workers: int | None = None
    queue_depth: int | None = None
    inflight: int | None = None
    status: str | None = None


@dataclass
class Event:
    at: float  # scheduled offset
    name: str
    action: Callable[[], None]
    fired: float = float("nan")  # actual offset


@dataclass
class Run:
    records: Records
    samples: list[Sample]
    events: list[Event]
    exited_at: float | None  # offset at which the server process exited, if it did
    wall_t0: float  # time.time() at t0, to line the server's log up with the run
    client_cpu_s: float


def watch_exit(proc: subprocess.Popen[bytes], t0: float, out: list[float]) -> None:
    """Record when the server process exits (a thread, since Popen.wait blocks)."""

    def wait() -> None:
        proc.wait()
        out.append(time.monotonic() - t0)

    threading.Thread(target=wait, name="exit-watch", daemon=True).start()


async def _sample_process(pid: int, t0: float, until: float, out: list[Sample], alive: Callable[[], bool]) -> None:
    """RSS and CPU from /proc every SAMPLE_EVERY_S: local reads, so a slow server cannot thin them out."""
    while time.monotonic() - t0 < until and alive():
        try:
            cpu = process_cpu_s(pid)
        except (OSError, IndexError, ValueError):
            cpu = None
        rss = rss_mb(pid)
        out.append(Sample(time.monotonic() - t0, None if math.isnan(rss) else rss, cpu))
        await asyncio.sleep(SAMPLE_EVERY_S)


async def _sample_health(
    session: aiohttp.ClientSession, base: str, t0: float, until: float, out: list[Sample], alive: Callable[[], bool]
) -> None:
    """Healthy workers, queue depth and in-flight count from /internal/health, about every SAMPLE_EVERY_S."""
    timeout = aiohttp.ClientTimeout(total=1.0)
    while time.monotonic() - t0 < until and alive():
        s = Sample(time.monotonic() - t0, None)
        try:
            async with session.get(base + "/internal/health", timeout=timeout) as resp:
                h = orjson.loads(await resp.read())
            workers = h.get("workers", [])
            s.healthy, s.workers = sum(1 for w in workers if w.get("healthy")), len(workers)
            s.queue_depth, s.inflight, s.status = h.get("queue_depth"), h.get("inflight"), h.get("status")
            out.append(s)
        except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError, AttributeError):
            pass
        await asyncio.sleep(max(0.0, SAMPLE_EVERY_S - (time.monotonic() - t0 - s.t)))


async def _run(
    base: str,
    records: Records,
    inputs: list[str],
    events: list[Event],
    pid: int,
    proc: subprocess.Popen[bytes],
    timeout_s: float,
    connections: int,
    sample_until: float,
    headers: dict[str, str] | None = None,
    extras: list[dict | None] | None = None,
) -> Run:
    url = base.rstrip("/") + "/v1/inference"
    t0 = time.monotonic() + 0.05
    wall_t0 = time.time() + 0.05
    cpu0 = time.process_time()
    exited: list[float] = []
    watch_exit(proc, t0, exited)
    samples: list[Sample] = []
    r = records
    req_headers = {**JSON_HEADERS, **headers} if headers else JSON_HEADERS

    async def on_new(
        session: aiohttp.ClientSession, ctx: SimpleNamespace, params: aiohttp.TraceConnectionCreateEndParams
    ) -> None:  # which connection a request went out on, for resets
        if ctx.trace_request_ctx is not None:
            r.new_conn[ctx.trace_request_ctx] = 1

    async def on_reuse(
        session: aiohttp.ClientSession, ctx: SimpleNamespace, params: aiohttp.TraceConnectionReuseconnParams
    ) -> None:
        if ctx.trace_request_ctx is not None:
            r.new_conn[ctx.trace_request_ctx] = 0

    tracing = aiohttp.TraceConfig()
    tracing.on_connection_create_end.append(on_new)
    tracing.on_connection_reuseconn.append(on_reuse)
    connector = aiohttp.TCPConnector(limit=connections, limit_per_host=0, keepalive_timeout=60, ttl_dns_cache=None)
    async with aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        skip_auto_headers=("User-Agent",),
        trace_configs=[tracing],
    ) as session:

        async def send(i: int) -> None:
            text = inputs[i]
            extra = extras[i] if extras is not None else None
            body = orjson.dumps({"input": text, **extra} if extra else {"input": text})
            r.sent[i] = time.monotonic() - t0
            try:
                async with session.post(url, data=body, headers=req_headers, trace_request_ctx=i) as resp:
                    raw = await resp.read()
                    r.status[i] = resp.status
                r.done[i] = time.monotonic() - t0
                body = orjson.loads(raw)
                if resp.status == 200:
                    r.wrong[i] = body.get("output") != text[::-1]
                    r.queue_ms[i], r.batch_size[i] = body.get("queue_ms", np.nan), body.get("batch_size", 0)
                    r.server_ms[i] = body.get("latency_ms", np.nan)
                else:
                    r.code[i] = str(body.get("error", "?"))
            except TimeoutError:
                r.failure[i] = "client_timeout"
            except aiohttp.ClientConnectorError:
                r.failure[i] = "connect"  # never reached the server (it had exited): not an accepted request
            except aiohttp.ServerDisconnectedError:
                r.failure[i] = "disconnected"  # the connection closed before the answer (or was reused stale)
            except aiohttp.ClientError as exc:
                r.failure[i] = f"conn:{type(exc).__name__}"
                r.detail[i] = str(exc)[:120]
            except (orjson.JSONDecodeError, AttributeError):
                r.code[i] = "non-JSON"
            if r.failure[i]:
                r.done[i] = np.nan
                r.status[i] = 0

        async def fire(ev: Event) -> None:
            await asyncio.sleep(max(0.0, t0 + ev.at - time.monotonic()))
            ev.fired = time.monotonic() - t0
            ev.action()

        samplers = [
            asyncio.create_task(_sample_process(pid, t0, sample_until, samples, lambda: not exited)),
            asyncio.create_task(_sample_health(session, base, t0, sample_until, samples, lambda: not exited)),
        ]
        firing = [asyncio.create_task(fire(ev)) for ev in events]
        tasks = []
        loop = asyncio.get_running_loop()
        for i, due in enumerate(r.sched):
            delay = t0 + float(due) - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(loop.create_task(send(i)))
        await asyncio.gather(*firing)
        await asyncio.gather(*tasks)
        for task in samplers:
            task.cancel()
        await asyncio.gather(*samplers, return_exceptions=True)
    samples.sort(key=lambda x: x.t)
    return Run(r, samples, events, exited[0] if exited else None, wall_t0, time.process_time() - cpu0)


def run(
    base: str,
    sched: np.ndarray,
    inputs: list[str],
    kinds: list[str],
    events: list[Event],
    pid: int,
    proc: subprocess.Popen[bytes],
    timeout_s: float = 10.0,
    connections: int = 4096,
    sample_until: float | None = None,
    headers: dict[str, str] | None = None,
    extras: list[dict | None] | None = None,
) -> Run:
    """Send one request per `sched` offset with `inputs[i]`, fire `events`, sample the server; on uvloop.
    `headers` (an API key) go with every request, `extras[i]` (body fields: a priority) with request i.

    The cyclic GC is off during the run (as in bench.loadgen): a full collection over tens of thousands of
    live tasks stalls the client, which would show up as server latency."""
    raise_fd_limit()
    gc.collect()
    gc.disable()
    try:
        until = float(sched[-1]) + timeout_s if sample_until is None and len(sched) else (sample_until or 0.0)
        return uvloop.run(
            _run(base, Records(sched, kinds), inputs, events, pid, proc, timeout_s, connections, until, headers, extras)
        )
    finally:
        gc.enable()
        gc.collect()


def signal_event(at: float, pid: int, sig: int, name: str) -> Event:
    return Event(at, name, lambda: os.kill(pid, sig))
