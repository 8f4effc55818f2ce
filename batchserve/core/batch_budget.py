"""A batch's size and cost per model: how many inputs and how much cost one batch may hold, the mean cost of an
input, and the budget lowered so a full batch fits its time bounds (issue 22; split out of the batcher, issue 35
item 5).

Cost, not count: every input carries its cost (the backend's `cost_of`, e.g. tokens; 1 for a plugin that
declares none) and a batch's cost is rows x its longest row. A batch stops filling at `--max-batch-tokens` (the
cost budget) as well as at the batch size (`limit`: the model's own lower limit when it has one). When a full
batch would outlast half the longest allowed timeout, the model's budget is lowered to what fits (one log
line), and the points learned above it are forgotten so the budget can grow back when they were wrong; a model
whose inputs have costs also has it lowered to fit half the latency objective (`fit_budget`).

This is the arithmetic the batcher forms batches by and the door predicts with; it holds no queue and no clock
(the learned batch times are `batch_time.BatchTimes`, shared with the batcher), so its unit tests drive it with
numbers alone. A model whose inputs all cost 1 (the sim, a plugin without `cost_of`) never reaches the costed
branches: its budget is infinite and a full batch is its batch size.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from batchserve.core.batch_time import BatchTimes

log = logging.getLogger("batchserve")
UNIT_ALPHA = 0.02  # weight of the newest input in a model's mean input cost (a full batch's cost is read off it)
ROW_ALPHA = 0.2  # weight of the newest batch in a length class's padded cost per row (`row_cost`)
SERVED_ALPHA = 0.2  # weight of the newest batch in the served-rate average (`served_rate`)


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
        """The most one batch of this model may cost (inf: no budget). Called ~10 times per admitted request:
        a comparison rather than min() and two infinities."""
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
        budget, limit = self.budget(model), self.limit(model)
        if budget == math.inf:
            return limit
        return max(1, min(limit, int(budget // self.unit.get(model, 1.0))))

    def note_cost(self, model: str, cost: float) -> None:
        """An input of this cost was admitted: keep the model's mean input cost, and with it the cost of a full
        batch (`batch_s[model]`). A model whose inputs all cost 1 is left exactly as before."""
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
        """Lower the model's cost budget so a full batch fits: within `max_batch_s` (half the longest allowed
        timeout) always, and, for a model whose inputs have costs (tokens), within `latency_fit_s` (half the latency
        objective with its slack, the model's own: `latency_fits`; an input may wait for the batch running, then run
        in its own): one batch of
        long inputs must not hold the worker for seconds while other callers' short inputs wait behind it. The
        price on a CPU, where a batch has a large fixed part: fewer inputs a second than batches of 64 would
        serve (bench/cost_bench.py measures it). Raised back toward the configured budget once a
        larger batch fits. One log line the first time a model's budget is lowered (later moves: debug)."""
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
            # A lowered budget rises by at most twice the costliest batch measured (slow start). Past the points
            # the time is a line's guess, and one cheap long-input batch can flatten that line enough to promise
            # that a batch a hundred times costlier fits: it then held the only worker for seconds (the soak's
            # first request of 60 long inputs: 4.3 s, the worker marked hung). Each batch that fits lets the next
            # be twice as costly.
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
        """A batch of this cost (and `rows` inputs) took `seconds`: learn it, and keep the model's budget within
        max_batch_s. For a model whose inputs have costs, also the inputs a worker served per second of batch
        time (`served_rate`)."""
        self.batch_s.observe(model, cost, seconds)
        self.fit_budget(model)
        if rows > 0 and model in self.unit:
            r, t = self.served.get(model, (float(rows), seconds))
            self.served[model] = (r + SERVED_ALPHA * (rows - r), t + SERVED_ALPHA * (seconds - t))

    def served_rate(self, model: str) -> float | None:
        """Inputs one worker served per second of batch time, lately (None: not measured; count models). A
        costed model's full batch (`full_n` at S of a full batch) overstates it: its length classes make
        smaller batches, each padded to its longest input. When the worker keeps up, this is at least the
        arrival rate; past capacity, it is the capacity."""
        got = self.served.get(model)
        return got[0] / got[1] if got is not None and got[1] > 0 else None

    def note_row(self, key: tuple[str, int], widest: float) -> None:
        """A batch of queue `key` (model, length class) was formed, its longest input costing `widest`: every row
        of it costs that much (padding), kept per queue as `row_cost`. Nothing for a queue of inputs costing 1."""
        if widest > 1.0 or key in self.row_cost:
            before = self.row_cost.get(key, widest)
            self.row_cost[key] = before + ROW_ALPHA * (widest - before)
