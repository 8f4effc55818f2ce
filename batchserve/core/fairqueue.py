"""One model's waiting items, ordered by tier with aging, and shared between the tenants of a tier by cost.

A batch is filled by repeatedly taking the lane head with the smallest `arrived + aging[tier]` (each tier's head
start, `tiers.aging_for` the model's SLO): a higher tier goes first, but a lower tier's item that has waited longer
than the gap between the two tiers' offsets overtakes, so no tier waits forever.

Inside a tier, backlogged tenants receive equal shares of COST served, not one item a turn: a virtual-token counter
per (tier, tenant) (`Shares`, shared by the model's length-class queues) grows by each input's cost as it is taken
into a batch (1 per input for a plugin without costs: plain round-robin), and the tier offers the head of the tenant
whose counter is least. A tenant that starts waiting is lifted to the least counter of those waiting, so its idle
time earns it no burst, as in the Virtual Token Counter (Sheng et al., OSDI '24) and start-time fair queuing. The
batch-job tier sticks to the tenant it started a batch with (`pop(stick=...)`), tenants taking turns batch by batch,
so one tenant's failing inputs never fail the batches of another tenant's job.

Lanes are found through a heap per tier whose entries may be stale (a counter only grows, so a stale entry is too
low and is re-keyed when it reaches the top): a pop costs O(log tenants), never a walk of the queue.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from collections.abc import Callable

import msgspec

from batchserve import errors
from batchserve.core.ledger import Record
from batchserve.core import tiers
from batchserve.core.tiers import AGING_S, TIERS
from batchserve.core.work import Work

LATE_FOR_BATCH = "the request's deadline would pass before its batch could end"  # an item dropped by `take_batch`


class ItemResult(msgspec.Struct, gc=False):
    """A caller's answer: its output and how long it waited and ran. A Struct: one is built per answer, in C,
    untracked by the collector (it holds no container of its own that could close a cycle)."""

    output: object  # the JSON value the backend returned for this input
    queue_s: float
    compute_s: float
    batch_size: int


class Item(msgspec.Struct, eq=False):
    """One caller's input on its way through a batch; `future` carries its answer back. A Struct (mutable,
    compared by identity): one is built per request, in C, ~0.6 µs less than a dataclass."""

    text: str
    model: str
    bucket: int
    future: asyncio.Future
    arrived: float  # time.monotonic()
    deadline: float  # time.monotonic()
    record: Record | None = None  # the request's status, updated as the item moves
    tier: int = 1  # a tiers.Tier rank
    tenant: str = ""
    dispatched: float = 0.0
    attempts: int = 0  # failed single-item runs, for the one transient retry
    gone: Callable[[], bool] | None = None  # True once the caller's connection is closed
    trace: object = None  # the request's span context, when tracing is on (batchserve/tracing.py)
    batch_trace: object = None  # the span context of the batch that answered it, when tracing is on
    cost: float = 1.0  # what the backend says this input costs (its tokens; 1 when it says nothing)
    probe: bool = False  # admitted to correct a batch time that refused everything: runs even if it is late
    # The backend's `cost_of_batch(texts)` when it declares one (None: rows x the longest row). Carried by the
    # item, so every batch made of it (formed, halved, retried, isolated) is costed the same way.
    batch_cost: Callable[[list[str]], float] | None = None

    @classmethod
    def of(
        cls,
        work: Work,
        text: str,
        bucket: int,
        future: asyncio.Future,
        record: Record | None,
        cost: float,
        probe: bool,
        batch_cost: Callable[[list[str]], float] | None,
        trace: object = None,
    ) -> Item:
        """One input of a request: what the batcher's loop reads, copied from the request's `Work` (every field
        in order, positionally: keywords cost ~0.4 µs more per request; mypy checks the order)."""
        return cls(
            text,
            work.model,
            bucket,
            future,
            work.arrived,
            work.deadline,
            record,
            work.tier,
            work.tenant,
            0.0,
            0,
            work.gone,
            trace,
            None,
            cost,
            probe,
            batch_cost,
        )

    def alive(self, now: float) -> bool:
        """False once the caller has an answer or left; answers 504 when the deadline has passed."""
        if self.future.done():
            return False
        if now >= self.deadline:
            self.future.set_exception(errors.deadline_exceeded())
            return False
        if self.gone is not None and self.gone():
            self.future.set_exception(errors.ClientGone())
            return False
        return True


Key = tuple[int, str]  # (tier rank, tenant)
Entry = tuple[float, int, str]  # (counter when listed, order listed, tenant): a lazy heap entry


def _tier_lists() -> list[float]:
    return [0.0] * len(TIERS)


@dataclass
class Shares:
    """One model's account, over its length-class queues, of what each (tier, tenant) was served in virtual cost
    and has waiting: the fair queue picks by it, the door predicts a new request's wait from it (`ahead`)."""

    counter: dict[Key, float] = field(default_factory=dict)  # virtual cost served (lifted when it starts waiting)
    vtime: list[float] = field(default_factory=_tier_lists)  # per tier: the counter of the last input served
    depth: dict[Key, int] = field(default_factory=dict)  # inputs waiting, per (tier, tenant)
    queued: dict[Key, float] = field(default_factory=dict)  # their summed cost
    tier_queued: list[float] = field(default_factory=_tier_lists)  # summed cost waiting, per tier
    active: list[int] = field(default_factory=lambda: [0] * len(TIERS))  # tenants with inputs waiting, per tier
    behind: dict[Key, float] = field(default_factory=dict)  # per tenant that stopped waiting: the least counter then
    owed_cap: float = 0.0  # the most a tenant may be owed when it starts waiting again: a batch's cost (the batcher's)
    _waiting: list[list[Entry]] = field(default_factory=lambda: [[] for _ in TIERS])  # lazy heaps of waiting tenants
    _listed: set[Key] = field(default_factory=set)  # tenants with an entry in their tier's heap
    _order: itertools.count = field(default_factory=itertools.count)

    def joined(self, item: Item) -> None:
        """An input starts waiting. The tenant's first lifts its counter to the least of those waiting (no
        credit for the time it was idle), less what it was still owed when it last stopped waiting."""
        key = (item.tier, item.tenant)
        before = self.depth.get(key, 0)
        if before:  # the common case: it is waiting already
            self.depth[key] = before + 1
            self.queued[key] += item.cost
            self.tier_queued[item.tier] += item.cost
            return
        floor = self.least(item.tier)
        behind = self.behind.pop(key, None)
        if behind is not None:  # at most one batch's cost: a client that never keeps a batch's worth
            floor -= min(self.owed_cap, max(0.0, behind - self.counter[key]))  # waiting is not backlogged
        if self.counter.get(key, -1.0) < floor:
            self.counter[key] = floor
        self.active[item.tier] += 1
        if key not in self._listed:
            self._listed.add(key)
            heapq.heappush(self._waiting[item.tier], (self.counter[key], next(self._order), item.tenant))
        self.depth[key] = 1
        self.queued[key] = item.cost
        self.tier_queued[item.tier] += item.cost

    def left(self, item: Item, served: bool = False) -> None:
        """An input stops waiting (taken into a batch, or dropped); `served`: and is charged (`charge`)."""
        key = (item.tier, item.tenant)
        if served:
            self.charge(item)
        after = self.depth[key] - 1
        if after:
            self.depth[key] = after
            self.queued[key] -= item.cost
        else:  # no float drift left behind; its heap entry goes when it reaches the top
            del self.depth[key], self.queued[key]
            self.active[item.tier] -= 1
            # Keep what it is still owed: a closed-loop client's queue empties each time its last inputs are taken,
            # and lifting away the deficit it earned waiting would hand the tenant of costlier batches the next
            # turn every time. Only the time it then spends idle earns nothing.
            if self.active[item.tier]:
                self.behind[key] = self.least(item.tier)
        self.tier_queued[item.tier] = self.tier_queued[item.tier] - item.cost if self.active[item.tier] else 0.0

    def left_run(self, tier: int, tenant: str, run: list[Item]) -> None:
        """`left(item)` for each of `run` (one tenant of one tier), the same float steps in order, in one call."""
        key = (tier, tenant)
        after = self.depth[key] - len(run)
        tier_queued = self.tier_queued[tier]
        if after:
            queued = self.queued[key]
            for item in run:
                queued -= item.cost
                tier_queued -= item.cost
            self.depth[key], self.queued[key], self.tier_queued[tier] = after, queued, tier_queued
            return
        for item in run[:-1]:  # the tenant's last inputs: the last one closes its account as `left` does
            tier_queued -= item.cost
        del self.depth[key], self.queued[key]
        self.active[tier] -= 1
        if self.active[tier]:
            self.behind[key] = self.least(tier)
        self.tier_queued[tier] = tier_queued - run[-1].cost if self.active[tier] else 0.0

    def charge_run(self, tier: int, tenant: str, run: list[Item]) -> None:
        """`charge(item)` for each of `run` in order, all of one tenant of one tier."""
        key = (tier, tenant)
        counter, vtime = self.counter.get(key, 0.0), self.vtime[tier]
        for item in run:
            if counter > vtime:
                vtime = counter
            counter += item.cost
        self.counter[key], self.vtime[tier] = counter, vtime

    def charge(self, item: Item) -> None:
        """The input is served: its tenant's counter grows by its cost."""
        key = (item.tier, item.tenant)
        start = self.counter.get(key, 0.0)
        self.counter[key] = start + item.cost
        if start > self.vtime[item.tier]:
            self.vtime[item.tier] = start

    def charge_work(self, tier: int, tenant: str, cost: float) -> None:
        """Work done for the tenant before its inputs reach a queue (the tokenizer stage's time, in cost units),
        refused or not: its counter grows as if served that much (it only grows, so heap entries stay valid)."""
        key = (tier, tenant)
        self.counter[key] = self.counter.get(key, 0.0) + cost

    def least(self, tier: int) -> float:
        """The least counter of the tier's waiting tenants; with none waiting, the tier's virtual time."""
        heap = self._waiting[tier]
        while heap:
            listed, _, tenant = heap[0]
            key = (tier, tenant)
            if key not in self.depth:  # no longer waiting
                heapq.heappop(heap)
                self._listed.discard(key)
                continue
            now = self.counter[key]
            if len(heap) == 1:  # alone: its entry may stay stale (too low is all a stale entry can be)
                return now
            if now != listed:  # served since it was listed: re-keyed (counters only grow)
                heapq.heapreplace(heap, (now, next(self._order), tenant))
                continue
            return now
        return self.vtime[tier]

    def lag(self, tier: int, tenant: str) -> float:
        """How far the tenant is ahead of the least served waiting tenant of its tier (0: its turn)."""
        return max(0.0, self.counter.get((tier, tenant), 0.0) - self.least(tier))

    def ahead(self, tier: int, tenant: str, cost: float) -> float:
        """The cost a new input of this tier and tenant (costing `cost`) waits behind: every higher tier, its
        tenant's own waiting inputs, and of every other waiting tenant of its tier what it is served before this
        input's turn comes (up to the same counter: this tenant's lead, what it has waiting, and the input)."""
        key = (tier, tenant)
        own = self.queued.get(key, 0.0)
        others = self.active[tier] - (1 if key in self.depth else 0)
        same = own
        if others:
            same += min(self.tier_queued[tier] - own, others * (self.lag(tier, tenant) + own + cost))
        return sum(self.tier_queued[:tier]) + same

    def inputs_ahead(self, depth: int, tier: int, tenant: str, cost: float) -> int:
        """`ahead` in inputs of the model's queued mix, of its `depth` queued inputs."""
        total = sum(self.tier_queued)
        if not depth or total <= 0:
            return 0
        return min(depth, math.ceil(depth * self.ahead(tier, tenant, cost) / total - 1e-9))


@dataclass
class Lane:
    tier: int
    tenant: str
    items: deque[Item] = field(default_factory=deque)
    listed: bool = False  # has an entry in its queue's heap of its tier


@dataclass
class FairQueue:
    shares: Shares = field(default_factory=Shares)  # the model's counters, shared by its length-class queues
    lanes: dict[Key, Lane] = field(default_factory=dict)
    ready: dict[int, list[Entry]] = field(default_factory=dict)  # per tier: lazy heap of lanes, least counter first
    size: int = 0
    cost_sum: float = 0.0  # the queued items' costs: a batch formed now is estimated from their mean
    aging: tuple[float, ...] = AGING_S  # each tier's head start in seconds, by rank (`tiers.aging_for` the SLO)
    _order: itertools.count = field(default_factory=itertools.count)

    def mean_cost(self) -> float:
        return self.cost_sum / self.size if self.size else 1.0

    def __len__(self) -> int:
        return self.size

    def push(self, item: Item) -> None:
        key = (item.tier, item.tenant)
        self.shares.joined(item)
        lane = self.lanes.get(key)
        if lane is None:
            lane = self.lanes[key] = Lane(item.tier, item.tenant)
        if not lane.listed:
            lane.listed = True
            heapq.heappush(
                self.ready.setdefault(item.tier, []), (self.shares.counter[key], next(self._order), item.tenant)
            )
        lane.items.append(item)
        self.size += 1
        self.cost_sum += item.cost

    def push_front(self, item: Item) -> None:
        """Put an item back at the head of its lane (it already waited its turn once)."""
        self.push(item)
        self.lanes[(item.tier, item.tenant)].items.rotate(1)  # the item just appended becomes the head

    def prune(self, alive: Callable[[Item], bool]) -> list[Item]:
        """Drop dead items from the lane heads; returns them (the caller keeps its counts)."""
        dropped = []
        for lane in self.lanes.values():
            while lane.items and not alive(lane.items[0]):
                dropped.append(lane.items.popleft())
        for item in dropped:
            self.shares.left(item)
        self.size -= len(dropped)
        self.cost_sum -= sum(item.cost for item in dropped)
        if not self.size:
            self.cost_sum = 0.0  # no float drift left behind
        return dropped

    def oldest(self) -> Item | None:
        heads = [lane.items[0] for lane in self.lanes.values() if lane.items]
        return min(heads, key=lambda i: i.arrived) if heads else None

    def earliest_deadline(self) -> float:
        return min((lane.items[0].deadline for lane in self.lanes.values() if lane.items), default=float("inf"))

    def _least_served(self, tier: int, heap: list[Entry]) -> Lane | None:
        """The tier's lane with items whose tenant has the least counter (ties: the one listed first)."""
        counter = self.shares.counter
        while heap:
            listed, _, tenant = heap[0]
            lane = self.lanes[(tier, tenant)]
            if not lane.items:  # emptied: listed again when an item comes
                heapq.heappop(heap)
                lane.listed = False
                continue
            if len(heap) == 1:  # alone in its tier: its entry may stay stale (too low is all one can be)
                return lane
            now = counter[(tier, tenant)]
            if now != listed:  # served since it was listed (here or in another queue of the model)
                heapq.heapreplace(heap, (now, next(self._order), tenant))
                continue
            return lane
        return None

    def _next_lane(self, stick: dict[int, str] | None = None) -> Lane | None:
        """The lane to take from next: per tier the tenant least served (or the one the tier sticks to, while
        it has items), then the best aged head."""
        best: Lane | None = None
        best_key = float("inf")
        aging = self.aging
        for tier, heap in self.ready.items():
            if stick and tier in stick:  # only that tenant's lane, even when it is empty
                lane = self.lanes.get((tier, stick[tier]))
            else:
                lane = self._least_served(tier, heap)
            if lane is not None and lane.items:
                key = lane.items[0].arrived + aging[tier]
                if key < best_key:
                    best, best_key = lane, key
        return best

    def pop(self, stick: dict[int, str] | None = None, charge: bool = True) -> Item | None:
        """The next item, taken out. `charge`: its cost is counted as served to its tenant now; the batcher
        passes False and calls `charge` once the item is really in a batch (not dropped as late)."""
        lane = self._next_lane(stick)
        return None if lane is None else self.pop_head(lane, charge)

    def sole_lane(self) -> Lane | None:
        """The only lane with items, listed alone in its tier's heap (one tenant of one tier: the common case), else
        None: until something is pushed, its items are what `pop` returns, in order, without the search."""
        found: Lane | None = None
        for tier, heap in self.ready.items():
            if not heap:
                continue
            if found is not None or len(heap) != 1:
                return None
            found = self.lanes[(tier, heap[0][2])]
        if found is None or not found.items or len(found.items) != self.size:
            return None
        return found

    def pop_head(self, lane: Lane, charge: bool = True) -> Item:
        """The head of `lane` (which has items), taken out: `pop` once the lane is found (or is the `sole_lane`)."""
        self.size -= 1
        item = lane.items.popleft()
        self.cost_sum = self.cost_sum - item.cost if self.size else 0.0
        self.shares.left(item, charge)
        return item

    def pop_run(self, lane: Lane, n: int) -> list[Item]:
        """Up to `n` items from the head of the `sole_lane`, uncharged: as many `pop_head(lane, charge=False)` calls
        would take, in one call (~2 µs an item less for a lone tenant's batch, bench/hotpath.py)."""
        items = lane.items
        run = [items.popleft() for _ in range(min(n, len(items)))]
        if not run:
            return run
        self.size -= len(run)
        if self.size:
            cost_sum = self.cost_sum
            for item in run:
                cost_sum -= item.cost
            self.cost_sum = cost_sum
        else:
            self.cost_sum = 0.0
        self.shares.left_run(lane.tier, lane.tenant, run)
        return run

    def charge(self, item: Item) -> None:
        """`item`, taken by `pop(charge=False)`, is served: its tenant's counter grows by its cost."""
        self.shares.charge(item)

    def take_batch(
        self, limit: int, budget: float, now: float, ends: float, taken: list[int]
    ) -> tuple[list[Item], float]:
        """The items of this queue for a batch formed `now` that ends no sooner than `ends`, at most `limit` of them
        and within `budget` (rows x the longest row), and the cost of its widest row. `taken[tier]` counts every item
        taken out, sent or not. An item whose deadline falls before `ends` is answered 504 here, not sent: under
        overload, batches of items that expire while they run would serve nobody."""
        items: list[Item] = []
        widest = 0.0
        # Job places go to one tenant per batch (module docstring), so one tenant's failing inputs never drag
        # another tenant's job items into bisection.
        stick: dict[int, str] = {}
        shares = self.shares
        sole = self.sole_lane()
        # One tenant of one tier and no budget (the common case): items taken in runs (`pop_run`), charged once the
        # batch is made. Otherwise one at a time, each charged as taken: the next place goes to the least served.
        runs = sole is not None and budget == math.inf
        while len(items) < limit:
            if runs:
                assert sole is not None
                taken_now = self.pop_run(sole, limit - len(items))
                if not taken_now:
                    break
            else:
                item = self._next_one(sole, stick, items, widest, budget)
                if item is None:
                    break
                taken_now = [item]
            for item in taken_now:
                taken[item.tier] += 1
                # `item.alive(now)` where it is False (it answers the item); the common case without the call
                if item.future.done() or now >= item.deadline or (item.gone is not None and item.gone()):
                    item.alive(now)
                    continue
                if item.deadline < ends and not item.probe:
                    item.future.set_exception(errors.deadline_exceeded(LATE_FOR_BATCH))
                    continue
                items.append(item)
                if not runs:
                    shares.charge(item)
                if item.cost > widest:
                    widest = item.cost
                item.dispatched = now
                if item.record is not None:
                    item.record.status = "processing"
        if runs:
            assert sole is not None
            shares.charge_run(sole.tier, sole.tenant, items)
        return items, widest

    def _next_one(
        self, sole: Lane | None, stick: dict[int, str], items: list[Item], widest: float, budget: float
    ) -> Item | None:
        """`take_batch`'s next item taken one at a time (several lanes, or a budget), uncharged; None when nothing
        is left or the batch is full by cost. The first input always goes, even over a budget lowered since."""
        if items and budget != math.inf and self._full_by_cost(stick, items, widest, budget):
            return None
        # A lone lane under a budget: its head, as `pop` would find it, unsearched.
        item = self.pop_head(sole, charge=False) if sole is not None and sole.items else self.pop(stick, charge=False)
        if item is not None and item.tier == tiers.BATCH.rank and not stick:
            stick[item.tier] = item.tenant  # the batch's job places go to this tenant only
        return item

    def _full_by_cost(self, stick: dict[int, str], items: list[Item], widest: float, budget: float) -> bool:
        """Whether the batch of `items` is full by its cost budget: nothing left to take, or the next item would pass
        it (rows x the longest row, or the backend's own batch cost, asked only here where a budget applies)."""
        lane = self._next_lane(stick)  # the lane `pop(stick)` takes from next
        if lane is None:
            return True
        head = lane.items[0]
        if head.batch_cost is not None:
            return head.batch_cost([*(i.text for i in items), head.text]) > budget
        return (len(items) + 1) * max(widest, head.cost) > budget

    def paced_by_jobs(self, limit: int, budget: float, head: Item) -> tuple[bool, Item]:
        """Whether batch-job items are what makes this queue due at once (full by count or cost, or an old job
        item's deadline), and the head whose deadline counts. With several workers such a queue goes at the pace
        instead (`Batcher.most_urgent`): job items fill batches but never hurry them, or the workers fall into step
        and an interactive item waits up to a whole batch time for the next one instead of half of it."""
        jobs, jobs_cost = 0, 0.0
        first: Item | None = None
        for lane in self.lanes.values():
            if not lane.items:
                continue
            if lane.tier >= tiers.BATCH.rank:
                jobs += len(lane.items)
                jobs_cost += sum(item.cost for item in lane.items)
            elif first is None or lane.items[0].arrived < first.arrived:
                first = lane.items[0]
        if not jobs or len(self) - jobs >= limit or self.cost_sum - jobs_cost >= budget:
            return False, head  # no job items, or the interactive ones fill a batch by themselves
        return True, first if first is not None else head

    def lag(self) -> float:
        """How far the next item's tenant is ahead of its tier's least served waiting tenant in the model (0: it is
        that tenant), for the batcher's order between length classes."""
        lane = self._next_lane()
        return self.shares.lag(lane.tier, lane.tenant) if lane is not None else 0.0
