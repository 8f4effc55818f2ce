"""Open-loop load on a real-model server, with the event loop's responsiveness probed alongside (issue 13).

`loadgen.py` checks each answer against the sim's reversed input; a model's answer is text, so here any 200 with
an output counts. While the load runs, GET /healthz is sent every `probe_every_s` on its own connection: its
latency is how long the event loop takes to answer something trivial while batches run (a starved loop shows
up there first). Before and after the window: /metrics (batch compute time and size), /internal/health (the
learned batch time by size) and the CPU time of the server and of its device processes (`--executor process`).
Needs aiohttp and numpy only (both on the GPU machine).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import numpy as np

from bench.loadgen import parse_metrics
from bench.procstat import process_cpu_s, raise_fd_limit
from bench.schedule import poisson_schedule

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "What is two plus two?",
    "Say hello in Spanish.",
    "Which planet is the largest?",
    "Give me a word that rhymes with cat.",
    "How many legs does a spider have?",
    "What is the opposite of hot?",
]


def inputs(n: int) -> list[str]:
    """Distinct short prompts (one prompt-length bucket), cycling through a few questions."""
    return [f"{QUESTIONS[i % len(QUESTIONS)]} ({i})" for i in range(n)]


def family_pids(pid: int) -> list[int]:
    """The server and its children (the device processes of `--executor process`)."""
    pids = [pid]
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                pids += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return pids


def family_cpu_s(pid: int) -> float:
    total = 0.0
    for p in family_pids(pid):
        try:
            total += process_cpu_s(p)
        except OSError:
            pass
    return total


def histogram_counts(text: str, name: str) -> dict[float, float]:
    """Prometheus text -> {`le` bound: cumulative count} of histogram `name`, summed over its labels."""
    out: dict[float, float] = {}
    prefix = name + "_bucket{"
    for line in text.splitlines():
        if line.startswith(prefix):
            key, _, value = line.rpartition(" ")
            le = key.split('le="', 1)[1].split('"', 1)[0]
            bound = math.inf if le == "+Inf" else float(le)
            out[bound] = out.get(bound, 0.0) + float(value)
    return out


def bins(before: dict[float, float], after: dict[float, float]) -> dict[float, int]:
    """What was observed between two readings of a histogram, per bin: {upper bound: count of values in
    (the bound below, bound]}, empty bins left out."""
    out, below = {}, 0.0
    for bound in sorted(after):
        cumulative = after[bound] - before.get(bound, 0.0)
        if cumulative > below:
            out[bound] = int(round(cumulative - below))
        below = cumulative
    return out


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


@dataclass
class LoadRow:
    rate: float
    window_s: float
    sent: int
    ok: int
    errors: dict[str, int]
    achieved_rps: float
    p50_ms: float
    p95_ms: float
    server_p95_ms: float  # the answers' own latency_ms
    mean_batch: float
    batch_sizes: dict[str, int]  # batches over the window by size bin: {the bin's upper bound: count} (/metrics)
    batch_ms: float  # mean backend time of one batch over the window (/metrics)
    batch_ms_by_size: dict[str, float]  # the server's learned batch time by size at the end (/internal/health)
    server_cores: float  # server (and device processes) CPU seconds / window
    healthz_p50_ms: float
    healthz_p99_ms: float
    healthz_max_ms: float
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def run_load(
    base: str,
    rate: float,
    duration_s: float,
    pid: int,
    seed: int = 0,
    timeout_s: float = 60.0,
    probe_every_s: float = 0.05,
    model_key: str = "",
) -> LoadRow:
    """Requests on a Poisson schedule of `rate` for `duration_s` (sent whatever the answers), latency counted
    from each request's scheduled time; /healthz probed alongside on a separate connection."""
    raise_fd_limit()
    sched = poisson_schedule(rate, duration_s, seed)
    texts = inputs(len(sched))
    latency: list[float] = []
    server_ms: list[float] = []
    errors: dict[str, int] = {}
    probes: list[float] = []
    done = asyncio.Event()
    headers = {"Authorization": f"Bearer {model_key}"} if model_key else {}
    conn = aiohttp.TCPConnector(limit=0)
    async with (
        aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as s,
        aiohttp.ClientSession() as probe_session,
    ):
        text0 = await (await s.get(base + "/metrics")).text()
        m0 = parse_metrics(text0)
        cpu0, t_start = family_cpu_s(pid), time.monotonic()
        t0 = t_start + 0.1

        async def one(i: int) -> None:
            due = t0 + float(sched[i])
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            try:
                async with s.post(
                    base + "/v1/inference", json={"input": texts[i], "timeout_ms": timeout_s * 1000}, headers=headers
                ) as r:
                    body = await r.json(content_type=None)
                    if r.status == 200 and isinstance(body.get("output"), str):
                        latency.append(time.monotonic() - due)
                        server_ms.append(float(body.get("latency_ms", math.nan)))
                    else:
                        key = f"{r.status} {body.get('error', '?') if isinstance(body, dict) else '?'}"
                        errors[key] = errors.get(key, 0) + 1
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1

        async def probe() -> None:
            while not done.is_set():
                t = time.monotonic()
                try:
                    async with probe_session.get(base + "/healthz") as r:
                        await r.read()
                    probes.append(time.monotonic() - t)
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(probe_every_s)

        prober = asyncio.create_task(probe())
        await asyncio.gather(*(one(i) for i in range(len(sched))))
        done.set()
        await prober
        window = time.monotonic() - t_start
        cpu1 = family_cpu_s(pid)
        text1 = await (await s.get(base + "/metrics")).text()
        m1 = parse_metrics(text1)
        health = await (await s.get(base + "/internal/health")).json()

    def delta(name: str) -> float:
        return m1.get(name, 0.0) - m0.get(name, 0.0)

    batches = delta("batchserve_batch_size_count")
    by_size: dict[str, float] = next(iter(health.get("batch_ms_by_size", {}).values()), {})
    return LoadRow(
        rate=rate,
        window_s=round(window, 2),
        sent=len(sched),
        ok=len(latency),
        errors=errors,
        achieved_rps=round(len(latency) / window, 2),
        p50_ms=round(pct(latency, 50) * 1000, 1),
        p95_ms=round(pct(latency, 95) * 1000, 1),
        server_p95_ms=round(pct(server_ms, 95), 1),
        mean_batch=round(delta("batchserve_batch_size_sum") / batches, 2) if batches else math.nan,
        batch_sizes={
            f"{bound:g}": n
            for bound, n in bins(
                histogram_counts(text0, "batchserve_batch_size"), histogram_counts(text1, "batchserve_batch_size")
            ).items()
        },
        batch_ms=round(delta("batchserve_batch_compute_seconds_sum") / batches * 1000, 1) if batches else math.nan,
        batch_ms_by_size=by_size,
        server_cores=round((cpu1 - cpu0) / window, 2),
        healthz_p50_ms=round(pct(probes, 50) * 1000, 2),
        healthz_p99_ms=round(pct(probes, 99) * 1000, 2),
        healthz_max_ms=round(max(probes) * 1000, 2) if probes else math.nan,
    )


def interpolate(points: dict[int, float], size: float) -> float:
    """Offline batch time at `size`, linear between the measured sizes (flat outside them)."""
    xs = sorted(points)
    if not xs or math.isnan(size):
        return math.nan
    if size <= xs[0]:
        return points[xs[0]]
    if size >= xs[-1]:
        return points[xs[-1]]
    lo = max(x for x in xs if x <= size)
    hi = min(x for x in xs if x >= size)
    return points[lo] if hi == lo else points[lo] + (points[hi] - points[lo]) * (size - lo) / (hi - lo)
