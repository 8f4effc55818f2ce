"""Open-loop Poisson load against `POST /v1/inference`, with the numbers the standard table needs.

Why open loop: a closed-loop client (N users, each waiting for its answer) slows down when the server does, so
it hides queueing. Here every request leaves at its precomputed exponential time whatever the answers, and its
latency is counted from that *scheduled* time, so a late client (or a stalled event loop) shows up as latency
instead of vanishing. The send lag (actual − scheduled) is reported to tell the two apart.

Every request carries a distinct input and must come back reversed (the sim contract); anything else counts
as an error ("mismatch"). Only requests scheduled inside the measured window (after the warm-up) count.
Around that window the server's `/metrics` and `/proc/<pid>/stat` are read, giving the mean batch size and the
server's CPU seconds per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import secrets
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import aiohttp
import numpy as np
import orjson
import uvloop

from bench.procstat import process_cpu_s, raise_fd_limit, self_cpu_s
from bench.schedule import poisson_schedule

INFERENCE_PATH = "/v1/inference"
JSON_HEADERS = {"Content-Type": "application/json"}
METRIC_SUMS = (  # histogram sums and counts read around the window (summed over labels)
    "batchserve_batch_size", "batchserve_request_duration_seconds", "batchserve_queue_wait_seconds",
    "batchserve_batch_compute_seconds",
)


@dataclass
class LoadResult:
    """One measured window. Latencies in ms over the successful requests; rates per second."""

    offered_rps: float  # the nominal rate asked for
    scheduled_rps: float  # requests scheduled in the window / window (the Poisson draw)
    achieved_rps: float  # successful answers to window requests / window
    count: int  # requests scheduled in the window
    ok: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float
    errors: dict[str, int]  # "503 SERVICE_OVERLOADED", "mismatch", "client_timeout", "conn:ClientOSError", ...
    error_count: int
    client_timeouts: int
    send_lag_p99_ms: float  # how late requests left the client: large means the client, not the server, lagged
    send_lag_max_ms: float
    mean_batch: float | None  # delta batch_size_sum / delta batch_size_count from /metrics
    server_mean_latency_ms: float | None  # the server's own arrival-to-answer mean over the window
    server_mean_queue_ms: float | None
    server_cpu_s: float | None  # utime+stime delta over the window
    server_cpu_ms_per_req: float | None
    server_cores: float | None  # server CPU / window wall time
    client_cores: float  # this client's CPU / window wall time (near 1.0: the client is saturated)
    window_s: float
    warmup_s: float
    seed: int
    settings: dict = field(default_factory=dict)


def input_for(tag: str, i: int) -> str:
    """A distinct, non-palindromic input per request, so a swapped answer is caught."""
    return f"{tag}-{i:07d}-batchserve ÿ→"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {sample name: value summed over its labels} (buckets skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        key, _, value = line.rpartition(" ")
        name = key.split("{", 1)[0]
        if name.endswith("_bucket"):
            continue
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


@dataclass
class Snapshot:
    at: float
    client_cpu: float
    server_cpu: float | None
    metrics: dict[str, float] | None


async def snapshot(session: aiohttp.ClientSession, base: str, pid: int | None, with_metrics: bool) -> Snapshot:
    at, client = time.monotonic(), self_cpu_s()
    server = process_cpu_s(pid) if pid else None
    metrics = None
    if with_metrics:
        try:
            async with session.get(base + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status == 200:
                    metrics = parse_metrics(await resp.text())
        except (aiohttp.ClientError, asyncio.TimeoutError):
            metrics = None
    return Snapshot(at, client, server, metrics)


def metric_mean(a: dict[str, float] | None, b: dict[str, float] | None, name: str, scale: float = 1.0
                ) -> float | None:
    if not a or not b:
        return None
    n = b.get(name + "_count", 0.0) - a.get(name + "_count", 0.0)
    s = b.get(name + "_sum", 0.0) - a.get(name + "_sum", 0.0)
    return s / n * scale if n > 0 else None


def pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


async def run_load(base: str, rate: float, duration_s: float, warmup_s: float, seed: int,
                   server_pid: int | None = None, timeout_s: float = 10.0, connections: int = 4096,
                   path: str = INFERENCE_PATH, metrics: bool = True) -> LoadResult:
    """Send the schedule `poisson_schedule(rate, warmup_s + duration_s, seed)` to `base + path` and measure
    the requests scheduled after `warmup_s`. Every loop here is bounded: the schedule is finite and every
    request has a client timeout."""
    base = base.rstrip("/")
    url = base + path
    sched = poisson_schedule(rate, warmup_s + duration_s, seed)
    n = len(sched)
    tag = secrets.token_hex(4)
    latency = np.full(n, np.nan)
    lag = np.full(n, np.nan)
    errors: Counter[str] = Counter()
    measured = sched >= warmup_s
    loop = asyncio.get_running_loop()

    connector = aiohttp.TCPConnector(limit=connections, limit_per_host=0, keepalive_timeout=60, ttl_dns_cache=None)
    client_timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout,
                                     skip_auto_headers=("User-Agent",)) as session:

        async def send(i: int, due: float) -> None:
            text = input_for(tag, i)
            body = orjson.dumps({"input": text})
            lag[i] = loop.time() - due
            error = None
            try:
                async with session.post(url, data=body, headers=JSON_HEADERS) as resp:
                    raw = await resp.read()
                    status = resp.status
                end = loop.time()
                if status == 200:
                    if orjson.loads(raw).get("output") != text[::-1]:
                        error = "mismatch"
                    else:
                        latency[i] = end - due
                else:
                    try:
                        code = orjson.loads(raw).get("error", "?")
                    except (orjson.JSONDecodeError, AttributeError):
                        code = "non-JSON"
                    error = f"{status} {code}"
            except asyncio.TimeoutError:
                error = "client_timeout"
            except aiohttp.ClientError as exc:
                error = f"conn:{type(exc).__name__}"
            except orjson.JSONDecodeError:
                error = "200 non-JSON"
            if error is not None and measured[i]:
                errors[error] += 1

        async def window_edges() -> tuple[Snapshot, Snapshot]:
            await asyncio.sleep(max(0.0, t0 + warmup_s - loop.time()))
            first = await snapshot(session, base, server_pid, metrics)
            await asyncio.sleep(max(0.0, t0 + warmup_s + duration_s - loop.time()))
            last = await snapshot(session, base, server_pid, metrics)
            return first, last

        t0 = loop.time() + 0.05
        edges = asyncio.create_task(window_edges())
        tasks = []
        for i in range(n):
            due = t0 + float(sched[i])
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(loop.create_task(send(i, due)))
        first, last = await edges
        await asyncio.gather(*tasks)

    window = last.at - first.at
    ok_lat = latency[measured & ~np.isnan(latency)] * 1000
    lags = lag[measured] * 1000
    count = int(measured.sum())
    server_cpu = (last.server_cpu - first.server_cpu) if first.server_cpu is not None else None
    return LoadResult(
        offered_rps=rate,
        scheduled_rps=count / duration_s,
        achieved_rps=len(ok_lat) / duration_s,
        count=count,
        ok=len(ok_lat),
        p50_ms=pct(ok_lat, 50), p95_ms=pct(ok_lat, 95), p99_ms=pct(ok_lat, 99),
        max_ms=float(ok_lat.max()) if len(ok_lat) else math.nan,
        errors=dict(errors.most_common()),
        error_count=sum(errors.values()),
        client_timeouts=errors.get("client_timeout", 0),
        send_lag_p99_ms=pct(lags, 99),
        send_lag_max_ms=float(lags.max()) if len(lags) else math.nan,
        mean_batch=metric_mean(first.metrics, last.metrics, "batchserve_batch_size"),
        server_mean_latency_ms=metric_mean(first.metrics, last.metrics, "batchserve_request_duration_seconds", 1000),
        server_mean_queue_ms=metric_mean(first.metrics, last.metrics, "batchserve_queue_wait_seconds", 1000),
        server_cpu_s=server_cpu,
        server_cpu_ms_per_req=server_cpu / count * 1000 if server_cpu is not None and count else None,
        server_cores=server_cpu / window if server_cpu is not None and window > 0 else None,
        client_cores=(last.client_cpu - first.client_cpu) / window if window > 0 else math.nan,
        window_s=window,
        warmup_s=warmup_s,
        seed=seed,
        settings={"url": url, "timeout_s": timeout_s, "connections": connections, "rate": rate,
                  "duration_s": duration_s, "warmup_s": warmup_s, "seed": seed},
    )


def measure(base: str, rate: float, duration_s: float, warmup_s: float, seed: int, **kw) -> LoadResult:
    """`run_load` on a fresh uvloop event loop (the synchronous entry point for scripts)."""
    raise_fd_limit()
    return uvloop.run(run_load(base, rate, duration_s, warmup_s, seed, **kw))


def summary(r: LoadResult) -> str:
    def f(v: float | None, spec: str = ".1f") -> str:
        return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    return (f"offered {r.offered_rps:g} RPS (scheduled {r.scheduled_rps:.0f}), achieved {r.achieved_rps:.0f} RPS; "
            f"p50 {f(r.p50_ms)} p95 {f(r.p95_ms)} p99 {f(r.p99_ms)} max {f(r.max_ms)} ms; "
            f"errors {r.error_count} {r.errors or ''}; mean batch {f(r.mean_batch)}; "
            f"server CPU {f(r.server_cpu_ms_per_req, '.3f')} ms/req ({f(r.server_cores, '.2f')} cores); "
            f"client {f(r.client_cores, '.2f')} cores, send lag p99 {f(r.send_lag_p99_ms)} ms")


def main() -> None:
    p = argparse.ArgumentParser(description="Open-loop Poisson load on a running batchserve (127.0.0.1 only)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--rate", type=float, required=True, help="offered requests per second")
    p.add_argument("--duration", type=float, default=20.0, help="measured window, s")
    p.add_argument("--warmup", type=float, default=5.0, help="warm-up before the window (not counted), s")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--server-pid", type=int, help="server PID, for CPU per request from /proc")
    p.add_argument("--timeout", type=float, default=10.0, help="client timeout per request, s")
    p.add_argument("--connections", type=int, default=4096, help="client connection limit")
    p.add_argument("--path", default=INFERENCE_PATH)
    p.add_argument("--no-metrics", action="store_true", help="do not read /metrics (e.g. the bare app)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    a = p.parse_args()
    host = a.url.split("//", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
    if host not in ("127.0.0.1", "localhost", "[::1]"):
        p.error("load tests run against the loopback address only")
    r = measure(a.url, a.rate, a.duration, a.warmup, a.seed, server_pid=a.server_pid, timeout_s=a.timeout,
                connections=a.connections, path=a.path, metrics=not a.no_metrics)
    print(json.dumps(asdict(r), indent=2) if a.json else summary(r))


if __name__ == "__main__":
    main()
