"""A batch: the items one worker runs together and what it costs; what tracing sees of its run; how long a
model's batches take (`BatchTimes`, learned); and how many inputs and how much cost one may hold (`BatchBudget`)."""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from batchserve.core.fairqueue import Item


@dataclass(eq=False)
class Batch:
    model: str
    items: list[Item]
    formed: float
    cause: str  # full | deadline | pace | hold | burst | drain | retry | isolated
    avoid_worker: int = -1  # a retry prefers another worker than the one that failed it
    after_hang: bool = False  # items of a batch whose worker hung: not retried a second time
    held: list[Item] = field(default_factory=list)  # bisection: the other half, waiting on this one's outcome
    isolated: bool = False  # items of a job isolated for failing: never mixed into regular batches, halves included

    @property
    def cost(self) -> float:
        """What this batch costs to run: the backend's `cost_of_batch` when it declares one (e.g. the sum of
        tokens, or quadratic attention), else rows x the longest row (padded), 1 per input when inputs cost 1."""
        fn = self.items[0].batch_cost if self.items else None
        if fn is not None:
            return float(fn([item.text for item in self.items]))
        return len(self.items) * max([item.cost for item in self.items]) if self.items else 0.0


@dataclass(frozen=True)
class BatchRun:
    """One batch run as tracing sees it: a span's figures, linked to its requests' spans (`attributes`: the
    path's own, e.g. a stepper sequence's rows and tokens)."""

    model: str
    size: int
    worker: str
    cause: str
    started: float
    ended: float
    requests: Iterable[object]
    failed: str | None = None
    attributes: Mapping[str, str | int | float] | None = None


class BatchTracer(Protocol):
    """What the paths that run batches ask of tracing (`batchserve.tracing.Tracing`, present only when it is on)."""

    def batch(self, run: BatchRun) -> object: ...


# -- the learned batch time ------------------------------------------------------------------------------------
# The learned batch time S, per model and by batch cost (the built-ins: padded tokens; a plugin that says nothing: 1
# per input, so cost reads as size). Not one S per model: a real model's batch of 1 runs in a fraction of a batch of
# 100's time, so a full batch's S would dispatch a lone item far too early and a lone item's S too late.
#
# Costs fall in power-of-two buckets (1, 2, 3-4, 5-8, ...), each an EWMA point (n, S). S at any cost is read off the
# line through the points:
# - between two points: linear interpolation;
# - below the smallest: that point's S (a smaller batch is not slower; no guess at how much faster);
# - above the largest: the line through the smallest and largest points (the widest baseline, so two noisy
#   neighbours cannot fake a steep slope), never falling and never steeper than S(largest) x n / largest (a batch
#   costs at most its inputs one by one);
# - no point yet: the model's seed (the backend's first guess, or a warm-up measurement).
EWMA_ALPHA = 0.2  # weight of the newest batch in a bucket's mean
DEFAULT_SEED_S = 1.0  # a model with neither a seed nor a measurement
MEMO_KEPT = 1024  # costs whose S a line remembers (then it starts over)


def size_bucket(n: float) -> int:
    """0 for 1, 1 for 2, 2 for 3-4, 3 for 5-8, ...: the power of two at or above n."""
    return max(0, (max(1, math.ceil(n)) - 1).bit_length())


@dataclass
class Point:
    size: float  # mean batch size seen in the bucket
    seconds: float  # mean batch time seen in the bucket


@dataclass(frozen=True)
class _Line:
    """A model's measured points by size, and the slope to read past the largest."""

    sizes: list[float]
    seconds: list[float]
    slope: float
    # S by cost, memoised: a count model's few sizes are read ~8 times per admitted request between two batches.
    # Bounded, since a costed model's float costs rarely repeat; a new line (an observation) starts empty.
    memo: dict[float, float] = field(default_factory=dict, compare=False)
    # `BatchTimes.most` by the cap it was read at: the door asks it on every request, the line changes per batch.
    tops: dict[float, float] = field(default_factory=dict, compare=False)

    @classmethod
    def through(cls, points: list[Point]) -> _Line:
        if not points:
            return cls([], [], 0.0)
        first, last = points[0], points[-1]
        slope = (last.seconds - first.seconds) / (last.size - first.size) if last.size > first.size else 0.0
        slope = min(max(0.0, slope), last.seconds / last.size)
        return cls([p.size for p in points], [p.seconds for p in points], slope)

    def read(self, n: float) -> float:
        """S at cost n (>= 1) off the points, by the rules above `EWMA_ALPHA`; needs at least one point."""
        sizes, secs = self.sizes, self.seconds
        i = bisect.bisect_right(sizes, n)  # the points at or below n: sizes[:i]
        if i == 0:
            return secs[0]
        lo = i - 1
        if sizes[lo] == n:
            return secs[lo]
        if i < len(sizes):
            return secs[lo] + (secs[i] - secs[lo]) * (n - sizes[lo]) / (sizes[i] - sizes[lo])
        return secs[lo] + self.slope * (n - sizes[lo])


@dataclass
class BatchTimes:
    """S(n) per model. Indexing (`times[model]`) gives a full batch's S, the one number for callers that do not
    know a size (capacity, timeouts, retry hints)."""

    max_batch_size: int
    seeds: dict[str, float] = field(default_factory=dict)
    # Per model: the cost of a full batch (what `times[model]` reads S at) and the highest cost `at` reads
    # (a costed model's batches are not bounded by the batch size). Both default to max_batch_size: one per input.
    full: dict[str, float] = field(default_factory=dict)
    caps: dict[str, float] = field(default_factory=dict)
    points: dict[str, dict[int, Point]] = field(default_factory=dict)
    alpha: float = EWMA_ALPHA
    # Each model's line: read on every request, rebuilt only after an observation.
    _lines: dict[str, _Line] = field(default_factory=dict, repr=False)
    # Bumped by anything that may change what `at` or `most` read (a point, seed, cap or full batch's cost;
    # `BatchBudget` bumps it for budgets and mean costs): the door's `admission.DoorFigures` are stale once it moves.
    version: int = 0

    def seed(self, model: str, seconds: float) -> None:
        """The batch time to assume before any batch of `model` is measured."""
        self.seeds[model] = seconds
        self.version += 1

    def observe(self, model: str, size: float, seconds: float) -> None:
        """One batch of cost `size` (its inputs, for a plugin that declares no cost) took `seconds`."""
        self._lines.pop(model, None)
        self.version += 1
        buckets = self.points.setdefault(model, {})
        p = buckets.get(size_bucket(size))
        if p is None:
            buckets[size_bucket(size)] = Point(float(size), seconds)
            return
        p.size += self.alpha * (size - p.size)
        p.seconds += self.alpha * (seconds - p.seconds)

    def forget_above(self, model: str, cost: float) -> None:
        """Drop the points costlier than `cost` (the budget was lowered below them): a slow point nothing runs at
        again must not hold the budget low for good; a budget raised on the extrapolated line is measured again."""
        buckets = self.points.get(model, {})
        for key in [k for k, p in buckets.items() if p.size > cost]:
            del buckets[key]
        self._lines.pop(model, None)
        self.version += 1

    def at(self, model: str, size: float) -> float:
        """The expected time of a batch of cost `size` (clamped to 1..the model's cap)."""
        cap = self.caps.get(model, self.max_batch_size)  # clamped to 1..cap: comparisons, not min() and max()
        n = size if size < cap else cap
        n = float(n) if n > 1.0 else 1.0
        line = self._lines.get(model)
        if line is None:
            line = self._lines[model] = _Line.through(sorted(self.points.get(model, {}).values(), key=lambda p: p.size))
        memo = line.memo
        got = memo.get(n)
        if got is not None:
            return got
        if not line.sizes:
            return self.seeds.get(model, DEFAULT_SEED_S)  # not kept: a seed may be set again
        if len(memo) >= MEMO_KEPT:
            memo.clear()
        got = memo[n] = line.read(n)
        return got

    def most(self, model: str) -> float:
        """The longest any batch of this model is expected to take (`at` never exceeds it), so the door can skip a
        prediction that could not matter: the slowest point, or the line at the cap where it rises past them (inf:
        a costed model has no count cap, so a rising line has no top)."""
        cap = self.caps.get(model, self.max_batch_size)
        line = self._lines.get(model)
        if line is not None:
            got = line.tops.get(cap)
            if got is not None:
                return got
        else:
            self.at(model, 1.0)  # builds the line
            line = self._lines[model]
        if not line.sizes:
            return self.seeds.get(model, DEFAULT_SEED_S)  # not kept: a seed may be set again
        if cap == math.inf:
            top = math.inf if line.slope > 0 else max(line.seconds)
        else:
            top = max(max(line.seconds), self.at(model, cap))
        line.tops[cap] = top
        return top

    def lower_bound(self, model: str, size: float) -> float:
        """The least a batch of `size` may take, for refusing or dropping work that could not finish in time: the
        learned S(size) or the seed, whichever is lower. Not the learned S alone: after one slow first batch (a cold
        start) every request would be refused, and with nothing running nothing could lower it again."""
        learned = self.at(model, size)
        seed = self.seeds.get(model)
        return learned if seed is None else min(learned, seed)

    def by_size(self, model: str) -> dict[int, float]:
        """The measured points, mean size (rounded) to seconds: what /internal/health shows."""
        return {round(p.size): p.seconds for p in sorted(self.points.get(model, {}).values(), key=lambda p: p.size)}

    def largest(self, model: str) -> float:
        """The cost of the costliest batch measured (0: none yet)."""
        return max((p.size for p in self.points.get(model, {}).values()), default=0.0)

    def fit(self, model: str, seconds: float, floor: float, top: float) -> float:
        """The largest cost in [floor, top] whose batch is expected within `seconds` (halving from `top`): what a
        model's cost budget is lowered to when a full batch would outlast the longest allowed timeout."""
        cost = top
        while cost > floor and self.at(model, cost) > seconds:
            cost = max(floor, cost / 2)
        return cost

    # -- one number per model: a full batch's S --------------------------------------------------------------
    def __getitem__(self, model: str) -> float:
        return self.at(model, self.full.get(model, self.max_batch_size))

    def models(self) -> list[str]:
        return sorted(set(self.seeds) | set(self.points))

    def __iter__(self) -> Iterator[str]:
        return iter(self.models())

    def items(self) -> list[tuple[str, float]]:
        return [(m, self[m]) for m in self.models()]


# -- a batch's size and cost budget, per model -----------------------------------------------------------------
# Every input carries its cost (the backend's `cost_of`, e.g. tokens; 1 for a plugin that declares none) and a
# batch stops filling at `--max-batch-tokens` (the cost budget) or at the batch size (`limit`), whichever comes
# first; the budget is lowered so a full batch fits its time bounds (`fit_budget`). The arithmetic the batcher forms
# batches by and the door predicts with: no queue and no clock, so unit tests drive it with numbers alone. A model
# whose inputs all cost 1 never reaches the costed branches: its budget is infinite, a full batch its batch size.
log = logging.getLogger("batchserve")
UNIT_ALPHA = 0.02  # weight of the newest input in a model's mean input cost (a full batch's cost is read off it)
ROW_ALPHA = 0.2  # weight of the newest batch in a length class's padded cost per row (`row_cost`)
SERVED_ALPHA = 0.2  # weight of the newest batch in the served-rate average (`served_rate`)


def rows_in(limit: int, budget: float, cost: float) -> int:
    """Rows of inputs of this cost in one batch of a model: its limit, or what its budget holds."""
    return limit if budget == math.inf else max(1, min(limit, int(budget // cost)))


@dataclass
class BatchBudget:
    """Per model: the most inputs and cost one batch may hold, its mean and widest input, and what batches
    served. Read on every request (`budget`, `limit`, `full_n`: comparisons and look-ups, no allocation)."""

    max_batch_size: int
    batch_s: BatchTimes  # the learned batch time per model and cost (the batcher's, shared)
    model_limits: dict[str, int] = field(default_factory=dict)  # per model id: a plugin's max_batch_size, if lower
    max_batch_cost: float = 0.0  # --max-batch-tokens: the cost budget of one batch (0 = none)
    max_batch_s: float = math.inf  # a full batch expected longer than this lowers the model's budget to fit
    latency_fit_s: float = math.inf  # a costed model's full batch longer than this lowers its budget (slo x slack / 2)
    latency_fits: dict[str, float] = field(default_factory=dict)  # per model id, from its own SLO: in place of it
    cost_limits: dict[str, float] = field(default_factory=dict)  # per model: a budget lowered to fit (fit_budget)
    unit: dict[str, float] = field(default_factory=dict)  # per model: mean cost of an input (1 until one costs more)
    widest: dict[str, float] = field(default_factory=dict)  # per model: the costliest input seen
    served: dict[str, tuple[float, float]] = field(default_factory=dict)  # per costed model: EWMA rows, seconds
    # Per queue (model, length class): what a row of its batches costs as they ran, padded to the batch's longest
    # input (EWMA of that input's cost). Above the queue's mean input cost: admission reads batches at this.
    row_cost: dict[tuple[str, int], float] = field(default_factory=dict)
    _budget_logged: set[str] = field(default_factory=set)

    def set_max_batch_cost(self, value: float) -> None:
        """A new cost budget for every batch: every model's door figures read from it go stale."""
        self.max_batch_cost = value
        self.batch_s.version += 1

    def limit(self, model: str) -> int:
        """The most inputs in one batch of this model."""
        return self.model_limits.get(model, self.max_batch_size)

    def budget(self, model: str) -> float:
        """The most one batch of this model may cost (inf: no budget). Comparisons, not min(): ~10 calls per
        admitted request."""
        own = self.max_batch_cost
        lowered = self.cost_limits.get(model)
        if lowered is None:
            return own if own > 0 else math.inf
        return lowered if own <= 0 or lowered < own else own

    def shape(self, model: str) -> tuple[int, float, int]:
        """(`limit`, `budget`, `full_n`) of a model in one call: the door reads all three on every request."""
        limit = self.model_limits.get(model, self.max_batch_size)
        budget = self.budget(model)
        if budget == math.inf:
            return limit, budget, limit
        return limit, budget, max(1, min(limit, int(budget // self.unit.get(model, 1.0))))

    def full_n(self, model: str) -> int:
        """Inputs in a full batch of this model: the batch size, or fewer when its budget holds fewer of its
        mean input. Capacity (inputs per second) is this over a full batch's S."""
        budget, limit = self.budget(model), self.model_limits.get(model, self.max_batch_size)
        return limit if budget == math.inf else rows_in(limit, budget, self.unit.get(model, 1.0))

    def note_cost(self, model: str, cost: float) -> None:
        """An input of this cost was admitted: keep the model's mean input cost, and with it the cost of a full
        batch (`batch_s[model]`). A model whose inputs all cost 1 is left untouched."""
        unit = self.unit.get(model)
        if unit is None:
            if cost == 1.0 and (
                (self.max_batch_cost <= 0 and model not in self.cost_limits) or self.budget(model) == math.inf
            ):  # no budget (read without the call in the common case)
                return
            unit = cost
            self.batch_s.caps[model] = math.inf  # a costed model's batches are bounded by cost, not by count
        unit += UNIT_ALPHA * (cost - unit)
        self.unit[model] = unit
        self.batch_s.version += 1  # a full batch's inputs and cost move with the mean
        if cost > self.widest.get(model, 1.0):
            # A longer input than any before: a full batch of such inputs may not fit, so fit the budget now,
            # before that batch forms and runs (not after, when it has held the worker for seconds).
            self.widest[model] = cost
            self.fit_budget(model)
        self.batch_s.full[model] = self.full_n(model) * unit

    def estimate_cost(self, model: str, n: float, unit: float | None = None) -> float:
        """The cost of a batch of n inputs of mean cost `unit` (default: the model's), within its budget."""
        cost = n * (self.unit.get(model, 1.0) if unit is None else unit)
        budget = self.budget(model)
        if budget == math.inf:  # a count model (the common case): no budget to clamp to
            return cost
        return min(cost, max(1.0, budget))

    def fit_budget(self, model: str) -> None:
        """Lower the model's cost budget so a full batch fits within `max_batch_s` (half the longest allowed
        timeout) and, for a costed model, within `latency_fits` or `latency_fit_s` (half the latency objective with
        its slack: an input may wait for the running batch, then run in its own), so one batch of long inputs does
        not hold the worker while short inputs wait. Raised back once a larger batch fits."""
        unit = self.unit.get(model, 1.0)
        configured = self.max_batch_cost if self.max_batch_cost > 0 else math.inf
        top = min(self.limit(model) * max(unit, self.widest.get(model, 1.0)), configured)  # a batch of the longest
        times = self.batch_s
        full_s = times.at(model, top)
        hard = times.fit(model, self.max_batch_s, unit, top) if self.max_batch_s < math.inf else top
        fitted = hard
        latency_fit_s = self.latency_fits.get(model, self.latency_fit_s)
        if latency_fit_s < math.inf and model in self.unit:
            # Down to its mean input at least: when even that does not fit (a busy machine), a long input runs
            # alone, never a whole request of them in one batch.
            fitted = times.fit(model, latency_fit_s, unit, hard)
        if hard < top:
            times.forget_above(model, hard)  # a slow point above the budget would hold it down for good
        before = self.cost_limits.get(model, math.inf)
        if before < fitted:
            # Slow start: at most twice the costliest batch measured. Past the points the time is a line's guess,
            # and one cheap long-input batch can flatten it enough to promise a hundred-times-costlier batch fits.
            fitted = min(fitted, max(before, 2 * times.largest(model)))
        if fitted >= top:
            if before != math.inf:
                del self.cost_limits[model]
                log.debug("model %s: a full batch fits; its batch budget is back to %g", model, top)
        elif fitted != before:
            self.cost_limits[model] = fitted
            first = model not in self._budget_logged
            self._budget_logged.add(model)
            log.log(
                logging.WARNING if first or hard < top else logging.DEBUG,
                "model %s: a full batch would take %.0f ms: its batches are limited to cost %g (%d inputs) "
                "to fit %.0f ms",
                model,
                full_s * 1000,
                fitted,
                self.full_n(model),
                (self.max_batch_s if hard < top else latency_fit_s) * 1000,
            )
        if model in self.unit:
            self.batch_s.full[model] = self.full_n(model) * unit
        self.batch_s.version += 1  # the budget may have moved

    def too_costly(self, model: str, cost: float) -> str | None:
        """Why an input of this cost can never run (None when it can): it costs more than the configured
        --max-batch-tokens, or alone it is expected to outlast half the longest allowed timeout."""
        if 0 < self.max_batch_cost < cost:
            return (
                f"an input costs {cost:g} (tokens), more than one batch of {model} may cost "
                f"(--max-batch-tokens {self.max_batch_cost:g})"
            )
        if cost == 1.0:
            return None  # a count model's input: one input is the least a batch can be
        if self.batch_s.caps.get(model) != math.inf:  # a costed model (note_cost may not have seen one yet)
            self.batch_s.caps[model] = math.inf
            self.batch_s.version += 1
        alone_s = self.batch_s.at(model, cost)  # learned (a wrong point above the budget is forgotten: fit_budget)
        if alone_s > self.max_batch_s:
            return (
                f"an input costs {cost:g} (tokens): alone it would take about {alone_s * 1000:.0f} ms, more "
                f"than a batch may ({self.max_batch_s * 1000:.0f} ms)"
            )
        return None

    def observe(self, model: str, seconds: float, cost: float, rows: int = 0) -> None:
        """A batch of this cost (and `rows` inputs) took `seconds`: learn it, refit the model's budget, and for a
        costed model keep `served_rate`."""
        self.batch_s.observe(model, cost, seconds)
        self.fit_budget(model)
        if rows > 0 and model in self.unit:
            r, t = self.served.get(model, (float(rows), seconds))
            self.served[model] = (r + SERVED_ALPHA * (rows - r), t + SERVED_ALPHA * (seconds - t))

    def served_rate(self, model: str) -> float | None:
        """Inputs one worker served per second of batch time, lately (None: not measured; count models). Not
        `full_n` over a full batch's S, which overstates it: length classes make smaller batches, each padded to its
        longest input. At least the arrival rate while the worker keeps up; past capacity, the capacity."""
        got = self.served.get(model)
        return got[0] / got[1] if got is not None and got[1] > 0 else None

    def note_row(self, key: tuple[str, int], widest: float) -> None:
        """A batch of queue `key` was formed, its longest input costing `widest`: every row of it costs that much
        (padding), kept as `row_cost`."""
        if widest > 1.0 or key in self.row_cost:
            before = self.row_cost.get(key, widest)
            self.row_cost[key] = before + ROW_ALPHA * (widest - before)
