"""The door's policy: refuse at once what cannot be served in time, never after it has waited (DESIGN §5).

Predicted latency for a new item = time until the first healthy worker is free
                                 + (items queued ahead / batch size) x full batch time / healthy workers
                                 + the time of its own batch (the items left over ahead of it, and itself).
Batch times are learned by size (`batch_time.BatchTimes`); capacity counts full batches.
It is always checked against the request's own deadline. Under pressure — arrivals faster than the healthy
workers can serve, or a worker lost — it is also checked against `slo_ms x slack x tier factor`, so the lower
tiers are refused first and admitted requests stay near the objective. Without pressure a passing burst is
queued, not refused: the queue drains by itself, and refusing the tail of a burst would turn a few slow answers
into errors. A free worker with nothing queued ahead admits what its deadline might allow (the quickest a
batch of one may take, `BatchTimes.lower_bound`): only running corrects a batch time learned from one slow batch.

Everything here is policy over numbers: the clock is injected, the pool is seen through `Capacity`, so the
unit tests drive it without a server, threads or sleeps.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from batchserve import errors
from batchserve.batcher import Batcher
from batchserve.core.tiers import SHED

FAST_SPIKE = 1.2  # a short-horizon arrival rate this far above capacity is pressure at once


class Capacity(Protocol):
    """What admission needs to know of the workers."""

    def healthy_count(self) -> int: ...
    def worker_count(self) -> int: ...
    def seconds_until_free(self, now: float) -> float: ...


def predicted_latency_s(until_free_s: float, ahead: int, max_batch_size: int, batch_s: float,
                        healthy: int, own_batch_s: float | None = None) -> float:
    """When a new item would be answered: the first free worker, the full batches ahead of it (`batch_s`
    each) shared by the healthy workers, then its own batch (`own_batch_s`, by default a full one)."""
    own = batch_s if own_batch_s is None else own_batch_s
    return until_free_s + (ahead // max_batch_size) * batch_s / max(1, healthy) + own


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
class Admission:
    """Admission state (the arrival rate on two horizons) and the decision for each new item."""

    batcher: Batcher
    capacity: Capacity | None  # None until the workers have started
    max_queue: int
    slo_s: float
    slack: float
    clock: Callable[[], float] = time.monotonic
    arrivals: RateMeter = field(default_factory=RateMeter)
    arrivals_fast: RateMeter = field(default_factory=lambda: RateMeter(tau_s=0.25))

    def tier_bound_s(self, tier: int) -> float:
        """The tier's latency bound under pressure: slo x slack x the tier's shed factor."""
        return self.slo_s * self.slack * SHED[tier]

    def arrival_rate(self) -> float:
        return self.arrivals.current(self.clock())

    def under_pressure(self, model: str, rate: float, fast_rate: float) -> bool:
        """Arrivals over ~2 s above what the healthy workers serve, or over ~0.25 s well above it (the start of
        a flood, before the slow average sees it), or a worker lost."""
        assert self.capacity is not None
        healthy = self.capacity.healthy_count()
        capacity = healthy * self.batcher.limit(model) / self.batcher.batch_s[model]
        return rate > capacity or fast_rate > FAST_SPIKE * capacity or healthy < self.capacity.worker_count()

    def check_open(self) -> None:
        """503 when nothing can be admitted at all: draining, warming up, or every worker lost."""
        if self.batcher.draining:
            raise errors.draining()
        if self.capacity is None:
            raise errors.warming_up()
        if self.capacity.healthy_count() == 0:
            raise errors.no_healthy_worker()

    def admit(self, model: str, tier: int, tenant: str, deadline_s: float) -> None:
        """Raise the 503 that fits, or return when the item may join the queue (`deadline_s`: the time left
        before the request's deadline)."""
        batcher, capacity = self.batcher, self.capacity
        if batcher.draining or capacity is None or capacity.healthy_count() == 0:
            self.check_open()  # raises the 503 that says which
        assert capacity is not None
        batch_s = batcher.batch_s[model]
        fastest_s = batcher.batch_s.lower_bound(model, 1)  # a batch of one: the quickest any answer can come
        if deadline_s < fastest_s:  # not even an idle worker could answer in time: retrying would not help
            raise errors.deadline_unmeetable(fastest_s * 1000)
        if batcher.depth.get(model, 0) >= self.max_queue:
            raise errors.overloaded(f"the queue for {model} is full ({self.max_queue} items)",
                                    retry_after_ms=batch_s * 1000)
        now = self.clock()
        rate, fast_rate = self.arrivals.tick(now), self.arrivals_fast.tick(now)
        ahead = batcher.ahead_of(tier, tenant)
        size = batcher.limit(model)
        own_batch_s = batcher.batch_s.at(model, ahead % size + 1)
        predicted = predicted_latency_s(capacity.seconds_until_free(now), ahead, size, batch_s,
                                        capacity.healthy_count(), own_batch_s)
        bound_s = self.tier_bound_s(tier) if self.under_pressure(model, rate, fast_rate) else math.inf
        # An objective tighter than the model's own batch time (a real model on a CPU) would refuse everything:
        # then allow at most one batch ahead of this one.
        bound_s = max(bound_s, 2 * batch_s)
        # A free worker and nothing ahead: this item runs now, and running is what corrects a stale estimate
        # (refused, a batch time learned from one slow batch would refuse every request for good).
        idle = ahead == 0 and capacity.seconds_until_free(now) <= 0
        if predicted > min(bound_s, deadline_s) and not idle:
            limit = "deadline" if deadline_s < bound_s else "latency objective"
            raise errors.overloaded(
                f"predicted latency {predicted * 1000:.0f} ms would miss the request's {limit}",
                retry_after_ms=(predicted - min(bound_s, deadline_s)) * 1000 + batch_s * 1000,
            )
