"""Open-loop Poisson load against `POST /v1/inference`, with the numbers the standard table needs.

Why open loop: a closed-loop client (N users, each waiting for its answer) slows down when the server does, so
it hides queueing. Here every request leaves at its precomputed exponential time whatever the answers, and its
latency is counted from that *scheduled* time, so a late client (or a stalled event loop) shows up as latency
instead of vanishing. The send lag (actual − scheduled) and the server's own latency (from each answer's
`latency_ms`) are reported beside it, to tell client delay from server delay.

Every request carries a distinct input and must come back reversed (the sim contract); anything else counts
as an error ("mismatch"). Only requests scheduled inside the measured window (after the warm-up) count.
Around that window the server's `/metrics` and `/proc/<pid>/stat` are read, giving the mean batch size, batches
per second and the server's CPU seconds per request.

A batching server answers in bursts (a whole batch at once); one Python client reads a burst serially, so the
last answers of a burst are stamped late. `procs > 1` splits the schedule round-robin over that many client
processes (thinning a Poisson process keeps it Poisson; together they send exactly the same schedule).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import multiprocessing as mp
import secrets
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection

import aiohttp
import numpy as np
import orjson
import uvloop

from bench import common
from bench.procstat import process_cpu_s, raise_fd_limit, self_cpu_s
from bench.rawclient import drive_raw
from bench.schedule import poisson_schedule

INFERENCE_PATH = "/v1/inference"
JSON_HEADERS = {"Content-Type": "application/json"}
START_DELAY_S = 0.2  # between "all clients ready" and the first scheduled send
SPAWN_TIMEOUT_S = 60.0


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
    server_p50_ms: float  # the same requests as the server saw them (its `latency_ms`, whole ms)
    server_p95_ms: float
    server_p99_ms: float
    errors: dict[str, int]  # "503 SERVICE_OVERLOADED", "mismatch", "client_timeout", "conn:ClientOSError", ...
    error_count: int
    client_timeouts: int
    send_lag_p99_ms: float  # how late requests left the client: large means the client, not the server, lagged
    send_lag_max_ms: float
    mean_batch: float | None  # delta batch_size_sum / delta batch_size_count from /metrics
    batches_per_s: float | None
    server_mean_latency_ms: float | None  # the server's arrival-to-answer mean over the window (/metrics)
    server_mean_queue_ms: float | None
    server_mean_compute_ms: float | None  # mean backend time of one batch (S as the server saw it)
    server_cpu_s: float | None  # utime+stime delta over the window
    server_cpu_ms_per_req: float | None
    server_cores: float | None  # server CPU / window wall time
    client_cores: float  # all client processes' CPU / window wall time
    client_procs: int
    window_s: float
    warmup_s: float
    seed: int
    settings: dict = field(default_factory=dict)


@dataclass
class Part:
    """What one client process measured for its share of the schedule (index arrays into the schedule)."""

    idx: np.ndarray
    latency_s: np.ndarray  # NaN unless answered 200 with the right output
    lag_s: np.ndarray
    server_ms: np.ndarray  # the answer's latency_ms, NaN when absent
    errors: list[tuple[int, str]]
    cpu_window_s: float  # this process's CPU over the measured window


@dataclass
class Snapshot:
    at: float
    server_cpu: float | None
    metrics: dict[str, float] | None


def input_for(tag: str, i: int) -> str:
    """A distinct, non-palindromic input per request (with non-ASCII), so a swapped answer is caught."""
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


def metric_delta(a: dict[str, float] | None, b: dict[str, float] | None, name: str) -> float | None:
    if not a or not b or name not in b:
        return None
    return b[name] - a.get(name, 0.0)


def metric_mean(a: dict[str, float] | None, b: dict[str, float] | None, name: str, scale: float = 1.0) -> float | None:
    n, s = metric_delta(a, b, name + "_count"), metric_delta(a, b, name + "_sum")
    return s / n * scale if n and s is not None else None


def pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


async def sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


# -- the sending side (one per client process) -----------------------------------------------------------
async def drive(
    url: str,
    sched: np.ndarray,
    idx: np.ndarray,
    t0: float,
    tag: str,
    timeout_s: float,
    connections: int,
    window: tuple[float, float],
    headers: dict[str, str] | None = None,
    extra: dict | None = None,
) -> Part:
    """Send request i at t0 + sched[i] for every i in idx, whatever the answers; bounded by the schedule's
    length and the client timeout. `headers` (e.g. Authorization) and `extra` body fields (e.g. "model") go
    with every request."""
    req_headers = {**JSON_HEADERS, **headers} if headers else JSON_HEADERS
    k = len(idx)
    latency, lag, server_ms = np.full(k, np.nan), np.full(k, np.nan), np.full(k, np.nan)
    errors: list[tuple[int, str]] = []
    cpu: list[float] = []

    connector = aiohttp.TCPConnector(limit=connections, limit_per_host=0, keepalive_timeout=60, ttl_dns_cache=None)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s), skip_auto_headers=("User-Agent",)
    ) as session:

        async def send(j: int, i: int, due: float) -> None:
            text = input_for(tag, i)
            body = orjson.dumps({"input": text, **extra} if extra else {"input": text})
            lag[j] = time.monotonic() - due
            error = None
            try:
                async with session.post(url, data=body, headers=req_headers) as resp:
                    raw = await resp.read()
                    status = resp.status
                end = time.monotonic()
                answer = orjson.loads(raw) if raw else {}
                if not isinstance(answer, dict):
                    error = f"{status} non-object"
                elif status == 200:
                    if answer.get("output") != text[::-1]:
                        error = "mismatch"
                    else:
                        latency[j] = end - due
                        server_ms[j] = answer.get("latency_ms", math.nan)
                else:
                    error = f"{status} {answer.get('error', '?')}"
            except TimeoutError:
                error = "client_timeout"
            except aiohttp.ClientError as exc:
                error = f"conn:{type(exc).__name__}"
            except orjson.JSONDecodeError:
                error = "non-JSON answer"
            except OSError as exc:
                error = f"conn:{type(exc).__name__}"
            except Exception as exc:  # noqa: BLE001 - one odd answer must not end the whole measurement
                error = f"client:{type(exc).__name__}"
            if error is not None:
                errors.append((i, error))

        async def cpu_edges() -> None:
            for edge in window:
                await sleep_until(edge)
                cpu.append(self_cpu_s())

        edges = asyncio.create_task(cpu_edges())
        tasks = []
        for j, i in enumerate(idx):
            due = t0 + float(sched[i])
            await sleep_until(due)
            tasks.append(asyncio.create_task(send(j, int(i), due)))
        await edges
        await asyncio.gather(*tasks)
    return Part(idx, latency, lag, server_ms, errors, cpu[1] - cpu[0] if len(cpu) == 2 else math.nan)


CLIENTS = ("aiohttp", "raw")  # raw: bench/rawclient.py, the same schedule and outcomes at a fraction of the CPU


async def drive_with(
    client: str,
    url: str,
    sched: np.ndarray,
    idx: np.ndarray,
    t0: float,
    tag: str,
    timeout_s: float,
    connections: int,
    window: tuple[float, float],
    headers: dict[str, str] | None = None,
    extra: dict | None = None,
) -> Part:
    """`drive` with the chosen sender."""
    if client == "aiohttp":
        return await drive(url, sched, idx, t0, tag, timeout_s, connections, window, headers, extra)
    cpu: list[float] = []

    async def cpu_edges() -> None:
        for edge in window:
            await sleep_until(edge)
            cpu.append(self_cpu_s())

    edges = asyncio.create_task(cpu_edges())
    out = await drive_raw(url, sched, idx, t0, lambda i: input_for(tag, i), timeout_s, connections, headers, extra)
    await edges
    return Part(
        idx, out.latency_s, out.lag_s, out.server_ms, out.errors, cpu[1] - cpu[0] if len(cpu) == 2 else math.nan
    )


def _quiet_gc_run(coro):
    """Run on uvloop with the cyclic GC off: a full collection over tens of thousands of live tasks stalls the
    client for tens of ms, which would show up as latency. Runs are bounded; refcounting frees the rest."""
    gc.collect()
    gc.disable()
    try:
        return uvloop.run(coro)
    finally:
        gc.enable()
        gc.collect()


def _client_process(
    conn: Connection[Part | str, float],
    url: str,
    sched: np.ndarray,
    idx: np.ndarray,
    tag: str,
    timeout_s: float,
    connections: int,
    window_offsets: tuple[float, float],
    headers: dict[str, str] | None = None,
    extra: dict | None = None,
    client: str = "aiohttp",
) -> None:
    """Entry point of an extra client process: say ready, get t0, drive its share, send back its Part."""
    raise_fd_limit()
    conn.send("ready")
    if not conn.poll(SPAWN_TIMEOUT_S):
        return
    t0 = conn.recv()
    window = (t0 + window_offsets[0], t0 + window_offsets[1])
    conn.send(
        _quiet_gc_run(drive_with(client, url, sched, idx, t0, tag, timeout_s, connections, window, headers, extra))
    )
    conn.close()


# -- the measuring side ------------------------------------------------------------------------------------
async def snapshot(base: str, pid: int | None, with_metrics: bool) -> Snapshot:
    at = time.monotonic()
    server = process_cpu_s(pid) if pid else None
    metrics = None
    if with_metrics:
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
                async with s.get(base + "/metrics") as resp:
                    if resp.status == 200:
                        metrics = parse_metrics(await resp.text())
        except (TimeoutError, aiohttp.ClientError):
            metrics = None
    return Snapshot(at, server, metrics)


async def window_snapshots(
    base: str, pid: int | None, with_metrics: bool, window: tuple[float, float]
) -> tuple[Snapshot, Snapshot]:
    await sleep_until(window[0])
    first = await snapshot(base, pid, with_metrics)
    await sleep_until(window[1])
    return first, await snapshot(base, pid, with_metrics)


def measure(
    base: str,
    rate: float,
    duration_s: float,
    warmup_s: float,
    seed: int,
    server_pid: int | None = None,
    timeout_s: float = 10.0,
    connections: int = 4096,
    path: str = INFERENCE_PATH,
    metrics: bool = True,
    procs: int = 1,
    client: str = "aiohttp",
) -> LoadResult:
    """Send `poisson_schedule(rate, warmup_s + duration_s, seed)` to `base + path` from `procs` client processes
    and measure the requests scheduled after `warmup_s`, with the `client` sender (see CLIENTS)."""
    if client not in CLIENTS:
        raise ValueError(f"client must be one of {CLIENTS}")
    raise_fd_limit()
    base = base.rstrip("/")
    url = base + path
    sched = poisson_schedule(rate, warmup_s + duration_s, seed)
    tag = secrets.token_hex(4)
    procs = max(1, procs)
    shares = [np.arange(k, len(sched), procs) for k in range(procs)]
    offsets = (warmup_s, warmup_s + duration_s)

    async def here(t0: float) -> tuple[Part, tuple[Snapshot, Snapshot]]:
        window = (t0 + offsets[0], t0 + offsets[1])
        snaps = asyncio.create_task(window_snapshots(base, server_pid, metrics, window))
        part = await drive_with(client, url, sched, shares[0], t0, tag, timeout_s, connections, window)
        return part, await snaps

    ctx = mp.get_context("spawn")
    pipes, children = [], []
    try:
        for k in range(1, procs):
            parent_end, child_end = ctx.Pipe()
            child = ctx.Process(
                target=_client_process,
                daemon=True,
                args=(child_end, url, sched, shares[k], tag, timeout_s, connections, offsets, None, None, client),
            )
            child.start()
            pipes.append(parent_end)
            children.append(child)
        for p in pipes:
            if not p.poll(SPAWN_TIMEOUT_S) or p.recv() != "ready":
                raise RuntimeError("a client process did not start")
        t0 = time.monotonic() + START_DELAY_S
        for p in pipes:
            p.send(t0)
        part0, (first, last) = _quiet_gc_run(here(t0))
        parts = [part0]
        for p in pipes:
            if not p.poll(timeout_s + 30):
                raise RuntimeError("a client process did not report")
            parts.append(p.recv())
    finally:
        for child in children:
            child.join(timeout=5)
            if child.is_alive():
                child.kill()
    return combine(
        parts,
        sched,
        rate,
        duration_s,
        warmup_s,
        seed,
        first,
        last,
        procs,
        {
            "url": url,
            "timeout_s": timeout_s,
            "connections": connections,
            "rate": rate,
            "duration_s": duration_s,
            "warmup_s": warmup_s,
            "seed": seed,
            "procs": procs,
            "client": client,
        },
    )


def combine(
    parts: list[Part],
    sched: np.ndarray,
    rate: float,
    duration_s: float,
    warmup_s: float,
    seed: int,
    first: Snapshot,
    last: Snapshot,
    procs: int,
    settings: dict,
) -> LoadResult:
    n = len(sched)
    latency, lag, server_ms = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
    errors: Counter[str] = Counter()
    for part in parts:
        latency[part.idx], lag[part.idx], server_ms[part.idx] = part.latency_s, part.lag_s, part.server_ms
        errors.update(e for i, e in part.errors if sched[i] >= warmup_s)
    measured = sched >= warmup_s
    good = measured & ~np.isnan(latency)
    ok_lat, srv, lags = latency[good] * 1000, server_ms[good], lag[measured] * 1000
    srv = srv[~np.isnan(srv)]
    count = int(measured.sum())
    window = last.at - first.at
    server_cpu = None
    if first.server_cpu is not None and last.server_cpu is not None:
        server_cpu = last.server_cpu - first.server_cpu
    batches = metric_delta(first.metrics, last.metrics, "batchserve_batch_size_count")
    return LoadResult(
        offered_rps=rate,
        scheduled_rps=count / duration_s,
        achieved_rps=len(ok_lat) / duration_s,
        count=count,
        ok=len(ok_lat),
        p50_ms=pct(ok_lat, 50),
        p95_ms=pct(ok_lat, 95),
        p99_ms=pct(ok_lat, 99),
        max_ms=float(ok_lat.max()) if len(ok_lat) else math.nan,
        server_p50_ms=pct(srv, 50),
        server_p95_ms=pct(srv, 95),
        server_p99_ms=pct(srv, 99),
        errors=dict(errors.most_common()),
        error_count=sum(errors.values()),
        client_timeouts=errors.get("client_timeout", 0),
        send_lag_p99_ms=pct(lags, 99),
        send_lag_max_ms=float(lags.max()) if len(lags) else math.nan,
        mean_batch=metric_mean(first.metrics, last.metrics, "batchserve_batch_size"),
        batches_per_s=batches / window if batches is not None and window > 0 else None,
        server_mean_latency_ms=metric_mean(first.metrics, last.metrics, "batchserve_request_duration_seconds", 1000),
        server_mean_queue_ms=metric_mean(first.metrics, last.metrics, "batchserve_queue_wait_seconds", 1000),
        server_mean_compute_ms=metric_mean(first.metrics, last.metrics, "batchserve_batch_compute_seconds", 1000),
        server_cpu_s=server_cpu,
        server_cpu_ms_per_req=server_cpu / count * 1000 if server_cpu is not None and count else None,
        server_cores=server_cpu / window if server_cpu is not None and window > 0 else None,
        client_cores=sum(p.cpu_window_s for p in parts) / window if window > 0 else math.nan,
        client_procs=procs,
        window_s=window,
        warmup_s=warmup_s,
        seed=seed,
        settings=settings,
    )


def summary(r: LoadResult) -> str:
    def f(v: float | None, spec: str = ".1f") -> str:
        return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    return (
        f"offered {r.offered_rps:g} RPS (scheduled {r.scheduled_rps:.0f}), achieved {r.achieved_rps:.0f} RPS; "
        f"p50 {f(r.p50_ms)} p95 {f(r.p95_ms)} p99 {f(r.p99_ms)} max {f(r.max_ms)} ms "
        f"(server's view p50 {f(r.server_p50_ms)} p95 {f(r.server_p95_ms)} p99 {f(r.server_p99_ms)}); "
        f"errors {r.error_count} {r.errors or ''}; mean batch {f(r.mean_batch)}, "
        f"{f(r.batches_per_s)} batches/s, batch time {f(r.server_mean_compute_ms)} ms; "
        f"server CPU {f(r.server_cpu_ms_per_req, '.3f')} ms/req ({f(r.server_cores, '.2f')} cores); "
        f"client {f(r.client_cores, '.2f')} cores in {r.client_procs} proc(s), "
        f"send lag p99 {f(r.send_lag_p99_ms)} ms"
    )


def is_loopback(url: str) -> bool:
    host = url.split("//", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
    return host in ("127.0.0.1", "localhost", "[::1]")


def main() -> None:
    p = argparse.ArgumentParser(description="Open-loop Poisson load on a running batchserve (127.0.0.1 only)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--rate", type=float, required=True, help="offered requests per second")
    common.add_load_flags(p, procs=True, connections=True)
    p.add_argument("--server-pid", type=int, help="server PID, for CPU per request from /proc")
    p.add_argument(
        "--client",
        choices=CLIENTS,
        default="aiohttp",
        help="sender: aiohttp, or raw (bench/rawclient.py: far less CPU per request)",
    )
    p.add_argument("--path", default=INFERENCE_PATH)
    p.add_argument("--no-metrics", action="store_true", help="do not read /metrics (e.g. the bare app)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    a = p.parse_args()
    if not is_loopback(a.url):
        p.error("load tests run against the loopback address only")
    r = measure(
        a.url,
        a.rate,
        a.duration,
        a.warmup,
        a.seed,
        server_pid=a.server_pid,
        timeout_s=a.timeout,
        connections=a.connections,
        path=a.path,
        metrics=not a.no_metrics,
        procs=a.procs,
        client=a.client,
    )
    print(json.dumps(asdict(r), indent=2) if a.json else summary(r))


if __name__ == "__main__":
    main()
