"""Fairness in the literature's terms, for any bench with backlogged tenants (issue 49, item 5): the accumulated
service difference over time, Jain's index per window, and the device's idle time while inputs wait.

- **service difference** D(t) = W_a(t0, t) - W_b(t0, t): the cost served to each of two tenants since t0, apart.
  Start-time fair queuing and the Virtual Token Counter (Sheng et al., OSDI '24) bound |D| for two backlogged
  tenants by a small multiple of the largest request's cost U, whatever the interval's length; benches report
  max |D| / U (docs/architecture.md, "Priority and fairness", says the bound batchserve keeps).
- **Jain's index** of the tenants' costs served in each window: (sum x)^2 / (n sum x^2), 1 for equal shares.
- **work conservation**: over each pair of device readings with inputs waiting at both, the device-seconds the
  workers were not busy (`DeviceSampler` reads `/internal/health` and `/metrics`); the hand-off between two
  batches counts as idle, so it is a small share, never exactly 0.

`bench/fair_service.py` reads costs from the server (`/v1/usage`); `bench/fairness.py` from its answers
(`usage.prompt_tokens`, `Answered`); `bench/tenancy_bench.py` reports work conservation (its light streams are open
loop, not backlogged, so D and Jain's bound do not apply there)."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import aiohttp
import orjson

from bench.loadgen import parse_metrics


@dataclass(frozen=True)
class Answered:
    """One answer a client counted: when (seconds from the load's start), whose, and its cost."""

    t: float
    tenant: str
    cost: float


def jain(xs: list[float]) -> float:
    s, sq = sum(xs), sum(x * x for x in xs)
    return s * s / (len(xs) * sq) if sq else math.nan


def difference(answers: list[Answered], names: tuple[str, str], t0: float) -> list[tuple[float, float]]:
    """(t - t0, W_a - W_b) after each answer from t0 on: the accumulated service difference."""
    a, b = names
    got = {a: 0.0, b: 0.0}
    out = [(0.0, 0.0)]
    for ans in sorted(answers, key=lambda x: x.t):
        if ans.t < t0 or ans.tenant not in got:
            continue
        got[ans.tenant] += ans.cost
        out.append((ans.t - t0, got[a] - got[b]))
    return out


def windows(answers: list[Answered], names: tuple[str, ...], t0: float, t1: float, window_s: float) -> list[dict]:
    """Each tenant's cost served and Jain's index in consecutive windows of `window_s` from t0; a last window
    shorter than 90 % of `window_s` is left out (none is left when [t0, t1] is shorter than one window)."""
    out = []
    edge = t0
    while edge + 0.9 * window_s <= t1:
        end = min(edge + window_s, t1)
        served = {n: sum(x.cost for x in answers if x.tenant == n and edge <= x.t < end) for n in names}
        out.append({"from_s": edge, "to_s": end, "served": served, "jain": jain(list(served.values()))})
        edge = end
    return out


@dataclass(frozen=True)
class DeviceReading:
    """The server's devices at one instant: the middle of its `/internal/health` call."""

    t: float  # seconds from the load's start
    queue_depth: int
    workers: int
    busy_s: float  # finished batches' compute seconds, plus the running batches' time so far (when exact)


def idle_while_waiting(readings: list[DeviceReading], lo: float = -math.inf, hi: float = math.inf) -> dict:
    """Over consecutive readings in [lo, hi] both with inputs waiting: the waiting seconds and the device-seconds
    idle meanwhile (each interval's length times the workers, less the growth of busy time)."""
    inside = [r for r in readings if lo <= r.t <= hi]
    waiting = idle = 0.0
    for r0, r1 in zip(inside, inside[1:], strict=False):
        if r0.queue_depth > 0 and r1.queue_depth > 0 and not math.isnan(r1.busy_s - r0.busy_s):
            step = r1.t - r0.t
            waiting += step
            idle += step * r1.workers - (r1.busy_s - r0.busy_s)  # unclamped: reading noise cancels
    return {
        "waiting_s": waiting,
        "idle_ms": idle * 1000,
        "idle_share": idle / waiting if waiting else math.nan,
        "readings": len(inside),
    }


class DeviceSampler:
    """Reads `/internal/health` then `/metrics` every `every_s` until `stop_at`, into `readings`. A batch that
    ended between the two calls would count twice (its compute time, and its running time at the health call):
    the running time is added only while the finished batches agree in both."""

    def __init__(self, base: str, start: float, every_s: float = 0.2) -> None:
        self.base, self.start, self.every_s = base, start, every_s
        self.readings: list[DeviceReading] = []
        self._offset: float | None = None

    async def run(self, session: aiohttp.ClientSession, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            began = time.monotonic()
            try:
                async with session.get(self.base + "/internal/health") as r:
                    health = orjson.loads(await r.read())
                mid = (began + time.monotonic()) / 2
                async with session.get(self.base + "/metrics") as r:
                    metrics = parse_metrics(await r.text())
            except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError):
                await asyncio.sleep(self.every_s)
                continue
            self.readings.append(self.reading(mid - self.start, health, metrics))
            await asyncio.sleep(max(0.0, began + self.every_s - time.monotonic()))

    def reading(self, t: float, health: dict, metrics: dict[str, float]) -> DeviceReading:
        workers = health.get("workers") or []
        finished = sum(int(w.get("batches", 0)) for w in workers)
        count = metrics.get("batchserve_batch_compute_seconds_count", math.nan)
        if self._offset is None and not math.isnan(count):
            self._offset = count - finished
        running = sum(w.get("running_ms", 0) / 1000 for w in workers if w.get("busy"))
        exact = self._offset is not None and count - finished == self._offset
        busy = metrics.get("batchserve_batch_compute_seconds_sum", math.nan) + (running if exact else 0.0)
        return DeviceReading(t, int(health.get("queue_depth", 0)), max(1, len(workers)), busy)
