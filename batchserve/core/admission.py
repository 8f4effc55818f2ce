"""The door's policy: refuse at once, not after a wait, what cannot be served in time (docs/contract.md#admission).

Predicted by the cost of the work ahead (`wait_prediction.predict`: the batches ahead and its own, each at its
learned time); under pressure the queue part is scaled by how such predictions turned out lately
(`wait_calibration.WaitCalibration`, fed with each admitted request's first batch). The last input is checked
against the request's deadline, so a many-input request is served when the batches it makes fit its timeout.

Under pressure (`under_pressure`) the first input is also checked against `slo_ms x slack x tier factor` (the
model's own SLO: `slo.Deadlines`), so lower tiers are refused first and admitted requests stay near the objective;
a long input makes its own batch costlier, so one tenant's long inputs are shed before another's short ones.
Without pressure a passing burst is queued, not refused.

No lock-out: a free worker with nothing queued admits what its deadline might allow (`BatchTimes.lower_bound`), and
when even that says no, one request now and then (`PROBE_EVERY_S`) runs as a probe: only running corrects a batch
time learned wrong. An input that costs more than a whole batch may is refused with 413: it can never run in time.

Policy over numbers: the clock is injected and the pool seen through `WorkerCapacity`, so unit tests need no
server, threads or sleeps.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Protocol
from collections.abc import Callable, Sequence

import msgspec

from batchserve import errors
from batchserve.core.batch_hold import Arrivals
from batchserve.core.batcher import Batcher
from batchserve.core.tiers import SHED
from batchserve.core.wait_calibration import WaitCalibration
from batchserve.core.class_turns import WaitPrediction
from batchserve.core.wait_prediction import predict
from batchserve.slo import Deadlines

FAST_SPIKE = 1.2  # a short-horizon arrival rate this far above capacity is pressure at once (a flood's start)...
# ... unless a burst passed lately (that rate rose above capacity and fell back below BURST_LOW of it within
# BURST_MEMORY_S): then only once it has stayed above capacity FAST_HELD_S without a dip. Closed-loop users answered
# together send together: traffic within capacity peaks well above it at every burst, and read as a flood, each
# burst's tail would be refused. A flood out of steady traffic is still seen at once.
FAST_HELD_S = 0.25
BURST_MEMORY_S = 2.0  # the long horizon: bursts that passed this lately are expected again
BURST_LOW = 0.8  # a burst has passed once that rate is back this far below capacity (not the wobble of a rise)
RATE_TAU_S, FAST_TAU_S = 2.0, 0.25  # the arrival rates' two horizons (s)
PROBE_EVERY_S = 5.0  # an idle model that refuses everything on its learned time lets one request run this often


class WorkerCapacity(Protocol):
    """What admission needs to know of the workers."""

    def healthy_count(self) -> int: ...
    def worker_count(self) -> int: ...
    def seconds_until_free(self, now: float) -> float: ...


class DoorFigures(msgspec.Struct, gc=False):
    """What the door reads of a model on every request, read afresh only when `BatchTimes.version` or the
    healthy workers change: between two batches every request would read the same numbers."""

    version: int  # the BatchTimes.version they were read at
    healthy: int  # the healthy workers they were read with
    batch_s: float  # a full batch's S
    most_s: float  # no batch of the model is expected longer (inf: a costed model's line rises)
    most_n: int  # the most inputs in one batch
    budget: float  # the most one batch may cost (inf: none)
    full_n: int  # inputs in a full batch
    capacity: float  # inputs per second the healthy workers serve (`_door_pressure`)
    backlog: float  # inputs queued past which arrivals over `capacity` are pressure (`_capacity`)
    lost: bool  # fewer healthy workers than workers


@dataclass
class Admission:
    """Admission state (the arrival rate on two horizons) and the decision for each new item."""

    batcher: Batcher
    capacity: WorkerCapacity | None  # None until the workers have started
    max_queue: int
    slo_s: float  # the SLO of a model without figures of its own in `deadlines`
    slack: float
    clock: Callable[[], float] = time.monotonic
    max_timeout_s: float = math.inf  # --max-timeout-ms: the longest timeout a caller may ask for (the same)
    # Each model's own SLO and timeouts (the runtime shares `ModelRegistry.deadlines`, as the batcher does).
    deadlines: dict[str, Deadlines] = field(default_factory=dict)
    arrivals: Arrivals = field(default_factory=lambda: Arrivals(RATE_TAU_S))
    arrivals_fast: Arrivals = field(default_factory=lambda: Arrivals(FAST_TAU_S))
    probed: dict[str, float] = field(default_factory=dict)  # per model: when a probe was last let through
    # Per (model, length class): admitted inputs per second, for the class turns the prediction replays.
    class_arrivals: dict[tuple[str, int], Arrivals] = field(default_factory=dict)
    calibration: WaitCalibration = field(default_factory=WaitCalibration)  # the prediction's learned error
    _figures: dict[str, DoorFigures] = field(default_factory=dict)  # per model: `read_figures`, kept until stale
    # Per model, while the short-horizon rate is above its capacity or has not fallen back below BURST_LOW of it
    # since: since when it has stayed above capacity (inf: it is not above it now); and when a burst last passed.
    fast_above: dict[str, float] = field(default_factory=dict)
    burst_passed: dict[str, float] = field(default_factory=dict)

    def tier_bound_s(self, tier: int, model: str = "") -> float:
        """The tier's latency bound under pressure: the model's own slo x slack x the tier's shed factor."""
        d = self.deadlines.get(model)
        return (self.slo_s if d is None else d.slo_s) * self.slack * SHED[tier]

    def arrival_rate(self) -> float:
        return self.arrivals.current(self.clock())

    def under_pressure(self, model: str, rate: float, fast_rate: float) -> bool:
        """Arrivals over ~2 s above what the healthy workers serve, or over ~0.25 s well above it (the start of
        a flood, before the slow average sees it; where bursts passed lately, once it held: `flood_from`), or a
        worker lost. `fast_rate` is `arrivals_fast` as the door ticked it."""
        assert self.capacity is not None
        fig = self.read_figures(model, self.capacity.healthy_count())
        now = self.clock()
        above = math.inf  # since when the short horizon is above capacity, as the door saw it (else: from now)
        if self.arrivals_fast.current(now) > fig.capacity:
            above = self.fast_above.get(model, now)
            above = now if above == math.inf else above
        flood = fast_rate > FAST_SPIKE * fig.capacity and now >= self._flood_at(model, above)
        over = (rate > fig.capacity or flood) and self.batcher.depth.get(model, 0) > fig.backlog
        return over or fig.lost

    def flood_from(self, model: str, now: float, fast_rate: float, capacity: float) -> float:
        """From when the short-horizon rate (`arrivals_fast`, just ticked at `now` to `fast_rate`) is a flood's
        start: at once, or where a burst passed lately FAST_HELD_S after it rose above capacity (inf: below
        capacity). The rate only decays between ticks, so `Arrivals.before` is its lowest since the last one: a dip
        below capacity starts the hold anew, one below BURST_LOW x capacity after a rise is a burst that passed."""
        above = self.fast_above.get(model)
        meter = self.arrivals_fast
        lowest, low = meter.before, BURST_LOW * capacity
        if above is not None and lowest <= low:  # a burst passed: when the rate, decaying, crossed `low`
            del self.fast_above[model]
            self.burst_passed[model] = now - meter.tau_s * math.log(low / max(lowest, 1e-9))
            above = None
        if fast_rate <= capacity:
            if above is not None and above != math.inf:
                self.fast_above[model] = math.inf  # fell back, not yet far: a rise now holds anew
            return math.inf
        if above is None or above == math.inf or lowest <= capacity:
            above = self.fast_above[model] = now
        return self._flood_at(model, above)

    def _flood_at(self, model: str, since: float) -> float:
        """For a short-horizon rate above capacity since `since`: from when it is a flood (`flood_from`)."""
        if since == math.inf:
            return math.inf
        if since - self.burst_passed.get(model, -math.inf) > BURST_MEMORY_S:
            return -math.inf
        return since + FAST_HELD_S

    def _capacity(self, model: str, healthy: int, full_n: int, full_s: float) -> tuple[float, float]:
        """Inputs per second the healthy workers serve, and the backlog past which arrivals above it are pressure.
        Full batches at their S: arrivals above that are over capacity, whatever is queued (backlog -1). A costed
        model's batches as they really were (`served_rate`), where lower: a worker that keeps up serves what arrives
        in batches as small as that, so the arrival rate is above the served one half the time, by chance; arrivals
        above it are pressure only once more waits than each worker's next batch takes (the queue is growing)."""
        capacity, backlog = healthy * full_n / full_s, -1.0
        got = self.batcher.costs.served.get(model)
        if got is not None and got[1] > 0 and healthy * (got[0] / got[1]) < capacity:
            capacity, backlog = healthy * (got[0] / got[1]), healthy * got[0]
        return capacity, backlog

    def read_figures(self, model: str, healthy: int) -> DoorFigures:
        """The model's `DoorFigures` with `healthy` workers, read afresh and kept until stale."""
        times = self.batcher.batch_s
        assert self.capacity is not None
        batch_s = times[model]
        most_n, budget, full_n = self.batcher.costs.shape(model)
        got = self._figures[model] = DoorFigures(
            times.version,
            healthy,
            batch_s,
            times.most(model),
            most_n,
            budget,
            full_n,
            *self._capacity(model, healthy, full_n, batch_s),
            healthy < self.capacity.worker_count(),
        )
        return got

    def check_open(self) -> None:
        """503 when nothing can be admitted at all: draining, warming up, or every worker lost."""
        if self.batcher.draining:
            raise errors.draining()
        if self.capacity is None:
            raise errors.warming_up()
        if self.capacity.healthy_count() == 0:
            raise errors.no_healthy_worker()

    def class_rates(self, model: str, now: float) -> dict[int, float]:
        """Admitted inputs per second joining each of the model's length classes, lately."""
        return {b: meter.current(now) for (m, b), meter in self.class_arrivals.items() if m == model}

    def _classes(self, model: str, bucket: int) -> bool:
        """Whether the model has a queue of a length class besides `bucket`: else no class rate can change a
        prediction (`predict` reads them only for another class's queue, and then replays the turns)."""
        for m, b in self.batcher.queues:
            if m == model and b != bucket:
                return True
        return False

    def _surely_in_time(self, until_free: float, ahead: int, deadline_s: float, most_s: float, rows: int) -> bool:
        """Whether any prediction `predict` could make answers a one-input request of a one-queue model before
        `deadline_s`: its batches ahead (at least `rows` inputs each), a partial one and its own, each at most
        `most_s` (`BatchTimes.most`). Then no prediction is needed. A method, not a function: a test counts calls."""
        worst = until_free + (ahead // rows + 2) * most_s
        return worst < deadline_s * (1 - 1e-9) - 1e-6  # clear of float rounding in the sums it bounds

    def _joined(self, model: str, bucket: int | None, now: float, n: int) -> None:
        if bucket is not None:
            meter = self.class_arrivals.get((model, bucket))
            if meter is None:
                meter = self.class_arrivals[(model, bucket)] = Arrivals(RATE_TAU_S)
            meter.tick(now, n)

    def observed(self, model: str, ticket: Ticket, started_s: float) -> None:
        """The first batch of a request admitted with `ticket` started at `started_s` (this clock): learn the
        prediction's error from it (`WaitCalibration`), when its prediction was one the door decided by."""
        if ticket.wait_s is not None:
            self.calibration.observe(model, ticket.wait_s, max(0.0, started_s - ticket.at))

    def wait_totals(self) -> dict[str, tuple[float, float, int, float, float]]:
        """Per model: predicted and observed queue waits summed (s), requests compared, the factor and the
        margin (s) now."""
        c = self.calibration
        return {
            model: (pred, actual, n, c.factor(model), c.margin(model))
            for model, (pred, actual, n) in c.totals().items()
        }

    def _probe(self, model: str, bucket: int | None, now: float, n: int) -> Ticket:
        """The ticket of a request let through as a probe, counted as it joins."""
        self.arrivals.tick(now, n), self.arrivals_fast.tick(now, n)
        self._joined(model, bucket, now, n)
        return Ticket(True, now)

    def _goes_as_probe(
        self, model: str, widest: float, deadline_s: float, timeout_s: float | None, idle: bool, now: float
    ) -> bool:
        """For a deadline its slowest batch alone could miss: raise the refusal that says why it cannot be met (a
        timeout too short, a deadline gone while the body was read, one no idle worker could reach), or return
        whether it goes as a probe (an idle worker, and none lately); False: judged as any other request."""
        batcher, times = self.batcher, self.batcher.batch_s
        # the quickest any answer can come: a batch of its own longest input alone
        fastest_s = times.lower_bound(model, batcher.costs.estimate_cost(model, 1, widest))
        least_s = fastest_s + batcher.margin_s  # one batch, and the dispatch margin the batcher keeps
        asked_s = deadline_s if timeout_s is None else timeout_s
        d = self.deadlines.get(model)
        if asked_s < least_s <= (self.max_timeout_s if d is None else d.max_timeout_s):  # it can ask for enough
            raise errors.timeout_too_short(least_s * 1000)
        if deadline_s < fastest_s <= asked_s:  # enough was asked, but it went before the request was read
            raise errors.deadline_exceeded()
        if deadline_s >= fastest_s:
            return False
        # not even an idle worker could answer in time: retrying would not help...
        if not (idle and now - self.probed.get(model, -math.inf) >= PROBE_EVERY_S):
            raise errors.deadline_unmeetable(fastest_s * 1000)
        self.probed[model] = now  # ...unless the figure is wrong: a probe now and then runs anyway
        return True

    def admit_ticket(
        self,
        model: str,
        tier: int,
        tenant: str,
        deadline_s: float,
        costs: Sequence[float] = (1.0,),
        bucket: int | None = None,
        timeout_s: float | None = None,
    ) -> Ticket:
        """Raise the 503 (or 413) that fits, or return the ticket on which the request's inputs join the queue,
        with what the door predicted for `observed`. `deadline_s`: the time left before the deadline; `costs`: what
        each input costs; `bucket`: the first input's length class, so other classes' queues count as their
        batches; `timeout_s`: the whole timeout from the first byte (default `deadline_s`), which judges a timeout
        too short to be met. `Ticket.probe`: its inputs run even if the learned time says they will be late."""
        batcher, capacity = self.batcher, self.capacity
        healthy = capacity.healthy_count() if capacity is not None else 0  # read once: nothing below changes it
        if batcher.draining or not healthy:
            self.check_open()  # raises the 503 that says which
        assert capacity is not None
        # Runs on every request: the common case (one input of cost 1, a count model, a deadline no batch time
        # could reach) is decided by comparisons of figures read once, without the calls that would say the same.
        n, widest = self._sized(model, costs)
        fig = self._figures.get(model)
        if fig is None or fig.version != batcher.batch_s.version or fig.healthy != healthy:  # stale: read anew
            fig = self.read_figures(model, healthy)
        now = self.clock()
        until_free = capacity.seconds_until_free(now)
        queued = batcher.depth.get(model, 0)
        idle = queued == 0 and until_free <= 0
        if not deadline_s >= fig.most_s + batcher.margin_s:  # else its slowest batch alone ends in time
            if self._goes_as_probe(model, widest, deadline_s, timeout_s, idle, now):
                return self._probe(model, bucket, now, n)
        pressure = self._door_pressure(model, fig, now, n, queued)
        # A free worker and nothing ahead: it runs now, since running is what corrects a stale estimate; decided
        # before the prediction, which cannot change it.
        if idle and n <= fig.full_n:
            self._joined(model, bucket, now, n)
            return Ticket(False, now)
        other_classes = bucket is not None and self._classes(model, bucket)
        # Without pressure only the deadline can refuse: when no prediction could reach it, admitted as the
        # prediction would admit it (nothing learned from a request admitted without pressure).
        if not pressure and n == 1 and not other_classes:
            if self._in_time_anyway(model, tier, tenant, widest, until_free, deadline_s, fig):
                self._joined(model, bucket, now, n)
                return Ticket(False, now)
        ahead = batcher.ahead_of(tier, tenant, model, costs[0] if costs else 1.0)
        rates = self.class_rates(model, now) if other_classes else None  # read by `predict` only then
        p = predict(batcher, model, until_free, healthy, ahead, costs, bucket, rates)
        raw_wait_s = p.wait_s
        if pressure:  # the queue part as long as such predictions really turned out lately
            p = p.scaled(self.calibration.factor(model))
        if pressure or p.last_s > deadline_s:
            self._refuse_if_late(model, tier, p, pressure, p.last_s - deadline_s, fig, until_free, ahead)
        self._joined(model, bucket, now, n)
        return Ticket(False, now, raw_wait_s if pressure else None)

    def _in_time_anyway(
        self, model: str, tier: int, tenant: str, widest: float, until_free: float, deadline_s: float, fig: DoorFigures
    ) -> bool:
        """Whether no prediction could put a one-input request past its deadline (`_surely_in_time`): first with
        the whole queue ahead (`ahead_of` is at most the depth), which needs no count of the tenants' shares."""
        rows = fig.most_n if fig.budget == math.inf else 1  # the batches ahead: at least this many inputs each
        most_s = fig.most_s
        depth = self.batcher.depth.get(model, 0)
        return self._surely_in_time(until_free, depth, deadline_s, most_s, rows) or self._surely_in_time(
            until_free, self.batcher.ahead_of(tier, tenant, model, widest), deadline_s, most_s, rows
        )

    def _sized(self, model: str, costs: Sequence[float]) -> tuple[int, float]:
        """The request's inputs and its widest one's cost; a 413 when that one is more than a batch may hold."""
        if len(costs) == 1:
            n, widest = 1, costs[0]
        else:
            n, widest = max(1, len(costs)), max(costs, default=1.0)
        if widest != 1.0 or self.batcher.costs.max_batch_cost > 0:  # else nothing can be too costly
            too_costly = self.batcher.costs.too_costly(model, widest)
            if too_costly is not None:
                raise errors.payload_too_large(f"{too_costly}: shorten it")
        return n, widest

    def _door_pressure(self, model: str, fig: DoorFigures, now: float, n: int, queued: int) -> bool:
        """For a request of `n` inputs joining `queued` ones: the 503 when the queue has no room for them, else
        tick the arrival meters and say whether the door is under pressure (`under_pressure`, with the kept figures)."""
        if queued + n > self.max_queue:
            raise errors.overloaded(
                f"the queue for {model} is full ({self.max_queue} items)", retry_after_ms=fig.batch_s * 1000
            )
        rate, fast_rate = self.arrivals.tick(now, n), self.arrivals_fast.tick(now, n)
        cap = fig.capacity
        # `flood_from`, written out for the common case: the short-horizon rate below capacity, nothing on record
        flood_at = self.flood_from(model, now, fast_rate, cap) if fast_rate > cap or self.fast_above else math.inf
        over = rate > cap or (fast_rate > FAST_SPIKE * cap and now >= flood_at)
        return (over and queued > fig.backlog) or fig.lost

    def _refuse_if_late(
        self,
        model: str,
        tier: int,
        p: WaitPrediction,
        pressure: bool,
        late_s: float,
        fig: DoorFigures,
        until_free: float,
        ahead: int,
    ) -> None:
        """The 503 for a request predicted (`p`) to end `late_s` past its deadline or, under pressure, to start
        past its tier's latency bound."""
        batch_s = fig.batch_s
        bound_s = self.tier_bound_s(tier, model) if pressure else math.inf
        # An objective tighter than the model's own batch time (a real model on a CPU) would refuse everything:
        # then allow at most one batch ahead of this one.
        bound_s = max(bound_s, 2 * batch_s)
        if pressure:  # 95 % of admitted requests within the bound, not half of those near it; never half of it
            bound_s -= min(self.calibration.margin(model), bound_s / 2)
        if p.first_s - bound_s <= 0 and late_s <= 0:
            return
        limit = "deadline" if late_s >= p.first_s - bound_s else "latency objective"
        # Truthful: the work ahead drains at its own pace, so this much later the same request fits; never more
        # than the whole queue ahead takes to run.
        wait_ahead_s = max(p.first_s, until_free + (ahead // fig.full_n + 1) * batch_s / max(1, fig.healthy))
        raise errors.overloaded(
            f"predicted latency {p.last_s * 1000:.0f} ms would miss the request's {limit}",
            retry_after_ms=(min(max(p.first_s - bound_s, late_s) + batch_s, wait_ahead_s)) * 1000,
        )


class Ticket(msgspec.Struct, gc=False):
    """An admitted request: a probe or not, when it was admitted (the door's clock), and the queue wait its
    prediction said before calibration (None where the door did not decide by it: no pressure, an idle worker,
    a probe). A Struct: built for every admitted request, in C and untracked by the collector."""

    probe: bool
    at: float
    wait_s: float | None = None
