"""Queues and the flush policy: which items go into the next batch, and when (docs/contract.md#batching).

Batches are formed when a free worker asks for one (`next_batch`), never earlier, so a batch keeps filling until a
worker takes it. One worker at a time waits for "its" batch (the `_turn` lock); the others queue behind it. It takes
a batch as soon as one of these holds:

- some queue holds a full batch (`limit(model)` items, or the model's cost budget);
- the oldest item's dispatch deadline arrives: `arrived + slo − expected batch time − margin`;
- pacing: `S / G` has passed since the last dispatch (S = learned batch time, G = healthy workers), so G devices
  are dispatched about S/G apart and each runs a full-as-possible batch ... unless the load is high and a larger
  batch, soon, would cost its inputs much less: then the worker waits for it, within half the SLO
  (`core/batch_hold.py`; the batch's cause is "hold");
- the server is draining.

S is read at the cost of the batch that would be formed now (`core/batch.BatchTimes`); inputs are grouped by length
(`bucket_of`) so a short input does not pay for a long batch-mate; what one batch may hold and cost is `costs`'s.

Every pass of the policy is one ladder (`_take`), for a worker that just finished (`take_now`, no trip through
the loop) and for the worker holding the turn (`_wait_for_batch`).

Items whose deadline passed or whose caller left are dropped at formation (`FairQueue.take_batch`). Re-runs come
first (`core/retries.py`). Which job inputs to feed, and how many, is `jobs/refill.py`'s; the batcher only paces them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from batchserve import errors
from batchserve.core.batch import Batch, BatchBudget, BatchTimes
from batchserve.core.batch_hold import Holds, Bursts
from batchserve.core import tiers
from batchserve.core.fairqueue import FairQueue, Item, Shares
from batchserve.core.retries import Retries
from batchserve.core.ledger import CostAccount
from batchserve.slo import Deadlines

Clock = Callable[[], float]
log = logging.getLogger("batchserve")

# The learned S is a mean of measured cycles, so about half the batches end a little before it: a worker that
# asks for its next batch this close to the pace (several devices) takes it at once instead of idling.
PACE_EARLY_S = 0.002
RETRY_STEP_ASIDE_S = 0.005  # how long a worker leaves the turn to others when a retry must avoid it


class Batcher:
    """The queues of every model and the flush policy over them (module docstring)."""

    def __init__(
        self,
        max_batch_size: int,
        slo_s: float,
        margin_s: float,
        batch_s: BatchTimes,  # learned batch time per model id and batch size, seeded from the backend's guess
        model_limits: dict[str, int] | None = None,  # per model id: a plugin's max_batch_size, if lower
        max_batch_cost: float = 0.0,  # --max-batch-tokens: the cost budget of one batch (0 = none)
        max_batch_s: float = math.inf,  # a full batch expected longer than this lowers the model's budget to fit
        latency_fit_s: float = math.inf,  # a costed model's full batch longer than this lowers its budget
        healthy_workers: int = 1,
        clock: Clock = time.monotonic,  # injected in the policy's unit tests
    ) -> None:
        self.max_batch_size = max_batch_size
        self.slo_s = slo_s  # the SLO of a model without figures of its own in `deadlines`
        # Each model's own SLO and timeouts (the runtime shares `ModelRegistry.deadlines`): `slo_of`.
        self.deadlines: dict[str, Deadlines] = {}
        self.margin_s = margin_s
        self.batch_s = batch_s
        self.clock = clock
        self.costs = BatchBudget(
            max_batch_size,
            batch_s,
            {} if model_limits is None else model_limits,
            max_batch_cost,
            max_batch_s,
            latency_fit_s,
        )
        self.queues: dict[tuple[str, int], FairQueue] = {}
        self.shares: dict[str, Shares] = {}  # per model: the tenants' cost counters (fairqueue)
        self.account = CostAccount()  # cost answered per (model, tier, tenant)
        self.depth: dict[str, int] = {}  # queued items per model
        self.tier_depth = [0] * len(tiers.TIERS)  # queued items per tier rank
        self.retries = Retries()
        # Pacing: when batches went out, per model and per queue.
        self.healthy_workers = healthy_workers
        self.last_dispatch = 0.0
        self.served_at: dict[str, float] = {}  # per model: when a batch of it last went out
        self.bucket_served_at: dict[tuple[str, int], float] = {}  # the same per queue
        # Holding a free worker's batch while the load is high (`core/batch_hold.py`): arrivals and holds.
        self.holds = Holds(self.costs, batch_s)
        self.bursts: dict[str, Bursts] = {}  # per model: whether its inputs arrive in bursts (`core/batch_hold.py`)
        # The workers' side: one waits for its batch at a time (`_turn`), woken by new work or a timer.
        self.draining = False
        self.closed = False
        self._turn = asyncio.Lock()
        self._wake = asyncio.Event()
        self._waiting = False
        # Staging (`Staging.stage`), kept up to date by the pool: an item arriving from `stage_after` on (inf: no
        # busy worker is near its end) asks the pool to put a full batch into that worker's inbox ...
        self.stage_after = math.inf
        self.on_stage: Callable[[], None] = lambda: None
        # ... and while a busy worker has no staging timer yet, an arrival that fills its queue asks it to arm one.
        self.stage_when_full = False

    # -- the handlers' side ------------------------------------------------------------------------------
    def submit(self, item: Item) -> None:
        key = (item.model, item.bucket)
        q = self.queues.get(key)
        if q is None:
            q = self._new_queue(key)
        q.push(item)
        self.depth[item.model] = self.depth.get(item.model, 0) + 1  # `_count(item, +1)`, once per request: inline
        self.tier_depth[item.tier] += 1
        bursts = self.bursts.get(item.model)
        if bursts is None:
            bursts = self.bursts[item.model] = Bursts()
        bursts.arrived(item.arrived)
        if self._waiting and (len(q) == 1 or len(q) >= self.costs.limit(item.model)):
            self._wake.set()
        if item.arrived >= self.stage_after:  # within the lead of a busy worker's end: stage a full batch for it
            self.on_stage()
        elif self.stage_when_full and (
            len(q) >= self.costs.limit(item.model) or q.cost_sum >= self.costs.budget(item.model)
        ):  # a full batch waits now: the pool arms a busy worker's staging timer
            self.on_stage()

    def _new_queue(self, key: tuple[str, int]) -> FairQueue:
        """A queue for a (model, length class): its tenants' counters are the model's, shared by its classes,
        so a tenant's share is counted over all its inputs, whatever their length."""
        shares = self.shares.setdefault(key[0], Shares())  # a new queue is rare: the spare Shares() costs nothing
        q = self.queues[key] = FairQueue(shares, aging=tiers.aging_for(self.slo_of(key[0])))
        return q

    def deadlines_changed(self) -> None:
        """A model's SLO was derived (`Runtime.derive_deadlines`): its queues' head starts follow it."""
        for (model, _), q in self.queues.items():
            q.aging = tiers.aging_for(self.slo_of(model))

    def total_depth(self) -> int:
        return sum(self.depth.values())

    def ahead_of(self, tier: int, tenant: str, model: str = "", cost: float = 1.0) -> int:
        """Inputs of `model` (in its queued mix) a new input of this tier and tenant, costing `cost`, would wait
        behind: every higher tier, and its fair share of its own tier by cost (`Shares.ahead`), so a tenant over its
        share waits longer and under pressure is refused first. Without `model`: the first model with a queue. O(1)."""
        if not model:
            model = next(iter(self.shares), "")
        shares = self.shares.get(model)
        return 0 if shares is None else shares.inputs_ahead(self.depth.get(model, 0), tier, tenant, cost)

    def _count(self, item: Item, sign: int) -> None:
        self.depth[item.model] = self.depth.get(item.model, 0) + sign
        self.tier_depth[item.tier] += sign

    def _uncount(self, model: str, taken: list[int]) -> None:
        """`_count(item, -1)` for a batch's worth of the model's items at once: `taken[tier]` of each tier."""
        self.depth[model] = self.depth.get(model, 0) - sum(taken)
        depth = self.tier_depth
        for tier, n in enumerate(taken):
            if n:
                depth[tier] -= n

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
        return self._take(worker, self.clock())[0]

    def take_full(self, worker: int, starts: float) -> Batch | None:
        """A full batch for a busy worker to begin the moment its batch ends (`starts`, expected), staged in its
        inbox (`Staging.stage`). None unless the most urgent queue is due because it is full, no retry waits (they
        go to a worker as it frees) and no other worker waits for its turn (an idle one takes the batch now)."""
        if self.closed or self._turn.locked() or self.retries.interactive or self.retries.background:
            return None
        if not self.full_waiting():  # asked by each arrival near a batch's end: no pass of the flush policy
            return None
        now = self.clock()
        key, due, cause = self.most_urgent(now)
        if key is None or cause != "full" or due > now:
            return None
        return self.form(key, now, cause, due, starts)

    def full_waiting(self) -> bool:
        """Whether some queue holds a full batch (by count or by cost): a cheap look, no pass of the policy."""
        costs = self.costs
        return any(len(q) >= costs.limit(m) or q.cost_sum >= costs.budget(m) for (m, _), q in self.queues.items())

    def _take(self, worker: int, now: float) -> tuple[Batch | None, str, float]:
        """The flush policy's one pass: interactive retry, due background share, most urgent due queue, background
        while no interactive item waits. Returns the batch, or None with what the waiting worker does next: "again"
        (the due queue held only items that could not run), "aside" (retries wait that this worker must leave to
        another), or "sleep" until the returned time (inf: nothing queued)."""
        retries = self.retries
        batch = self.take_retry(worker, now, background=False)
        if batch is not None:
            return batch, "", now
        if retries.background_turn(self.interactive_waiting()):
            batch = self.take_retry(worker, now, background=True)
            if batch is not None:
                return batch, "", now
        key, due, cause = self.most_urgent(now)
        if key is not None and due <= now:
            batch = self.form(key, now, cause, due)
            return batch, "" if batch is not None else "again", now
        background = bool(retries.background) and not self.interactive_waiting()
        if background:
            batch = self.take_retry(worker, now, background=True)
            if batch is not None:
                return batch, "", now
        if retries.interactive or background:
            return None, "aside", now
        return None, "sleep", due if key is not None else math.inf

    async def _wait_for_batch(self, worker: int) -> tuple[Batch | None, bool]:
        """The batch for the worker holding the turn, once one is due (`_take`); (None, True) when it must step
        aside for a retry meant for another worker, (None, False) when the server closes."""
        while not self.closed:
            now = self.clock()
            batch, then, due = self._take(worker, now)
            if batch is not None:
                return batch, False
            if then == "aside":
                return None, True
            if then == "sleep":
                await self._sleep(None if due == math.inf else due - now)
        return None, False

    def requeue(self, batch: Batch) -> None:
        """Run these items again as they are (a half of a failed batch): `Retries.requeue`."""
        self.retries.requeue(batch, self.clock())
        self._wake.set()

    def submit_group(self, items: list[Item]) -> None:
        """Batch-job items of one failing job, run as a batch of their own in the background share."""
        self.retries.isolate(items, self.clock())
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
            for item in q.prune(lambda item: False):  # every item, dropped
                self._count(item, -1)
                if not item.future.done():
                    item.future.set_exception(err)
                    answered += 1
        return answered + self.retries.drop_all(err)

    # -- policy ------------------------------------------------------------------------------------------
    def slo_of(self, model: str) -> float:
        """The model's own SLO, or the server's for a model without figures of its own."""
        d = self.deadlines.get(model)
        return self.slo_s if d is None else d.slo_s

    def dispatch_delay(self, model: str, size: float) -> float:
        """How long the oldest item may wait for company: the model's SLO less one batch of cost `size` and a margin."""
        return max(0.0, self.slo_of(model) - self.batch_s.at(model, size) - self.margin_s)

    def most_urgent(self, now: float) -> tuple[tuple[str, int] | None, float, str]:
        best: tuple[str, int] | None = None
        best_rank, best_cause, best_due = (math.inf,) * 5, "", math.inf
        for key, q in self.queues.items():
            for item in q.prune(lambda i: i.alive(now)):
                self._count(item, -1)
            head = q.oldest()
            if head is None:
                continue
            paced = False
            if self.healthy_workers > 1 and not self.draining:  # one worker: nothing to keep staggered
                paced, head = q.paced_by_jobs(self.costs.limit(key[0]), self.costs.budget(key[0]), head)
            full_count = len(q) >= self.costs.limit(key[0]) and not paced
            if full_count or (q.cost_sum >= self.costs.budget(key[0]) and not paced):
                due, cause = now, "full"
            elif self.draining:
                due, cause = now, "drain"
            else:
                costs = self.costs
                size = costs.estimate_cost(key[0], min(len(q), costs.limit(key[0])), q.mean_cost())  # formed now
                deadline_due = (
                    head.arrived + self.dispatch_delay(key[0], size) if head.tier < tiers.BATCH.rank else math.inf
                )  # job items only: in no hurry, they go at the pace
                pace_due, pace_cause = self._pace(key, q, head.arrived, size, now)
                due, cause = (deadline_due, "deadline") if deadline_due <= pace_due else (pace_due, pace_cause)
            # Among queues due now, the model served least recently goes first, so a quiet model's item waits one
            # dispatch slot at most; a model's length classes take turns the same way (a queue of long inputs, always
            # full by cost, must not hold a short input to its deadline). A queue holding for the rest of a burst
            # ranks as due now (a few ms), so the worker waits for it rather than serve a queue behind it first.
            at = now if cause == "burst" else due
            recency = self.served_at.get(key[0], 0.0) if at <= now and not full_count else 0.0
            # Then by cost between tenants: a queue whose next tenant is behind its tier's least served waiting
            # tenant goes first (else the short inputs' queue, full by count, would always beat the long ones');
            # lag 0 leaves it to the order below.
            lag = q.lag() if at <= now else 0.0
            turn = self.bucket_served_at.get(key, 0.0) if at <= now else 0.0
            rank = (max(at, now), lag, recency, turn, q.earliest_deadline())
            if rank < best_rank:
                best, best_rank, best_cause, best_due = key, rank, cause, due
        return best, (best_due if best is not None else best_rank[0]), best_cause

    def _pace(self, key: tuple[str, int], q: FairQueue, oldest: float, size: float, now: float) -> tuple[float, str]:
        """When queue `key` (not full; its oldest item arrived at `oldest`, its batch would cost `size`) is due by
        pacing, and why: the pace, the rest of a burst, or a hold."""
        pace_due = self.last_dispatch + self.batch_s.at(key[0], size) / max(1, self.healthy_workers)
        if not (self.healthy_workers <= 1 or pace_due - now <= PACE_EARLY_S):
            return pace_due, "pace"
        # One device: the worker asking is the device, free now, with nothing to stagger (the pace only estimated
        # when it would free). Several: a worker that frees a hair before the learned pace goes at once ...
        pace_due = min(pace_due, now)
        # ... unless the inputs come in bursts and the rest of this one is still arriving (`core/batch_hold.py`):
        # it waits a few ms for them, so the burst rides one batch ...
        bursts = self.bursts.get(key[0])
        burst_due = bursts.until(oldest, self.batch_s.at(key[0], size)) if bursts else -math.inf
        if burst_due > now:
            return burst_due, "burst"
        # ... or the load is high and a larger batch, soon, would cost its inputs much less: it waits for that.
        depth, slo_s = self.depth.get(key[0], 0), self.slo_of(key[0])
        held = self.holds.until(key, q, oldest, now, depth, self.healthy_workers, slo_s)
        return (held, "hold") if held > now else (pace_due, "pace")

    def form(
        self, key: tuple[str, int], now: float, cause: str, due: float = 0.0, starts: float | None = None
    ) -> Batch | None:
        """The batch of queue `key`, formed now to start at `starts` (now when None; later when staged)."""
        q = self.queues[key]
        self.holds.count(key, now, len(q))
        limit, budget = self.costs.limit(key[0]), self.costs.budget(key[0])
        # Its items must be able to end in time by the batch's least expected time (`lower_bound`): a time learned
        # from one slow batch must not drop every item and leave nothing running to correct it.
        size = self.costs.estimate_cost(key[0], min(limit, len(q)), q.mean_cost())
        ends = (now if starts is None else starts) + self.batch_s.lower_bound(key[0], size)
        taken = [0] * len(self.tier_depth)  # items taken out of the queue, per tier: counted once after the loop
        items, widest = q.take_batch(limit, budget, now, ends, taken)
        self._uncount(key[0], taken)
        self.holds.left_after(key, len(q))
        if not items:
            return None
        q.shares.owed_cap = budget if budget != math.inf else limit * widest  # a batch's cost, at most
        cause = self.holds.ended(key, cause)
        # A paced dispatch a little late (timer granularity, a busy loop) keeps its slot, so lateness does not
        # pile up into wider spacing than S/G; a late one by half an interval or more starts a new rhythm.
        batch = Batch(key[0], items, now, cause)
        self.costs.note_row(key, widest)  # padded: every row costs the longest input's cost
        cost = len(items) * widest if items[0].batch_cost is None else batch.cost  # `Batch.cost`, its max known
        interval = self.batch_s.at(key[0], cost) / max(1, self.healthy_workers)
        self.last_dispatch = due if cause == "pace" and now - due < interval / 2 else now
        self.served_at[key[0]] = now
        self.retries.since_background += 1
        self.bucket_served_at[key] = now
        return batch

    def take_retry(self, worker: int, now: float, background: bool = False) -> Batch | None:
        """The oldest re-run this worker may run (`Retries.take`), dispatched now."""
        batch = self.retries.take(worker, now, background, self.healthy_workers, self.batch_s)
        if batch is not None:
            self.last_dispatch = now
        return batch

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
