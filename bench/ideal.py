"""A discrete-event model of the ideal batcher: the server's flush policy with zero overhead.

Why: a measured p95 means little alone. Fed the very arrivals the load generator sends (same seed, rate and
length), this model says what the policy itself costs, so the gap between a measured row and this number is
the server's own overhead (event loop, threads, HTTP), not the policy or the luck of the draw.

It mirrors `batchserve/core/batcher.py`: one free device at a time waits for "its" batch (the turn lock), and
takes it as soon as (a) `max_batch` items wait, (b) the oldest item's dispatch deadline arrives
(`arrived + slo − S − margin`), or (c) pacing: `S / G` has passed since the last dispatch. The batch is formed
at that instant (it keeps filling until taken), runs S seconds, and its items are answered at the end.
Items older than the request timeout are dropped at formation (the server's 504). The `idle` policy is
dispatch-on-idle for comparison: a free device takes whatever waits, at once.
"""

from __future__ import annotations

import argparse
import heapq
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from bench import common
from bench.schedule import poisson_schedule, row_seed

POLICIES = ("paced", "idle")


@dataclass
class IdealResult:
    policy: str
    p50_ms: float
    p95_ms: float
    p99_ms: float
    mean_batch: float
    expired: int  # items the model would answer 504 (deadline passed in the queue)
    count: int  # items in the measured window


def simulate(
    arrivals: np.ndarray,
    devices: int,
    batch_s: float,
    max_batch: int,
    slo_s: float = 0.2,
    margin_s: float = 0.005,
    policy: str = "paced",
    timeout_s: float = 2.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Completion time of each arrival (NaN when it expired) and the dispatch time of each batch's size.

    Returns (done, batch_sizes) where done[i] is when arrival i got its answer."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}")
    n = len(arrivals)
    done = np.full(n, np.nan)
    sizes: list[int] = []
    free = [0.0] * max(1, devices)  # when each device is next free (a heap)
    delay = max(0.0, slo_s - batch_s - margin_s)  # Batcher.dispatch_delay
    pace = batch_s / max(1, devices)
    last_dispatch = -math.inf
    q: deque[int] = deque()
    i, now = 0, 0.0
    while True:
        now = max(now, free[0])  # the first device to be free takes the turn
        while True:  # it waits for its batch
            while i < n and arrivals[i] <= now:
                q.append(i)
                i += 1
            while q and arrivals[q[0]] + timeout_s <= now:
                q.popleft()  # expired: answered 504, never dispatched
            if not q:
                if i >= n:
                    return done, np.asarray(sizes)
                now = arrivals[i]
                continue
            if len(q) >= max_batch or policy == "idle":
                due = now
            else:
                due = min(arrivals[q[0]] + delay, last_dispatch + pace)
            if due <= now:
                break
            if i < n and arrivals[i] < due:
                now = arrivals[i]  # an arrival may fill the batch before it is due
                continue
            now = due
            break
        taken = 0
        while q and taken < max_batch:
            j = q.popleft()
            if arrivals[j] + timeout_s > now:
                done[j] = now + batch_s
                taken += 1
        if taken:
            sizes.append(taken)
            heapq.heapreplace(free, now + batch_s)
            last_dispatch = now


def ideal(
    rate: float,
    duration_s: float,
    warmup_s: float,
    seed: int,
    devices: int,
    batch_s: float = 0.1,
    max_batch: int = 100,
    slo_s: float = 0.2,
    margin_s: float = 0.005,
    policy: str = "paced",
    timeout_s: float = 2.0,
) -> IdealResult:
    """Percentiles over the measured window (arrivals after the warm-up) of the same schedule the load
    generator sends: `poisson_schedule(rate, warmup_s + duration_s, seed)`."""
    arrivals = poisson_schedule(rate, warmup_s + duration_s, seed)
    done, sizes = simulate(arrivals, devices, batch_s, max_batch, slo_s, margin_s, policy, timeout_s)
    window = arrivals >= warmup_s
    lat = (done - arrivals)[window]
    ok = lat[~np.isnan(lat)] * 1000
    pct = np.percentile(ok, [50, 95, 99]) if len(ok) else [math.nan] * 3
    return IdealResult(
        policy,
        float(pct[0]),
        float(pct[1]),
        float(pct[2]),
        float(sizes.mean()) if len(sizes) else math.nan,
        int(np.isnan(lat).sum()),
        int(window.sum()),
    )


def main() -> None:
    p = argparse.ArgumentParser(description="p50/p95/p99 of the ideal batcher on a Poisson schedule")
    p.add_argument("--rate", type=float, action="append", help="offered RPS (repeatable)")
    p.add_argument("--devices", type=int, default=1)
    common.add_load_flags(p, timeout=None)  # run_standard's window and seed: the same arrivals
    p.add_argument("--batch-ms", type=float, default=100.0)
    p.add_argument("--max-batch", type=int, default=100)
    p.add_argument("--slo-ms", type=float, default=200.0)
    p.add_argument("--margin-ms", type=float, default=5.0)
    a = p.parse_args()
    for rate in a.rate or [100, 500, 900, 950]:
        for policy in POLICIES:
            r = ideal(
                rate,
                a.duration,
                a.warmup,
                row_seed(a.seed, a.devices, rate),
                a.devices,
                a.batch_ms / 1000,
                a.max_batch,
                a.slo_ms / 1000,
                a.margin_ms / 1000,
                policy,
            )
            print(
                f"devices={a.devices} rate={rate:g} {policy:5s} p50={r.p50_ms:6.1f} p95={r.p95_ms:6.1f} "
                f"p99={r.p99_ms:6.1f} ms  mean batch {r.mean_batch:5.1f}  expired {r.expired}/{r.count}"
            )


if __name__ == "__main__":
    main()
