"""The door's policy: refuse at once what cannot be served in time, never after it has waited (DESIGN §5).

Predicted by the cost of the work ahead (issue 22). For a request of n inputs of tier t and tenant u:

    ahead  = items it would wait behind (every higher tier, and its tenant's fair share of its own tier)
    F      = inputs in a full batch of the model (`Batcher.full_n`: the batch size, or what its cost budget holds)
    the first of its inputs is answered at  until_free + (ahead // F) x S(full) / healthy + S(its batch)
    the last                              at  until_free + (ahead // F) x S(full) / healthy
                                              + (k - 1) x S(one of its batches) / healthy + S(its last batch)
                                          with k its own batches: as many of its inputs as the budget holds each,

where S is the learned batch time at a batch's cost (`batch_time.BatchTimes`; its own batches cost rows x its
longest input: inputs of like length share a batch, `bucket_of`). The last input is checked against the request's
deadline: a many-input request is predicted as the batches it will make and served when they fit its timeout.
Under pressure — arrivals faster than the healthy workers serve, or a worker lost — the first input is also
checked against `slo_ms x slack x tier factor`, so lower tiers are refused first and admitted requests stay near
the objective; since a long input makes its own batch costlier, one tenant's long inputs pass that bound
before another's short ones do, and are shed first. Without pressure a passing burst is queued, not refused.

No lock-out: a free worker with nothing queued ahead admits what its deadline might allow (the quickest a batch
may take, `BatchTimes.lower_bound`), and when even that says no, one request now and then (`PROBE_EVERY_S`) is
let through as a probe that runs whatever the figure says: only running corrects a batch time learned wrong.
An input that costs more than a whole batch may (`--max-batch-tokens`, or alone longer than half the longest
allowed timeout) is refused with 413: it can never run in time.

Everything here is policy over numbers: the clock is injected, the pool is seen through `WorkerCapacity`, so the
unit tests drive it without a server, threads or sleeps.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from batchserve import errors
from batchserve.core.batcher import Batcher
from batchserve.core.tiers import SHED

FAST_SPIKE = 1.2  # a short-horizon arrival rate this far above capacity is pressure at once
PROBE_EVERY_S = 5.0  # an idle model that refuses everything on its learned time lets one request run this often


class WorkerCapacity(Protocol):
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


@dataclass(frozen=True)
class Prediction:
    """When a request's first and last inputs would be answered, seconds from now."""

    first_s: float
    last_s: float


def predict(batcher: Batcher, model: str, until_free_s: float, healthy: int, ahead: int,
            costs: Sequence[float], bucket: int | None = None) -> Prediction:
    """The batches ahead (full ones of the model's mean input) and the request's own (rows of its longest
    input, as many as the budget holds), each at its cost (module docstring). With `bucket` (the request's
    length class), the model's other classes count as the batches they will really make: each class forms
    batches of its own, so a queue of mixed lengths drains in more, smaller batches than its count says (on
    minilm, counting them as one queue predicted a third of the wait admitted requests then had)."""
    times = batcher.batch_s
    full_n, limit, budget = batcher.full_n(model), batcher.limit(model), batcher.budget(model)
    unit = batcher.unit.get(model, 1.0)
    # Its own batches: inputs of like length (the backend groups them, `bucket_of`), padded to its longest.
    own_unit = max(costs, default=1.0)
    per_batch = limit if budget == math.inf else max(1, min(limit, int(budget // own_unit)))
    share = max(1, healthy)
    base = until_free_s
    if bucket is not None:
        depth = batcher.depth.get(model, 0)
        part = min(1.0, ahead / depth) if depth else 0.0  # of the queued items, the share ahead by tier
        own = batcher.queues.get((model, bucket))
        rounds = math.ceil(len(own) * part) // per_batch + 1 if own is not None else 1  # its class's turns
        others_s, others_n = batcher.other_classes_s(model, bucket, part, rounds)
        base += others_s / share
        ahead = max(0, ahead - others_n)
        if own is not None and len(own):  # its own class's batches: rows of that class's inputs
            unit = own.mean_cost()
            full_n = limit if budget == math.inf else max(1, min(limit, int(budget // unit)))
    full_s = times.at(model, batcher.estimate_cost(model, full_n, unit)) if bucket is not None else times[model]
    base += (ahead // full_n) * full_s / share
    rem = ahead % full_n
    if rem + 1 > per_batch:  # the partial batch ahead leaves without it
        base += times.at(model, batcher.estimate_cost(model, rem, unit)) / share
        rem = 0
    first = base + times.at(model, batcher.estimate_cost(model, rem + 1, own_unit))
    total = rem + max(1, len(costs))
    k = -(-total // per_batch)
    last_rows = total - (k - 1) * per_batch
    last = (base + (k - 1) * times.at(model, batcher.estimate_cost(model, per_batch, own_unit)) / share
            + times.at(model, batcher.estimate_cost(model, last_rows, own_unit)))
    return Prediction(first, max(first, last))


@dataclass
class RateMeter:
    """Arrivals per second, an exponentially weighted average over about `tau_s` seconds."""

    tau_s: float = 2.0
    rate: float = 0.0
    last: float = 0.0

    def tick(self, now: float, n: int = 1) -> float:
        self.rate = self.rate * math.exp(-(now - self.last) / self.tau_s) + n / self.tau_s
        self.last = now
        return self.rate

    def current(self, now: float) -> float:
        return self.rate * math.exp(-(now - self.last) / self.tau_s)


@dataclass
class Admission:
    """Admission state (the arrival rate on two horizons) and the decision for each new item."""

    batcher: Batcher
    capacity: WorkerCapacity | None  # None until the workers have started
    max_queue: int
    slo_s: float
    slack: float
    clock: Callable[[], float] = time.monotonic
    arrivals: RateMeter = field(default_factory=RateMeter)
    arrivals_fast: RateMeter = field(default_factory=lambda: RateMeter(tau_s=0.25))
    probed: dict[str, float] = field(default_factory=dict)  # per model: when a probe was last let through

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
        capacity = healthy * self.batcher.full_n(model) / self.batcher.batch_s[model]
        served = self.batcher.served_rate(model)  # a costed model's batches as they really are
        if served is not None:
            capacity = min(capacity, healthy * served)
        return rate > capacity or fast_rate > FAST_SPIKE * capacity or healthy < self.capacity.worker_count()

    def check_open(self) -> None:
        """503 when nothing can be admitted at all: draining, warming up, or every worker lost."""
        if self.batcher.draining:
            raise errors.draining()
        if self.capacity is None:
            raise errors.warming_up()
        if self.capacity.healthy_count() == 0:
            raise errors.no_healthy_worker()

    def admit(self, model: str, tier: int, tenant: str, deadline_s: float,
              costs: Sequence[float] = (1.0,), bucket: int | None = None) -> bool:
        """Raise the 503 (or 413) that fits, or return when the request's inputs may join the queue
        (`deadline_s`: the time left before the request's deadline; `costs`: what each input costs). True when
        the request goes as a probe: its inputs run even if the learned time says they will be late.
        `bucket`: the length class of its first input, so the other classes' queues count as their batches."""
        batcher, capacity = self.batcher, self.capacity
        if batcher.draining or capacity is None or capacity.healthy_count() == 0:
            self.check_open()  # raises the 503 that says which
        assert capacity is not None
        n = max(1, len(costs))
        widest = max(costs, default=1.0)
        too_costly = batcher.too_costly(model, widest)
        if too_costly is not None:
            raise errors.payload_too_large(f"{too_costly}: shorten it")
        batch_s = batcher.batch_s[model]
        now = self.clock()
        until_free = capacity.seconds_until_free(now)
        queued = batcher.depth.get(model, 0)
        idle = queued == 0 and until_free <= 0
        # the quickest any answer can come: a batch of its own longest input alone
        fastest_s = batcher.batch_s.lower_bound(model, batcher.estimate_cost(model, 1, widest))
        if deadline_s < fastest_s:  # not even an idle worker could answer in time: retrying would not help...
            if not (idle and now - self.probed.get(model, -math.inf) >= PROBE_EVERY_S):
                raise errors.deadline_unmeetable(fastest_s * 1000)
            # ...unless the figure is wrong: a probe now and then runs anyway, and what it takes is learned
            self.probed[model] = now
            self.arrivals.tick(now, n), self.arrivals_fast.tick(now, n)
            return True
        if queued + n > self.max_queue:
            raise errors.overloaded(f"the queue for {model} is full ({self.max_queue} items)",
                                    retry_after_ms=batch_s * 1000)
        rate, fast_rate = self.arrivals.tick(now, n), self.arrivals_fast.tick(now, n)
        ahead = batcher.ahead_of(tier, tenant)
        healthy = capacity.healthy_count()
        p = predict(batcher, model, until_free, healthy, ahead, costs, bucket)
        bound_s = self.tier_bound_s(tier) if self.under_pressure(model, rate, fast_rate) else math.inf
        # An objective tighter than the model's own batch time (a real model on a CPU) would refuse everything:
        # then allow at most one batch ahead of this one.
        bound_s = max(bound_s, 2 * batch_s)
        # A free worker and nothing ahead: this request runs now, and running is what corrects a stale estimate
        # (refused, a batch time learned from one slow batch would refuse every request for good).
        if idle and n <= batcher.full_n(model):
            return False
        late_s = max(p.first_s - bound_s, p.last_s - deadline_s)
        if late_s > 0:
            limit = "deadline" if p.last_s - deadline_s >= p.first_s - bound_s else "latency objective"
            # Truthful: the work ahead drains at its own pace, so this much later the same request fits; never
            # more than the whole queue ahead takes to run.
            wait_ahead_s = max(p.first_s, until_free + (ahead // batcher.full_n(model) + 1) * batch_s / max(1, healthy))
            raise errors.overloaded(
                f"predicted latency {p.last_s * 1000:.0f} ms would miss the request's {limit}",
                retry_after_ms=min(late_s + batch_s, wait_ahead_s) * 1000,
            )
        return False
