"""Queues and the flush policy: which items go into the next batch, and when (DESIGN §3).

Batches are formed at the moment a free worker asks for one (`next_batch`), never earlier, so a batch keeps
filling until a worker actually takes it. One worker at a time waits for "its" batch (the `_turn` lock); the
others queue behind it. The waiting worker takes a batch as soon as one of these holds:

- some queue holds a full batch (`max_batch_size` items, or the model's own lower limit: `limit(model)`);
- the oldest item's dispatch deadline arrives: `arrived + slo − expected batch time − margin`;
- pacing: `S / G` has passed since the last dispatch (S = learned batch time, G = healthy workers), so with
  G devices dispatches are staggered about S/G apart and every device runs a full-as-possible batch;

S is learned by batch size (`batch_time.BatchTimes`): deadlines and pacing use the S of the batch that would be
formed now, from the queue's length;
- the server is draining.

Cost, not count (issue 22): every item carries its cost (the backend's `cost_of`, e.g. tokens; 1 for a plugin
that declares none) and a batch's cost is rows x its longest row. S is read at the cost of the batch in
question; a batch stops filling at `--max-batch-tokens` (the cost budget) as well as at the batch size; inputs
are grouped by length through the backend's `bucket_of`, so a short input does not pay for a long batch-mate.
When a full batch would outlast half the longest allowed timeout, the model's budget is lowered to what fits
(one log line), and the points learned above it are forgotten so the budget can grow back when they were wrong;
a model whose inputs have costs also has it lowered to fit half the latency objective (`fit_budget`).

Items whose deadline passed, or whose caller left, are dropped at formation and never reach a backend.
Retried sub-batches (bisection after a failure, see `gpu_pool`) of interactive items go before new work; those
of batch-job items go after it, as background batches (a failing job must not hold the workers).
These background batches (job re-runs, and the groups of a job isolated for failing: `submit_group`) take at
most one dispatch in `BACKGROUND_EVERY + 1` while other work is due, so another tenant's clean job keeps most
of the workers, and the failing job still moves (issue 28, item 3); while interactive items wait they take
one in `BACKGROUND_FLOOR_EVERY + 1`, a floor that keeps them moving under steady interactive load.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from collections.abc import Callable

from batchserve import errors
from batchserve.core.batch_time import BatchTimes
from batchserve.core import tiers
from batchserve.core.fairqueue import FairQueue, Item, Shares
from batchserve.core.tenant_cost import CostAccount

Clock = Callable[[], float]
log = logging.getLogger("batchserve")
UNIT_ALPHA = 0.02  # weight of the newest input in a model's mean input cost (a full batch's cost is read off it)
ROW_ALPHA = 0.2  # weight of the newest batch in a length class's padded cost per row (`row_cost`)

# The learned S is a mean of measured cycles, so about half the batches end a little before it: a worker that
# asks for its next batch this close to the pace (several devices) takes it at once instead of idling.
PACE_EARLY_S = 0.002
RETRY_STEP_ASIDE_S = 0.005  # how long a worker leaves the turn to others when a retry must avoid it
BACKGROUND_EVERY = 4  # regular dispatches between two background batches while both wait (a 1/5 share)
# Even while interactive items wait, a background batch goes after this many regular dispatches: a floor, so an
# isolated job (or a job's re-runs) always moves under steady interactive load, at the cost of one dispatch in
# 51 to the interactive items then waiting (2 %: below what moves their p95).
BACKGROUND_FLOOR_EVERY = 50
SERVED_ALPHA = 0.2  # weight of the newest batch in the served-rate average (`Batcher.served_rate`)


@dataclass(eq=False)
class Batch:
    model: str
    items: list[Item]
    formed: float
    cause: str  # full | deadline | pace | drain | retry | isolated
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
        return len(self.items) * max((item.cost for item in self.items), default=1.0)


@dataclass
class Batcher:
    max_batch_size: int
    slo_s: float
    margin_s: float
    batch_s: BatchTimes  # learned batch time per model id and batch size, seeded from the backend's guess
    model_limits: dict[str, int] = field(default_factory=dict)  # per model id: a plugin's max_batch_size, if lower
    max_batch_cost: float = 0.0  # --max-batch-tokens: the cost budget of one batch (0 = none)
    max_batch_s: float = math.inf  # a full batch expected longer than this lowers the model's budget to fit
    latency_fit_s: float = math.inf  # a costed model's full batch longer than this lowers its budget (slo x slack / 2)
    cost_limits: dict[str, float] = field(default_factory=dict)  # per model: a budget lowered to fit (fit_budget)
    unit: dict[str, float] = field(default_factory=dict)  # per model: mean cost of an input (1 until one costs more)
    widest: dict[str, float] = field(default_factory=dict)  # per model: the costliest input seen
    queues: dict[tuple[str, int], FairQueue] = field(default_factory=dict)
    shares: dict[str, Shares] = field(default_factory=dict)  # per model: the tenants' cost counters (fairqueue)
    account: CostAccount = field(default_factory=CostAccount)  # cost answered per (model, tier, tenant)
    depth: dict[str, int] = field(default_factory=dict)  # queued items per model
    tier_depth: list[int] = field(default_factory=tiers.counters)  # queued items per tier rank
    retries: deque[Batch] = field(default_factory=deque)  # re-runs holding interactive items: before new work
    background_retries: deque[Batch] = field(default_factory=deque)  # re-runs of job items: after all of it
    healthy_workers: int = 1
    draining: bool = False
    closed: bool = False
    last_dispatch: float = 0.0
    served_at: dict[str, float] = field(default_factory=dict)  # per model: when a batch of it last went out
    bucket_served_at: dict[tuple[str, int], float] = field(default_factory=dict)  # the same per queue
    clock: Clock = time.monotonic  # injected in the policy's unit tests
    _budget_logged: set[str] = field(default_factory=set)
    _turn: asyncio.Lock = field(default_factory=asyncio.Lock)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _waiting: bool = False
    _since_background: int = 0  # dispatches since the last background batch
    served: dict[str, tuple[float, float]] = field(default_factory=dict)  # per costed model: EWMA rows, seconds
    # Per queue (model, length class): what a row of its batches costs as they ran, padded to the batch's longest
    # input (EWMA of that input's cost). Above the queue's mean input cost: admission reads batches at this.
    row_cost: dict[tuple[str, int], float] = field(default_factory=dict)

    # -- the handlers' side ------------------------------------------------------------------------------
    def submit(self, item: Item) -> None:
        key = (item.model, item.bucket)
        q = self.queues.get(key)
        if q is None:
            q = self._new_queue(key)
        q.push(item)
        self._count(item, +1)
        if self._waiting and (len(q) == 1 or len(q) >= self.limit(item.model)):
            self._wake.set()

    def _new_queue(self, key: tuple[str, int]) -> FairQueue:
        """A queue for a (model, length class): its tenants' counters are the model's, shared by its classes,
        so a tenant's share is counted over all its inputs, whatever their length."""
        shares = self.shares.get(key[0])
        if shares is None:
            shares = self.shares[key[0]] = Shares()
        q = self.queues[key] = FairQueue(shares)
        return q

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
            if cost == 1.0 and self.budget(model) == math.inf:
                return
            unit = cost
            self.batch_s.caps[model] = math.inf  # a costed model's batches are bounded by cost, not by count
        unit += UNIT_ALPHA * (cost - unit)
        self.unit[model] = unit
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
        objective with its slack: an input may wait for the batch running, then run in its own): one batch of
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
        if self.latency_fit_s < math.inf and model in self.unit:
            # Down to its mean input at least: when even that does not fit (a busy machine), a long input runs
            # alone, never a whole request of them in one batch.
            fitted = times.fit(model, self.latency_fit_s, unit, hard)
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
                (self.max_batch_s if hard < top else self.latency_fit_s) * 1000,
            )
        if model in self.unit:
            self.batch_s.full[model] = self.full_n(model) * unit

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
        self.batch_s.caps[model] = math.inf  # a costed model (note_cost may not have seen one yet)
        alone_s = self.batch_s.at(model, cost)  # learned (a wrong point above the budget is forgotten: fit_budget)
        if alone_s > self.max_batch_s:
            return (
                f"an input costs {cost:g} (tokens): alone it would take about {alone_s * 1000:.0f} ms, more "
                f"than a batch may ({self.max_batch_s * 1000:.0f} ms)"
            )
        return None

    def total_depth(self) -> int:
        return sum(self.depth.values())

    def ahead_of(self, tier: int, tenant: str, model: str = "", cost: float = 1.0) -> int:
        """Inputs of `model` a new input of this tier and tenant (costing `cost`) would wait behind: every higher
        tier, and its fair share of its own tier by cost (`Shares.ahead`: its own waiting inputs, and of each
        other waiting tenant as much as brings it level with this one), in inputs of the model's queued mix.
        A tenant over its share so waits longer than one under it, and under pressure is refused first.
        Without `model`: the first model with a queue (a server of one model). Costs O(1) in the queue's length."""
        if not model:
            model = next(iter(self.shares), "")
        shares = self.shares.get(model)
        depth = self.depth.get(model, 0)
        if shares is None or not depth:
            return 0
        total = sum(shares.tier_queued)
        if total <= 0:
            return 0
        ahead = shares.ahead(tier, tenant, cost)
        return min(depth, math.ceil(depth * ahead / total - 1e-9))

    def _count(self, item: Item, sign: int) -> None:
        self.depth[item.model] = self.depth.get(item.model, 0) + sign
        self.tier_depth[item.tier] += sign

    # -- the workers' side -------------------------------------------------------------------------------
    async def next_batch(self, worker: int) -> Batch | None:
        """The next batch for a free worker, once the flush policy says so; None when the server closes."""
        while not self.closed:
            async with self._turn:
                batch, step_aside = await self._wait_for_batch(worker)
            if batch is not None or not step_aside:
                return batch
            # A retry waits that should run on another worker: let the others take the turn first.
            await asyncio.sleep(RETRY_STEP_ASIDE_S)
        return None

    def take_now(self, worker: int) -> Batch | None:
        """A batch for this worker if one is due at once and no other worker is waiting for its turn: the
        fast path of a worker that just finished, taken without a trip through the event loop's queue."""
        if self.closed or self._turn.locked():
            return None
        now = self.clock()
        batch = self.take_retry(worker, now)
        if batch is not None:
            return batch
        if self._background_turn():
            batch = self.take_retry(worker, now, self.background_retries)
            if batch is not None:
                return batch
        key, due, cause = self.most_urgent(now)
        if key is not None and due <= now:
            return self.form(key, now, cause, due)
        if self.background_retries and not self.interactive_waiting():
            return self.take_retry(worker, now, self.background_retries)
        return None

    def _background_turn(self) -> bool:
        """A background batch goes before due regular work: its share is due and no interactive item waits, or
        its floor is due whatever waits (`BACKGROUND_FLOOR_EVERY`: only gaps would starve it under steady load)."""
        if not self.background_retries:
            return False
        return self._since_background >= BACKGROUND_FLOOR_EVERY or (
            self._since_background >= BACKGROUND_EVERY and not self.interactive_waiting()
        )

    async def _wait_for_batch(self, worker: int) -> tuple[Batch | None, bool]:
        while not self.closed:
            now = self.clock()
            batch = self.take_retry(worker, now)
            if batch is not None:
                return batch, False
            if self._background_turn():
                batch = self.take_retry(worker, now, self.background_retries)
                if batch is not None:
                    return batch, False
            key, due, cause = self.most_urgent(now)
            if key is not None and due <= now:
                batch = self.form(key, now, cause, due)
                if batch is not None:
                    return batch, False
                continue
            background = bool(self.background_retries) and not self.interactive_waiting()
            if background:
                batch = self.take_retry(worker, now, self.background_retries)
                if batch is not None:
                    return batch, False
            if self.retries or background:
                return None, True
            await self._sleep(None if key is None else due - now)
        return None, False

    def requeue(self, batch: Batch) -> None:
        """Run these items again as they are (a half of a failed batch): before any new work when it holds an
        interactive item, else (only batch-job items) once no interactive item waits."""
        batch.formed = self.clock()
        background = all(item.tier >= tiers.BATCH.rank for item in batch.items)
        (self.background_retries if background else self.retries).append(batch)
        self._wake.set()

    def submit_group(self, items: list[Item]) -> None:
        """Batch-job items of one job that run as a batch of their own, in the background share (their job
        fails often: in a shared batch each failure would cost the batch-mates of other jobs a re-run)."""
        self.background_retries.append(Batch(items[0].model, items, self.clock(), "isolated", isolated=True))
        self._wake.set()

    def interactive_waiting(self) -> int:
        """Interactive items queued (every tier above batch)."""
        return sum(self.tier_depth[: tiers.BATCH.rank])

    def return_items(self, items: list[Item]) -> None:
        """Put items back at the head of their queues, to ride in the next regular batch (the half of a
        failed batch found clean)."""
        now = self.clock()
        for item in reversed(items):
            if not item.alive(now):
                continue
            key = (item.model, item.bucket)
            q = self.queues.get(key)
            if q is None:
                q = self._new_queue(key)
            q.push_front(item)
            self._count(item, +1)
        self._wake.set()

    def observe_batch(self, model: str, seconds: float, cost: float, rows: int = 0) -> None:
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

    def start_drain(self) -> None:
        self.draining = True
        self._wake.set()

    def close(self) -> None:
        self.closed = True
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def freed_early(self, model: str) -> None:
        """A batch stopped early (its callers had all left), so its worker is free before the pace assumed: the
        next dispatch is due now, not a batch time after the last one."""
        interval = self.batch_s[model] / max(1, self.healthy_workers)
        self.last_dispatch = min(self.last_dispatch, self.clock() - interval)
        self._wake.set()

    def drop_all(self, err: errors.ApiError) -> int:
        """Answer every queued item with `err` (drain timeout); returns how many were answered."""
        answered = 0
        for q in self.queues.values():
            for item in q.drain_all():
                self._count(item, -1)
                if not item.future.done():
                    item.future.set_exception(err)
                    answered += 1
        for batch in (*self.retries, *self.background_retries):
            for item in batch.items:
                if not item.future.done():
                    item.future.set_exception(err)
                    answered += 1
        self.retries.clear()
        self.background_retries.clear()
        return answered

    # -- policy ------------------------------------------------------------------------------------------
    def dispatch_delay(self, model: str, size: float) -> float:
        """How long the oldest item may wait for company: the SLO less one batch (of cost `size`) and a
        margin."""
        return max(0.0, self.slo_s - self.batch_s.at(model, size) - self.margin_s)

    def most_urgent(self, now: float) -> tuple[tuple[str, int] | None, float, str]:
        best: tuple[str, int] | None = None
        best_rank = (float("inf"), float("inf"), float("inf"), float("inf"), float("inf"))
        best_cause = ""
        best_due = float("inf")
        for key, q in self.queues.items():
            for item in q.prune(lambda i: i.alive(now)):
                self._count(item, -1)
            head = q.oldest()
            if head is None:
                continue
            paced, head = self._paced_by_jobs(q, key[0], head)
            full_count = len(q) >= self.limit(key[0]) and not paced
            if full_count or (q.cost_sum >= self.budget(key[0]) and not paced):
                due, cause = now, "full"
            elif self.draining:
                due, cause = now, "drain"
            else:
                size = self.estimate_cost(key[0], min(len(q), self.limit(key[0])), q.mean_cost())  # formed now
                deadline_due = (
                    head.arrived + self.dispatch_delay(key[0], size) if head.tier < tiers.BATCH.rank else math.inf
                )  # job items only: in no hurry, they go at the pace
                pace_due = self.last_dispatch + self.batch_s.at(key[0], size) / max(1, self.healthy_workers)
                if self.healthy_workers <= 1 or pace_due - now <= PACE_EARLY_S:
                    # One device: the worker asking is the device, free now, and there is nothing to stagger
                    # (the pace S only estimated when it would free: a smaller or quicker batch frees sooner).
                    # Several: a worker that frees a hair before the learned pace goes at once.
                    pace_due = min(pace_due, now)
                due, cause = (deadline_due, "deadline") if deadline_due <= pace_due else (pace_due, "pace")
            # Among queues due now, a model served least recently goes first (then the earliest deadline), so
            # a quiet model's item waits one dispatch slot at most, not until its head outranks a busy model's.
            # Inside a model, its length classes (buckets) take turns the same way: a queue of long inputs is
            # always full by cost, and must not keep a short input waiting until its deadline.
            recency = self.served_at.get(key[0], 0.0) if due <= now and not full_count else 0.0
            # Queues due at once are shared by cost between tenants too (issue 33): one whose next tenant is
            # behind the least served waiting tenant of its tier goes before one whose next tenant is ahead (a
            # tenant of short inputs and one of long ones land in different length classes, and the short
            # ones' queue, full by count, would otherwise always go first); a lone tenant, the same tenant or
            # tenants level (lag 0) leave it to the order below.
            lag = q.lag() if due <= now else 0.0
            turn = self.bucket_served_at.get(key, 0.0) if due <= now else 0.0
            rank = (max(due, now), lag, recency, turn, q.earliest_deadline())
            if rank < best_rank:
                best, best_rank, best_cause, best_due = key, rank, cause, due
        return best, (best_due if best is not None else best_rank[0]), best_cause

    def _paced_by_jobs(self, q: FairQueue, model: str, head: Item) -> tuple[bool, Item]:
        """Whether batch-job items are what makes this queue due at once (full by count or cost, or an old
        job item's deadline), and the head whose deadline counts. With several workers such a queue goes at
        the pace instead: job items fill batches but never hurry them. Taking every job-filled batch the moment
        a worker frees lets the workers fall into step (both free, both take, both run), and an interactive
        item then waits for the next of them up to a whole batch time instead of half of it (issue 28: a clean
        job beside interactive load at half the capacity moved that p95 from 150 to 196 ms)."""
        if self.healthy_workers <= 1 or self.draining:
            return False, head
        jobs, jobs_cost = 0, 0.0
        first: Item | None = None
        for lane in q.lanes.values():
            if not lane.items:
                continue
            if lane.tier >= tiers.BATCH.rank:
                jobs += len(lane.items)
                jobs_cost += sum(item.cost for item in lane.items)
            elif first is None or lane.items[0].arrived < first.arrived:
                first = lane.items[0]
        if not jobs or len(q) - jobs >= self.limit(model) or q.cost_sum - jobs_cost >= self.budget(model):
            return False, head  # no job items, or the interactive ones fill a batch by themselves
        return True, first if first is not None else head

    def form(self, key: tuple[str, int], now: float, cause: str, due: float = 0.0) -> Batch | None:
        q = self.queues[key]
        items: list[Item] = []
        limit = self.limit(key[0])
        # An item whose deadline falls before a batch formed now would end is answered 504 here, not sent: its
        # answer would come too late, and its place goes to an item that can still make it (under overload,
        # batches of items that expire while they run would serve nobody: goodput would collapse). The batch's
        # least expected time (`lower_bound`), so that a time learned from one slow batch cannot drop every item
        # and leave nothing running to correct it.
        budget = self.budget(key[0])
        ends = now + self.batch_s.lower_bound(key[0], self.estimate_cost(key[0], min(limit, len(q)), q.mean_cost()))
        widest = 0.0
        # Job places go to one tenant per batch (tenants take turns batch by batch), so one tenant's failing
        # job inputs never fail, and drag into bisection, another tenant's job items.
        stick: dict[int, str] = {}
        while len(items) < limit:
            # The budget: rows x the longest row. The first input always goes (one alone over the budget was
            # refused at the door, or the budget was lowered after it was admitted: it still runs).
            # A backend's own batch cost is asked only when it declares one and a budget applies. Without a
            # budget the head is taken without a peek first (each looks for the lane whose turn it is).
            if items and budget != math.inf:
                head = q.peek(stick)
                if head is None:
                    break
                if (
                    head.batch_cost([*(i.text for i in items), head.text]) > budget
                    if head.batch_cost is not None
                    else (len(items) + 1) * max(widest, head.cost) > budget
                ):
                    break
            item = q.pop(stick, charge=False)
            if item is None:
                break
            if item.tier == tiers.BATCH.rank and not stick:
                stick[item.tier] = item.tenant
            self._count(item, -1)
            if not item.alive(now):
                continue
            if item.deadline < ends and not item.probe:
                item.future.set_exception(
                    errors.deadline_exceeded("the request's deadline would pass before its batch could end")
                )
                continue
            items.append(item)
            q.charge(item)  # its tenant's share: counted as it is taken, so the next place goes to the least served
            widest = max(widest, item.cost)
        if not items:
            return None
        for item in items:
            item.dispatched = now
            if item.record is not None:
                item.record.status = "processing"
        q.shares.owed_cap = budget if budget != math.inf else limit * widest  # a batch's cost, at most
        # A paced dispatch a little late (timer granularity, a busy loop) keeps its slot, so lateness does not
        # pile up into wider spacing than S/G; a late one by half an interval or more starts a new rhythm.
        batch = Batch(key[0], items, now, cause)
        if widest > 1.0 or key in self.row_cost:  # padded: every row costs the longest input's cost
            before = self.row_cost.get(key, widest)
            self.row_cost[key] = before + ROW_ALPHA * (widest - before)
        interval = self.batch_s.at(key[0], batch.cost) / max(1, self.healthy_workers)
        self.last_dispatch = due if cause == "pace" and now - due < interval / 2 else now
        self.served_at[key[0]] = now
        self._since_background += 1
        self.bucket_served_at[key] = now
        return batch

    def take_retry(self, worker: int, now: float, retries: deque[Batch] | None = None) -> Batch | None:
        """The oldest retry batch this worker may run (of `retries`, by default the interactive ones): one
        that failed on it goes to another healthy worker, unless none has taken it within two batch times
        (any busy worker is free by then)."""
        retries = self.retries if retries is None else retries
        for batch in list(retries):
            batch.items = [i for i in batch.items if i.alive(now)]
            if not batch.items:
                retries.remove(batch)
                continue
            if (
                batch.avoid_worker == worker
                and self.healthy_workers > 1
                and now - batch.formed < 2 * self.batch_s.at(batch.model, batch.cost)
            ):
                continue
            retries.remove(batch)
            batch.formed = now
            for item in batch.items:
                item.dispatched = now
            self.last_dispatch = now
            if retries is self.background_retries:
                self._since_background = 0
            else:
                self._since_background += 1
            return batch
        return None

    async def _sleep(self, timeout: float | None) -> None:
        self._wake.clear()
        handle = asyncio.get_running_loop().call_later(timeout, self._wake.set) if timeout is not None else None
        self._waiting = True
        try:
            await self._wake.wait()
        finally:
            self._waiting = False
            if handle is not None:
                handle.cancel()
