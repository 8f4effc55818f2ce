"""The door: refuse at once what cannot be served in time, never after it has waited (DESIGN §5).

Predicted latency for a new item = time until the first healthy worker is free
                                 + (items queued ahead / batch size) x batch time / healthy workers
                                 + one batch time.
It is always checked against the request's own deadline. Under pressure — arrivals faster than the healthy
workers can serve, or a worker lost — it is also checked against `slo_ms x slack x tier factor`, so the lower
tiers are refused first and admitted requests stay near the objective. Without pressure a passing burst is
queued, not refused: the queue drains by itself, and refusing the tail of a burst would turn a few slow answers
into errors.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from batchserve import errors
from batchserve.batcher import Batcher
from batchserve.gpu_pool import GpuPool


# Multiplies `slo_ms x admission_slack` per tier (enterprise, paid, free, batch): under pressure the lower
# tiers pass their bound first and are refused first.
TIER_SHED = (1.2, 1.0, 0.8, 0.8)


def predicted_latency_s(batcher: Batcher, pool: GpuPool, model: str, tier: int, tenant: str, now: float) -> float:
    healthy = max(1, pool.healthy_count())
    batch_s = batcher.batch_s[model]
    ahead = batcher.ahead_of(tier, tenant)
    return pool.seconds_until_free(now) + (ahead // batcher.max_batch_size) * batch_s / healthy + batch_s


@dataclass
class RateMeter:
    """Arrivals per second, an exponentially weighted average over about `tau_s` seconds."""

    tau_s: float = 2.0
    rate: float = 0.0
    last: float = 0.0

    def tick(self, now: float) -> float:
        self.rate = self.rate * math.exp(-(now - self.last) / self.tau_s) + 1.0 / self.tau_s
        self.last = now
        return self.rate

    def current(self, now: float) -> float:
        return self.rate * math.exp(-(now - self.last) / self.tau_s)


@dataclass
class AdmissionState:
    """What admission measures as it runs: the arrival rate on two horizons."""

    arrivals: RateMeter = field(default_factory=RateMeter)
    arrivals_fast: RateMeter = field(default_factory=lambda: RateMeter(tau_s=0.25))

    def arrived(self, now: float) -> tuple[float, float]:
        return self.arrivals.tick(now), self.arrivals_fast.tick(now)


FAST_SPIKE = 1.2  # a short-horizon arrival rate this far above capacity is pressure at once


def under_pressure(batcher: Batcher, pool: GpuPool, model: str, rate: float, fast_rate: float) -> bool:
    """Arrivals over ~2 s above what the healthy workers serve, or over ~0.25 s well above it (the start of a
    flood, before the slow average sees it), or a worker lost."""
    healthy = pool.healthy_count()
    capacity = healthy * batcher.max_batch_size / batcher.batch_s[model]
    return rate > capacity or fast_rate > FAST_SPIKE * capacity or healthy < len(pool.workers)


def tier_bound_s(slo_ms: float, slack: float, tier: int) -> float:
    return slo_ms * slack * TIER_SHED[tier] / 1000


def admit(batcher: Batcher, pool: GpuPool | None, model: str, max_queue: int, bound_s: float,
          deadline_s: float, tier: int, tenant: str, state: AdmissionState) -> None:
    """Raise the 503 that fits, or return when the item may join the queue.

    `bound_s` is the tier's latency bound (slo x slack), applied under pressure; `deadline_s` the time left
    before the request's deadline."""
    if batcher.draining:
        raise errors.ApiError(503, "DRAINING", "the server is shutting down; retry on another node",
                              retry_after_ms=1000)
    if pool is None or pool.healthy_count() == 0:
        raise errors.ApiError(503, "NO_HEALTHY_WORKER",
                              "no healthy worker can take this request now" if pool else "the server is warming up",
                              retry_after_ms=1000)
    if batcher.depth.get(model, 0) >= max_queue:
        raise errors.overloaded(f"the queue for {model} is full ({max_queue} items)",
                                retry_after_ms=batcher.batch_s[model] * 1000)
    now = time.monotonic()
    arrival_rate, fast_rate = state.arrived(now)
    predicted = predicted_latency_s(batcher, pool, model, tier, tenant, now)
    if not under_pressure(batcher, pool, model, arrival_rate, fast_rate):
        bound_s = float("inf")
    # An objective tighter than the model's own batch time (a real model on a CPU) would refuse everything:
    # then allow at most one batch ahead of this one.
    bound_s = max(bound_s, 2 * batcher.batch_s[model])
    if predicted > min(bound_s, deadline_s):
        limit = "deadline" if deadline_s < bound_s else "latency objective"
        raise errors.overloaded(
            f"predicted latency {predicted * 1000:.0f} ms would miss the request's {limit}",
            retry_after_ms=(predicted - min(bound_s, deadline_s)) * 1000 + batcher.batch_s[model] * 1000,
        )
