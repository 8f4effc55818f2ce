"""Tenants of a tier share by cost, not by item count (issue 33, item 2): the fair queue, the batcher's choice
between length classes, the door's prediction, and the account of cost served. In-process, injected clock.

Each test that pins the new behaviour was checked to fail on the item-count queue of b6ba887 (tenants took turns
one item a turn, and the door counted items); where a test is a guard of what must not change (a lone tenant, the
tiers), it says so."""

from __future__ import annotations

import itertools
import math

import pytest

from batchserve.core import tiers
from batchserve.core.admission import Admission
from batchserve.core.batch import BatchTimes, Batch
from batchserve.core.batcher import Batcher
from batchserve.core.fairqueue import FairQueue, Item
from batchserve.core.ledger import CostAccount
from batchserve.errors import ApiError
from batchserve.gpu_pool import GpuPool, DeviceWorker
from batchserve.metrics import make_metrics
from tests.unit.fakes import Clock

ENT, PAID, FREE = (tiers.BY_NAME[n].rank for n in ("enterprise", "paid", "free"))
M = "m"
LONG, SHORT = 220.0, 8.0  # tokens of the issue's two tenants' inputs


def item(
    loop, tenant: str, cost: float, arrived: float = 1000.0, tier: int = PAID, bucket: int = 0, text: str = "x"
) -> Item:
    return Item(text, M, bucket, loop.create_future(), arrived, 1e9, None, tier, tenant, cost=cost)


def served_by_tenant(items: list[Item]) -> dict[str, float]:
    out: dict[str, float] = {}
    for i in items:
        out[i.tenant] = out.get(i.tenant, 0.0) + i.cost
    return out


def ratio(costs: dict[str, float]) -> float:
    return max(costs.values()) / min(costs.values())


# -- the fair queue ------------------------------------------------------------------------------------------------
def test_two_backlogged_tenants_get_equal_cost_not_equal_items(loop):
    """Long (220) and short (8) inputs in one queue: what each is served, in cost, stays within one long input
    of the other. Item turns served the long tenant 27.5x the short one's tokens."""
    q = FairQueue()
    for i in range(200):
        q.push(item(loop, "long", LONG, arrived=1000.0 + i * 1e-3))
        q.push(item(loop, "short", SHORT, arrived=1000.0 + i * 1e-3))
    taken = [q.pop() for _ in range(150)]
    got = served_by_tenant(taken)
    assert abs(got["long"] - got["short"]) <= LONG
    assert ratio(got) < 1.25
    # in items, the short tenant was served ~27 for each long one
    assert sum(i.tenant == "short" for i in taken) > 20 * sum(i.tenant == "long" for i in taken)


def test_a_lone_tenant_gets_everything_and_a_newcomer_gets_no_burst_for_its_idle_time(loop):
    """`busy` is alone for a while: every place is its own (a guard: item turns did the same). Then `new` starts
    waiting: it is lifted to busy's counter, so from then on they are served equal cost (item turns: 10x apart
    in cost), and `new` is not served all of what busy got while it was idle (a counter left at 0 would give it
    the next 10,000 units alone)."""
    q = FairQueue()
    for i in range(1000):
        q.push(item(loop, "busy", 10.0, arrived=1000.0 + i * 1e-3))
    alone = [q.pop() for _ in range(1000 // 2)]
    assert {i.tenant for i in alone} == {"busy"}  # alone: everything
    for i in range(1000):
        q.push(item(loop, "new", 1.0, arrived=1001.0 + i * 1e-3))
    after = [q.pop() for _ in range(300)]
    got = served_by_tenant(after)
    assert set(got) == {"busy", "new"}
    assert abs(got["busy"] - got["new"]) <= 10.0  # equal cost from the moment it arrived, no burst of `new`


def test_tiers_and_aging_are_unchanged_by_cost(loop):
    """A guard: a higher tier goes first whatever its inputs cost, and an old lower-tier item still overtakes by
    aging; inside the paid tier the two tenants share by cost (item turns: 27.5x apart)."""
    q = FairQueue()
    for i in range(3):
        q.push(item(loop, "ent", LONG, tier=ENT, text=f"ent{i}"))
    for i in range(40):
        q.push(item(loop, "long", LONG, text=f"long{i}"))
        q.push(item(loop, "short", SHORT, text=f"short{i}"))
    q.push(item(loop, "old-free", SHORT, arrived=1000.0 - q.aging[FREE] - 0.01, tier=FREE, text="old-free"))
    order = [q.pop().text for _ in range(4)]
    assert order[0] == "old-free" and order[1:] == ["ent0", "ent1", "ent2"]
    paid = served_by_tenant([q.pop() for _ in range(40)])
    assert abs(paid["long"] - paid["short"]) <= LONG


def test_a_tenant_that_leaves_and_returns_keeps_its_lead(loop):
    """A tenant served more than its peer stays behind it when it comes back soon after: leaving the queue for a
    moment does not reset its counter (it is only lifted to the least of those waiting). Item turns gave it the
    second place."""
    q = FairQueue()
    q.push(item(loop, "a", LONG))
    q.push(item(loop, "b", SHORT))
    assert [q.pop().tenant, q.pop().tenant] == ["a", "b"]  # level at 0: listed first goes first
    for _ in range(20):
        q.push(item(loop, "b", SHORT))
    q.push(item(loop, "a", LONG))  # a returns 212 ahead of b: b's next 20 inputs (160) all go first
    assert [q.pop().tenant for _ in range(21)] == ["b"] * 20 + ["a"]


# -- the batcher: length classes of one model ---------------------------------------------------------------------
def batcher(clock: Clock, budget: float = 2048.0) -> Batcher:
    return Batcher(
        max_batch_size=64,
        slo_s=0.2,
        margin_s=0.005,
        batch_s=BatchTimes(64, {M: 0.05}),
        max_batch_cost=budget,
        clock=clock,
    )


def test_length_classes_are_shared_by_cost_between_their_tenants(loop):
    """The issue's scenario in the batcher: `long` (220-token inputs, one length class) and `short` (8 tokens,
    another), both backlogged; batches are formed one after another. Cost served within 1.25x. With the classes
    taking plain turns (a batch each), a batch of long inputs (9 x 220 under a 2,048 budget) against one of 64
    short ones served the long tenant 3.9x the tokens."""
    clock = Clock(1000.0)
    b = batcher(clock)
    served: list[Item] = []
    waiting = {"long": 0, "short": 0}
    for _ in range(40):  # both kept backlogged: 20 long inputs and 100 short ones waiting before each batch
        for tenant, cost, bucket, n in (("long", LONG, 4, 20), ("short", SHORT, 0, 100)):
            for _ in range(n - waiting[tenant]):
                b.submit(item(loop, tenant, cost, arrived=clock.now, bucket=bucket))
            waiting[tenant] = n
        key, due, cause = b.most_urgent(clock.now)
        assert key is not None and due <= clock.now
        batch = b.form(key, clock.now, cause, due)
        assert batch is not None
        served += batch.items
        for i in batch.items:
            waiting[i.tenant] -= 1
        clock.now += 0.05
    got = served_by_tenant(served)
    assert ratio(got) < 1.25, got


def closed_loops(loop, b: Batcher, clock: Clock, loops: int, batches: int) -> dict[str, float]:
    """Cost served to `long` (4 inputs of 220 a request) and `short` (16 of 8), each with `loops` requests always
    outstanding: a request answered is sent again at once. As in the pool, a worker takes its next batch before
    the answers of the one it ran go out, so a client whose inputs all went into the last batch has none waiting
    for the next."""
    left: dict[int, list] = {}  # request id -> [tenant, inputs not yet answered]
    ids = itertools.count()

    def send(tenant: str) -> None:
        cost, n, bucket = (LONG, 4, 4) if tenant == "long" else (SHORT, 16, 0)
        rid = next(ids)
        left[rid] = [tenant, n]
        for _ in range(n):
            b.submit(item(loop, tenant, cost, arrived=clock.now, bucket=bucket, text=str(rid)))

    for tenant in ("long", "short"):
        for _ in range(loops):
            send(tenant)
    served = {"long": 0.0, "short": 0.0}
    running: list[Item] = []
    for _ in range(batches):
        key, due, cause = b.most_urgent(clock.now)
        batch = b.form(key, clock.now, cause, due)
        for done in running:  # the previous batch's answers, after the next batch was taken
            entry = left[int(done.text)]
            entry[1] -= 1
            if not entry[1]:
                del left[int(done.text)]
                send(entry[0])
        running = batch.items if batch is not None else []
        for i in running:
            served[i.tenant] += i.cost
        clock.now += 0.5
    return served


def test_closed_loop_clients_whose_queue_empties_between_batches_keep_what_they_are_owed(loop):
    """Over HTTP a client's inputs wait only while its requests do: `short`'s 8 requests (128 inputs) fill two
    batches of 64, and after the second its queue is empty until the answers go out and it sends again, while
    one batch of 12 long inputs costs 2,640. Lifted to the least counter each time it comes back (plain VTC),
    it lost the deficit it had earned waiting behind that batch, and `long` got 1.7x its tokens; keeping what it
    was still owed (at most a batch's cost) keeps them within 1.25x. Item turns: 1.7x too."""
    clock = Clock(1000.0)
    served = closed_loops(loop, batcher(clock, budget=2750.0), clock, loops=8, batches=300)
    assert ratio(served) < 1.25, served


def test_a_lone_tenant_of_two_lengths_keeps_the_class_turns(loop):
    """A guard: one tenant with inputs in two classes is level with itself, so the classes take turns as before
    (a batch each)."""
    clock = Clock(1000.0)
    b = batcher(clock)
    for _ in range(200):
        b.submit(item(loop, "t", LONG, arrived=clock.now, bucket=4))
        b.submit(item(loop, "t", SHORT, arrived=clock.now, bucket=0))
    keys = []
    for _ in range(6):
        key, due, cause = b.most_urgent(clock.now)
        b.form(key, clock.now, cause, due)
        keys.append(key[1])
        clock.now += 0.05
    assert keys in ([0, 4] * 3, [4, 0] * 3)


# -- the door --------------------------------------------------------------------------------------------------------
class Capacity:
    def __init__(self, healthy: int = 1, workers: int = 2, until_free: float = 0.05) -> None:
        self.healthy, self.workers, self.until_free = healthy, workers, until_free

    def healthy_count(self) -> int:
        return self.healthy

    def worker_count(self) -> int:
        return self.workers

    def seconds_until_free(self, now: float) -> float:
        return self.until_free


def test_the_tenant_over_its_share_by_cost_waits_behind_more(loop):
    """`long` has 4 inputs of 220 waiting (880 tokens), `short` 40 of 8 (320). By cost, long is over its share:
    a new input of its own waits behind all of it and as much of short's, while short's new input waits behind
    its own and one turn of long. Item counting said the opposite (long: 10 items ahead, short: 44)."""
    clock = Clock(1000.0)
    b = batcher(clock)
    for _ in range(4):
        b.submit(item(loop, "long", LONG, arrived=clock.now, bucket=4))
    for _ in range(40):
        b.submit(item(loop, "short", SHORT, arrived=clock.now, bucket=0))
    assert b.ahead_of(PAID, "long", M, LONG) == 44  # everything queued
    assert b.ahead_of(PAID, "short", M, SHORT) < 30
    # a newcomer waits behind one turn of each, its own input's worth
    assert b.ahead_of(PAID, "new", M, SHORT) < b.ahead_of(PAID, "short", M, SHORT)


def test_under_pressure_the_tenant_over_its_share_is_refused_first(loop):
    """A worker lost is pressure. `long` has 40 inputs of 22 waiting (880), `short` 100 of 1: a request of `long`
    (over its share by cost: predicted behind all 140, two full batches) is refused while one of `short` (under
    it: behind ~29) is admitted. With the door counting items, short's 100 queued inputs made it the one refused
    and long's was admitted."""
    clock = Clock(1000.0)
    b = Batcher(max_batch_size=64, slo_s=0.2, margin_s=0.005, batch_s=BatchTimes(64, {M: 0.1}), clock=clock)
    for _ in range(40):
        b.submit(item(loop, "long", 22.0, arrived=clock.now))
    for _ in range(100):
        b.submit(item(loop, "short", 1.0, arrived=clock.now))
    adm = Admission(b, Capacity(healthy=1, workers=2, until_free=0.05), 10000, slo_s=0.2, slack=1.25, clock=clock)
    with pytest.raises(ApiError) as refused:
        adm.admit_ticket(M, PAID, "long", deadline_s=5.0, costs=(22.0,))
    assert refused.value.status == 503
    adm.admit_ticket(M, PAID, "short", deadline_s=5.0, costs=(1.0,))


# -- the account ----------------------------------------------------------------------------------------------------
def test_the_account_adds_cost_answered_per_model_tier_and_tenant(loop):
    """The pool books every input it answers with an output (its cost, once); a failed input costs nothing."""
    clock = Clock(1000.0)
    b = batcher(clock)
    pool = GpuPool({}, b, make_metrics(), loop, ["d0"], gpu_timeout_s=1.0, clock=clock)
    w = DeviceWorker(0, "d0")
    pool.workers = [w]
    items = [
        item(loop, "long", LONG, bucket=4),
        item(loop, "short", SHORT),
        item(loop, "short", SHORT),
        item(loop, "ent", 3.0, tier=ENT),
    ]
    batch = Batch(M, items, clock.now, "full")
    w.batch, w.started = batch, clock.now
    answer = pool._finish(w, w.generation, batch, ["o"] * 4, None, {2: "bad input"}, 0.01)
    assert answer is not None
    answer()
    account = b.account
    assert set(account.of_tenant("long")) == {(M, PAID)} and account.of_tenant("long")[(M, PAID)].cost == LONG
    assert account.served[(M, PAID, "long")].cost == LONG and account.served[(M, PAID, "long")].inputs == 1
    assert account.served[(M, PAID, "short")].cost == SHORT  # its second input failed: not served
    by_tier = account.by_tier(M)
    assert by_tier[PAID].cost == LONG + SHORT and by_tier[PAID].inputs == 2 and by_tier[ENT].cost == 3.0
    assert account.tenants() == {"long", "short", "ent"}
    before = account.snapshot()
    account.add(M, PAID, "long", 5.0)
    assert before[(M, PAID, "long")].cost == LONG  # a copy


def test_cost_account_sums_across_models_only_when_asked():
    account = CostAccount()
    account.add("a", PAID, "t", 10.0, inputs=2)
    account.add("b", PAID, "t", 5.0)
    assert account.by_tier()[PAID].cost == 15.0 and account.by_tier("a")[PAID].inputs == 2
    assert math.isclose(sum(s.cost for s in account.of_tenant("t").values()), 15.0)
