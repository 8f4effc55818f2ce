"""One model's waiting items, ordered by tier with aging, and fairly shared between tenants of a tier.

`Item` (one caller's input and the future that carries its answer) lives here, with the queue that holds it.
A batch is filled by repeatedly taking the lane head with the smallest `arrived + tiers.AGING_S[tier]`:
a higher tier goes first, but an item of a lower tier that has waited longer than the gap between the two
tiers' offsets overtakes, so no tier waits forever. Inside a tier, tenants take turns (round-robin, one item
a turn), so one tenant's flood cannot push another tenant's items back. A tier may be made to stick to the
tenant it started a batch with (`pop(stick=...)`, the batch-job tier): that tier's places in the batch then go
to that tenant only, and tenants take turns batch by batch instead, so one tenant's failing inputs never fail
the batches of another tenant's job (issue 28, item 3).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from batchserve import errors
from batchserve.core.requests_log import Record
from batchserve.core.tiers import AGING_S


@dataclass(slots=True)
class ItemResult:
    """A caller's answer: its output and how long it waited and ran."""

    output: object  # the JSON value the backend returned for this input
    queue_s: float
    compute_s: float
    batch_size: int


@dataclass(slots=True, eq=False)
class Item:
    """One caller's input on its way through a batch; `future` carries its answer back."""

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


@dataclass
class Lane:
    tier: int
    tenant: str
    items: deque[Item] = field(default_factory=deque)


@dataclass
class FairQueue:
    lanes: dict[tuple[int, str], Lane] = field(default_factory=dict)
    turn: dict[int, deque[str]] = field(default_factory=dict)  # per tier: tenants in round-robin order
    size: int = 0
    cost_sum: float = 0.0  # the queued items' costs: a batch formed now is estimated from their mean

    def mean_cost(self) -> float:
        return self.cost_sum / self.size if self.size else 1.0

    def __len__(self) -> int:
        return self.size

    def push(self, item: Item) -> None:
        key = (item.tier, item.tenant)
        lane = self.lanes.get(key)
        if lane is None:
            lane = self.lanes[key] = Lane(item.tier, item.tenant)
            self.turn.setdefault(item.tier, deque()).append(item.tenant)
        lane.items.append(item)
        self.size += 1
        self.cost_sum += item.cost

    def push_front(self, item: Item) -> None:
        """Put an item back at the head of its lane (it already waited its turn once)."""
        self.push(item)
        lane = self.lanes[(item.tier, item.tenant)]
        lane.items.rotate(1)  # the item just appended becomes the head

    def prune(self, alive: Callable[[Item], bool]) -> list[Item]:
        """Drop dead items from the lane heads; returns them (the caller keeps its counts)."""
        dropped = []
        for lane in self.lanes.values():
            while lane.items and not alive(lane.items[0]):
                dropped.append(lane.items.popleft())
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

    def _next_lane(self, stick: dict[int, str] | None = None) -> Lane | None:
        """The lane to take from next: per tier the tenant whose turn it is (or the one the tier sticks to,
        while it has items), then the best aged head."""
        best: Lane | None = None
        best_key = float("inf")
        for tier, order in self.turn.items():
            if stick and tier in stick:  # only that tenant's lane, even when it is empty
                lane = self.lanes.get((tier, stick[tier]))
                if lane is not None and lane.items:
                    key = lane.items[0].arrived + AGING_S[tier]
                    if key < best_key:
                        best, best_key = lane, key
                continue
            for _ in range(len(order)):
                lane = self.lanes[(tier, order[0])]
                if lane.items:
                    key = lane.items[0].arrived + AGING_S[tier]
                    if key < best_key:
                        best, best_key = lane, key
                    break
                order.rotate(-1)  # an empty lane passes its turn
        return best

    def pop(self, stick: dict[int, str] | None = None) -> Item | None:
        lane = self._next_lane(stick)
        if lane is None:
            return None
        if not (stick and stick.get(lane.tier) == lane.tenant):
            self.turn[lane.tier].rotate(-1)  # this tenant had its turn
        self.size -= 1
        item = lane.items.popleft()
        self.cost_sum = self.cost_sum - item.cost if self.size else 0.0
        return item

    def peek(self, stick: dict[int, str] | None = None) -> Item | None:
        """The item `pop(stick)` would return next, left in place."""
        lane = self._next_lane(stick)
        return lane.items[0] if lane is not None else None

    def drain_all(self) -> list[Item]:
        out = [item for lane in self.lanes.values() for item in lane.items]
        for lane in self.lanes.values():
            lane.items.clear()
        self.size = 0
        self.cost_sum = 0.0
        return out
