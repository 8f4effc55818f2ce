"""Holding a free worker's batch for company while the load is high: the flush rule "a worker is free and waiting
longer would not help" (docs/contract.md#batching), "would not help" judged by the learned batch times.

Why: a free worker takes what waits (`Batcher.most_urgent`). Under low load that is right: one input alone, answered
at once. Near capacity, batches are whatever arrived while the last one ran, so the worker runs small batches back to
back at a small batch's cost per input. On a CPU a batch has a large fixed part (minilm: ~16 ms of CPU per input in
batches of 2-6, ~11 ms at 64), CPU the event loop and the tokenizer share, and admission, reading what the small
batches serve (`BatchBudget.served_rate`), sees pressure at a rate the model could serve.

The rule, per queue, when a worker is free (pacing due) and the queue is neither full nor draining:

- only under load: where taking what waits would keep the workers busier than `BUSY_HOLD` (`greedy_busy`), and where
  even full batches would keep them at least `LOAD_MIN` busy; else the batch goes now. The second matters where a
  batch's time hardly grows with its size (a GPU, the sim): taking what waits keeps the device "busy" at any rate,
  yet waiting buys nothing the device lacks and only adds its length to every answer;
- not near capacity: where even the batches it would wait for keep the workers busier than `BUSY_MAX`, a worker
  idling while inputs wait loses time it cannot make up (and the door, seeing longer waits than it predicts, refuses
  more), so the batch goes now and batches grow by the backlog alone;
- the batch worth waiting for: the smallest whose inputs cost at most `EFFICIENT_WITHIN` more each than in a full
  batch, read off `BatchTimes`; a queue already that large goes now, and a device whose time grows in proportion to
  its inputs never holds;
- how long: until this queue is expected to hold it (its own arrival rate), lowered to the largest batch that would
  end within `SLO_SHARE` of the SLO after its oldest input arrived (the rest is for a batch running ahead and the
  machine's noise), at most `HOLD_BATCHES` of that batch's time, never past the dispatch deadline. Decided once per
  batch (`Holds.until`), so the end of a burst is not held again and again for company that stopped coming.

So holds act between about a third of capacity and ~85 % of it, and fade out where throughput is at stake; with the
default 200 ms SLO a held batch still ends within 100 ms of its oldest input. Pure arithmetic over numbers and an
injected clock; arrivals are counted where batches form (`Holds.count`), not per request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import TYPE_CHECKING

from batchserve.core.batch import BatchBudget, BatchTimes, rows_in

if TYPE_CHECKING:
    from batchserve.core.fairqueue import FairQueue

BUSY_HOLD = 0.75  # hold only where taking what waits would keep the workers busier than this
LOAD_MIN = 1 / 3  # ... and where full batches would keep them at least this busy (the load, at full batches)
BUSY_MAX = 0.85  # ... and never where even the batches it waits for would keep them busier than this
EFFICIENT_WITHIN = 0.15  # the batch worth waiting for: the smallest whose inputs cost at most this much more
# each than in a full batch (where the per-input cost has flattened)
HOLD_BATCHES = 2.0  # a hold lasts at most this many batch times of the batch it waits for
SLO_SHARE = 0.5  # a held batch ends within this share of the SLO after its oldest input arrived
RATE_TAU_S = 1.0  # the arrival rates' horizon (seconds)


@dataclass
class Arrivals:
    """Items per second, an exponentially weighted average over about `tau_s` seconds: the door's (ticked per
    request) and those of a queue or a model here (fed where batches form, with the items joined since)."""

    tau_s: float = RATE_TAU_S
    rate: float = 0.0
    last: float = 0.0
    before: float = 0.0  # the rate just before the latest tick: its lowest since the tick before (it only decays)

    def tick(self, now: float, n: int = 1) -> float:
        self.before = self.rate * math.exp(-(now - self.last) / self.tau_s)
        self.rate = self.before + n / self.tau_s
        self.last = now
        return self.rate

    def current(self, now: float) -> float:
        return self.rate * math.exp(-(now - self.last) / self.tau_s)


def hold_until(
    now: float,
    oldest: float,
    n: int,
    full_n: int,
    seconds: Callable[[int], float],
    model_rate: float,
    queue_rate: float,
    workers: int,
    slo_s: float,
) -> float:
    """When a free worker should take this queue's batch (`now`: at once), by the rule in the module docstring.
    `n`: inputs waiting; `seconds(k)`: the learned time of a batch of k; rates in inputs/s. The dispatch deadline is
    the caller's, and comes first when earlier."""
    if n <= 0 or n >= full_n or model_rate <= 0.0 or queue_rate <= 0.0:
        return now
    share = model_rate / max(1, workers)  # inputs per second each worker serves
    if share * seconds(full_n) / full_n < LOAD_MIN or greedy_busy(share, full_n, seconds) <= BUSY_HOLD:
        return now
    best = (1.0 + EFFICIENT_WITHIN) * seconds(full_n) / full_n
    if seconds(n) / n <= best:
        return now  # already a batch whose inputs cost about what they would in a full one
    ends_by = oldest + SLO_SHARE * slo_s

    def fits(k: int) -> bool:  # a batch of k, formed when the k-th input is expected, ends in time
        return now + (k - n) / queue_rate + seconds(k) <= ends_by

    efficient = _first(n, full_n, lambda k: seconds(k) / k <= best)
    target = efficient if fits(efficient) else _bisect(n, efficient, lambda k: not fits(k))[0]  # the largest fitting
    if target <= n:
        return now  # no larger batch would end in time
    if share * seconds(target) / target > BUSY_MAX:
        return now  # near capacity: even such batches leave the worker no time to idle while they fill
    # At most two batch times (about what the inputs would have waited had the worker still been busy), so the
    # end of a burst (arrivals that stopped) is not held long for company that will not come.
    return now + min((target - n) / queue_rate, HOLD_BATCHES * seconds(target))


def greedy_busy(rate: float, full_n: int, seconds: Callable[[int], float]) -> float:
    """The share of a worker's time it is busy when it takes what waits whenever it frees, at `rate` inputs/s:
    its batches settle at the smallest k whose run lasts no longer than k inputs take to arrive (k >= rate x
    S(k)), busy rate x S(k) / k of the time; inf when no batch up to a full one keeps up."""
    if rate * seconds(full_n) > full_n:
        return math.inf
    k = 1 if rate * seconds(1) <= 1 else _first(1, full_n, lambda k: rate * seconds(k) <= k)
    return rate * seconds(k) / k


def _first(n: int, top: int, ok: Callable[[int], bool]) -> int:
    """The smallest k in (n, top] with ok(k), for ok false up to some k and true from there on (top when none
    is): steps of 1, 2, 4, ... past n, then bisection of the last (a handful of reads of the learned line)."""
    lo, step = n, 1
    while True:
        hi = min(top, n + step)
        if ok(hi) or hi >= top:
            break
        lo, step = hi, step * 2
    return _bisect(lo, hi, ok)[1]  # not ok(lo) (or lo == n), ok(hi) (or hi == top)


def _bisect(lo: int, hi: int, turned: Callable[[int], bool]) -> tuple[int, int]:
    """Narrow (lo, hi) to neighbours where `turned` (false, then true from some k on) turns between them."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if turned(mid):
            hi = mid
        else:
            lo = mid
    return lo, hi


Key = tuple[str, int]  # a queue: (model, length class)


@dataclass
class Holds:
    """What the batcher keeps for holding (`hold_until`): arrivals per queue and per model, each queue's length
    after its last batch, and each queue's hold. Apart from the batcher: only its pace rung reads them."""

    costs: BatchBudget
    batch_s: BatchTimes
    arrivals: dict[Key, Arrivals] = field(default_factory=dict)
    model_arrivals: dict[str, Arrivals] = field(default_factory=dict)
    left: dict[Key, int] = field(default_factory=dict)
    left_model: dict[str, int] = field(default_factory=dict)  # the same summed over a model's queues
    # Per queue: when its next batch's hold was decided, and until when it holds (the same: it does not).
    held: dict[Key, tuple[float, float]] = field(default_factory=dict)

    def until(self, key: Key, q: FairQueue, oldest: float, now: float, depth: int, workers: int, slo_s: float) -> float:
        """Until when a free worker holds queue `key`'s batch (not full; `depth` items of its model queued): now, or
        later while the load is high and a larger batch would cost its inputs much less. Decided once per batch, so
        the wait does not renew itself."""
        hold = self.held.get(key)
        if hold is not None:
            return hold[1]
        until = now
        model, model_rate, queue_rate = key[0], self.model_arrivals.get(key[0]), self.arrivals.get(key)
        if model_rate is not None and queue_rate is not None:
            costs, unit = self.costs, q.mean_cost()
            # The rates count arrivals where batches form: those since (still queued) count now too, or a busy
            # worker's rate would read low by the time one batch takes.
            tau = queue_rate.tau_s
            pending = max(0, len(q) - self.left.get(key, 0)) / tau
            pending_model = max(0, depth - self.left_model.get(model, 0)) / tau
            until = hold_until(
                now,
                oldest,
                len(q),
                rows_in(costs.limit(model), costs.budget(model), unit),
                lambda k: self.batch_s.at(model, costs.estimate_cost(model, k, unit)),
                model_rate.current(now) + pending_model,
                queue_rate.current(now) + pending,
                workers,
                slo_s,
            )
        self.held[key] = (now, until)
        return until

    def count(self, key: Key, now: float, queued: int) -> None:
        """The items that joined queue `key` since its last batch (it holds `queued` now), into its and its
        model's arrival rates: counted once per batch, not per request."""
        seen = queued - self.left.get(key, 0)
        if seen <= 0:
            return
        rate = self.arrivals.get(key)
        if rate is None:  # not `setdefault`: that builds a meter every batch only to throw it away
            rate = self.arrivals[key] = Arrivals()
        rate.tick(now, seen)
        model_rate = self.model_arrivals.get(key[0])
        if model_rate is None:
            model_rate = self.model_arrivals[key[0]] = Arrivals()
        model_rate.tick(now, seen)

    def left_after(self, key: Key, left: int) -> None:
        """Queue `key` holds `left` items once its batch was taken."""
        self.left_model[key[0]] = self.left_model.get(key[0], 0) + left - self.left.get(key, 0)
        self.left[key] = left

    def ended(self, key: Key, cause: str) -> str:
        """A batch of queue `key` went: its hold is over. Its cause: "hold" where a paced batch had waited (the
        batch it waited for came, or the wait it was worth passed)."""
        hold = self.held.pop(key, None)
        return "hold" if hold is not None and hold[1] > hold[0] and cause == "pace" else cause


# -- bursts --------------------------------------------------------------------------------------------------------
# A burst rides one batch: how long a free worker waits for the rest of a burst whose first inputs it sees.
# Closed-loop clients (locust's users, a UI's fan-out, a job runner's workers) send in bursts, and a free device
# takes what waits at once: a burst's first input would go alone and the rest wait a whole batch behind it,
# doubling every caller's latency though the device was idle. Per model, from the gaps between arrivals at the door
# (`Bursts.arrived`): while bursts are the rule, a free worker waits for a quiet gap, within a window short enough
# that an input that waited through a running batch goes at once (and never past its dispatch deadline). Spread
# arrivals hold nothing, nor do arrivals so dense they never fall quiet (a stream: several devices would each wait
# out the window). A full queue goes at once.
GAP_MAX_S = 0.008  # a gap this short or shorter is inside a burst; also the longest quiet a worker waits for
QUIET_GAPS = 8.0  # the burst is over once no input came for this many typical in-burst gaps
# ... but at least this long: hiccups of the door (a cold path, answers written meanwhile) and of the client can
# part two requests sent together by 1-8 ms, where most are 0.1 ms apart
QUIET_MIN_S = 0.006
# The most a burst holds its first input, from its arrival: a share of one batch's time, at most WINDOW_MAX_S (a
# burst of 60 users from one locust process takes ~20 ms to arrive).
WINDOW_BATCH_SHARE = 0.4
WINDOW_MAX_S = 0.040
BURSTY_SHARE = 0.5  # arrivals come in bursts when at least this share of them follow another within GAP_MAX_S
INITIAL_SHARE = 0.7  # bursty until arrivals say otherwise: one lone input (x 0.8) leaves it above BURSTY_SHARE
ALPHA = 0.2  # weight of the newest arrival in the decayed means (the last ten or so: one burst teaches it)


@dataclass
class Bursts:
    """One model's arrivals: whether they come in bursts, and how far apart inside one."""

    last: float = -math.inf  # when the latest input arrived
    started: float = -math.inf  # when the run of close arrivals the latest belongs to began
    # Decayed share of arrivals that followed another within GAP_MAX_S; it starts as if bursty, so a server's very
    # first burst rides one batch too (a lone first input then waits one quiet, a few ms).
    share: float = INITIAL_SHARE
    gap_s: float = GAP_MAX_S  # decayed mean of those gaps

    def arrived(self, at: float) -> None:
        """An input that arrived at `at` (out of order by a few µs is fine: a negative gap counts as 0)."""
        gap = at - self.last
        if gap <= GAP_MAX_S:
            self.share += ALPHA * (1.0 - self.share)
            self.gap_s += ALPHA * (max(0.0, gap) - self.gap_s)
        else:
            self.share -= ALPHA * self.share
            self.started = at
        if at > self.last:
            self.last = at

    def until(self, oldest: float, batch_s: float) -> float:
        """Until when a free worker waits for the rest of the burst whose oldest waiting input arrived at
        `oldest`, for a model whose batch takes `batch_s` (-inf: it does not wait)."""
        if self.share < BURSTY_SHARE:
            return -math.inf
        window = min(WINDOW_MAX_S, WINDOW_BATCH_SHARE * batch_s)
        if self.last - self.started > window:  # close arrivals for longer than a burst lasts: a stream, no burst
            return -math.inf
        quiet = min(GAP_MAX_S, max(QUIET_MIN_S, QUIET_GAPS * self.gap_s))
        return min(self.last + quiet, oldest + window)
