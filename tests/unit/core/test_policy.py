"""The policy modules in-process, on an injected clock (issue 10 §5): no server, no threads, no sleeps.

The fair queue's order and aging, the batcher's flush causes and pacing, the pool's retry and bisection
choices, and admission's predictions. The live-server tests keep the contract; these pin the decisions.
"""

from __future__ import annotations


import pytest

from batchserve.core.batch import BatchTimes, Batch
from batchserve.core.batcher import Batcher
from batchserve.core import tiers
from batchserve.core.admission import PROBE_EVERY_S, Admission
from batchserve.core.wait_prediction import predicted_latency_s
from batchserve.core.fairqueue import FairQueue, Item
from batchserve.errors import ApiError
from batchserve.gpu_pool import GpuPool, DeviceWorker
from batchserve.metrics import make_metrics
from tests.unit.fakes import Clock

ENT, PAID, FREE, BATCH = (tiers.BY_NAME[n].rank for n in ("enterprise", "paid", "free", "batch"))
S = 0.1  # the learned batch time of model "m"


def make_item(
    loop,
    text: str = "x",
    arrived: float = 1000.0,
    tier: int = PAID,
    tenant: str = "t",
    model: str = "m",
    deadline: float = 1e9,
) -> Item:
    return Item(text, model, 0, loop.create_future(), arrived, deadline, None, tier, tenant)


def make_batcher(
    clock: Clock, workers: int = 1, max_batch: int = 100, slo_s: float = 0.2, models: tuple[str, ...] = ("m",)
) -> Batcher:
    return Batcher(
        max_batch_size=max_batch,
        slo_s=slo_s,
        margin_s=0.005,
        batch_s=BatchTimes(max_batch, {m: S for m in models}),
        healthy_workers=workers,
        clock=clock,
    )


# -- fair queue -----------------------------------------------------------------------------------------------
def test_fair_queue_takes_higher_tiers_first(loop):
    q = FairQueue()
    for tier, name in ((FREE, "free"), (PAID, "paid"), (ENT, "ent")):
        q.push(make_item(loop, name, arrived=1000.0, tier=tier))
    assert [q.pop().text for _ in range(3)] == ["ent", "paid", "free"]
    assert q.pop() is None and len(q) == 0


@pytest.mark.parametrize("slo_s", [0.2, 1.0])
def test_fair_queue_aging_lets_a_lower_tier_overtake(loop, slo_s):
    q = FairQueue(aging=tiers.aging_for(slo_s))
    head_start = tiers.BY_NAME["free"].head_start * slo_s  # in the model's SLOs: 0.5 s at 200 ms, 2.5 s at 1 s
    fresh = 1000.0
    q.push(make_item(loop, "ent", arrived=fresh, tier=ENT))
    # A free item that waited longer than free's head start goes before a fresh enterprise one ...
    q.push(make_item(loop, "old-free", arrived=fresh - head_start - 0.01, tier=FREE))
    assert q.pop().text == "old-free"
    # ... one that waited less does not.
    q.push(make_item(loop, "young-free", arrived=fresh - head_start + 0.01, tier=FREE))
    assert q.pop().text == "ent"


def test_head_starts_follow_the_models_slo_but_the_batch_tier_s_does_not():
    assert tiers.aging_for(0.2) == pytest.approx((0.0, 0.2, 0.5, 30.0))
    assert tiers.aging_for(1.0) == pytest.approx((0.0, 1.0, 2.5, 30.0))


def test_each_models_queues_take_the_head_starts_of_its_own_slo_and_follow_a_derived_one(loop):
    from batchserve.slo import Deadlines

    b = make_batcher(Clock(1000.0), models=("fast", "slow"))
    b.deadlines["slow"] = Deadlines(slo_s=1.0, timeout_s=10.0, max_timeout_s=60.0)
    for model in ("fast", "slow"):
        b.submit(make_item(loop, model=model))
    assert b.queues[("fast", 0)].aging == pytest.approx(tiers.aging_for(0.2))  # the server's SLO: none of its own
    assert b.queues[("slow", 0)].aging == pytest.approx(tiers.aging_for(1.0))
    b.deadlines["fast"] = Deadlines(slo_s=0.5, timeout_s=5.0, max_timeout_s=60.0)  # derived after its queue was made
    b.deadlines_changed()
    assert b.queues[("fast", 0)].aging == pytest.approx(tiers.aging_for(0.5))


def test_fair_queue_tenants_of_a_tier_take_turns(loop):
    q = FairQueue()
    for i in range(4):
        q.push(make_item(loop, f"flood{i}", arrived=1000.0 + i * 0.001, tenant="flood"))
    q.push(make_item(loop, "light", arrived=1000.01, tenant="light"))
    taken = [q.pop().text for _ in range(3)]
    assert taken == ["flood0", "light", "flood1"]


def test_a_batch_takes_job_items_of_one_tenant_and_job_tenants_take_turns_by_batch(loop):
    """Issue 28, item 3: one tenant's failing job inputs must not fail another tenant's job items, so the
    batch tier's places in a batch go to one tenant (interactive items still fill first), turn by turn."""
    clock = Clock(1000.0)
    b = make_batcher(clock, max_batch=6)
    for i in range(2):
        b.submit(make_item(loop, f"live-{i}", arrived=clock.now, tier=PAID, tenant="live"))
    for i in range(7):
        if i < 6:
            b.submit(make_item(loop, f"a-{i}", arrived=clock.now, tier=BATCH, tenant="acme"))
        b.submit(make_item(loop, f"g-{i}", arrived=clock.now, tier=BATCH, tenant="globex"))
    first = b.form(("m", 0), clock.now, "full")
    second = b.form(("m", 0), clock.now, "full")
    assert first is not None and second is not None
    assert [i.text for i in first.items] == ["live-0", "live-1", "a-0", "a-1", "a-2", "a-3"]
    assert [i.text for i in second.items] == ["g-0", "g-1", "g-2", "g-3", "g-4", "g-5"]
    third = b.form(("m", 0), clock.now, "full")
    assert third is not None and [i.text for i in third.items] == ["a-4", "a-5"]  # not topped up with g-6


def test_background_batches_take_one_dispatch_in_five_while_job_work_is_due_and_none_while_interactive_waits(loop):
    """Issue 28, item 3: an isolated job's groups (and job re-runs) get a small share of the workers while
    other job work is due, so they move without slowing the others much; never ahead of interactive items."""
    from batchserve.core.retries import BACKGROUND_EVERY

    clock = Clock(1000.0)
    b = make_batcher(clock, max_batch=2)
    for i in range(40):
        b.submit(make_item(loop, f"g-{i}", arrived=clock.now, tier=BATCH, tenant="globex"))
    for i in range(3):
        b.submit_group([make_item(loop, f"iso-{i}", arrived=clock.now, tier=BATCH, tenant="acme")])
    kinds = []
    for _ in range(3 * (BACKGROUND_EVERY + 1)):
        batch = b.take_now(0)
        assert batch is not None
        kinds.append("iso" if batch.isolated else "regular")
    assert kinds == (["regular"] * BACKGROUND_EVERY + ["iso"]) * 3
    b.submit_group([make_item(loop, "iso-late", arrived=clock.now, tier=BATCH, tenant="acme")])
    b.submit(make_item(loop, "live", arrived=clock.now, tier=PAID, tenant="live"))
    for _ in range(BACKGROUND_EVERY + 1):  # its turn is due, but an interactive item waits: never ahead of it
        batch = b.take_now(0)
        assert batch is not None and not batch.isolated
        if any(i.tier == PAID for i in batch.items):
            break
    else:
        raise AssertionError("the interactive item never went")


def test_an_isolated_jobs_group_size_follows_its_failure_rate():
    from batchserve.jobs.job_state import FAILING_WINDOW, JobState

    job = JobState("batch_x", "acme", "m@v1")
    job.recent.extend([False] * FAILING_WINDOW)
    assert job.group_size(20) == 0  # clean: rides in shared batches
    job.recent.extend([True] + [False] * (FAILING_WINDOW - 1))
    assert job.group_size(20) == 0  # one costly failure is not a pattern
    job.recent.extend(([True] + [False] * 9) * 7)  # about 10 % in the window
    assert job.group_size(20) == 5
    job.recent.extend([True, False] * (FAILING_WINDOW // 2))
    assert job.group_size(20) == 1  # half fail: alone
    job.recent.extend([True] * 2 + [False] * (FAILING_WINDOW - 2))
    assert job.group_size(20) == 16  # rare failures: large groups, capped by the batch limit
    assert job.group_size(8) == 8


def test_fair_queue_push_front_and_prune(loop):
    q = FairQueue()
    a, b = make_item(loop, "a"), make_item(loop, "b")
    q.push(a)
    q.push_front(b)
    assert q.oldest() is not None and len(q) == 2
    b.future.set_result(None)  # answered elsewhere: pruned from the head
    dropped = q.prune(lambda i: not i.future.done())
    assert dropped == [b] and len(q) == 1 and q.pop() is a


def test_a_sole_lanes_head_is_what_pop_takes_and_leaves_the_queue_as_pop_does(loop):
    """The batcher takes a lone tenant's items by `pop_head` of its `sole_lane` (no search for the lane): the same
    items in the same order as `pop`, and the queue and its shares left alike; with a second tenant or tier
    waiting there is no sole lane."""
    by_pop, by_head = FairQueue(), FairQueue()
    for q in (by_pop, by_head):
        for i in range(5):
            q.push(make_item(loop, f"x{i}", arrived=1000.0 + i * 0.001))
    lane = by_head.sole_lane()
    assert lane is not None and by_pop.sole_lane() is not None
    taken_head = [by_head.pop_head(lane, charge=False).text for _ in range(3)]
    assert taken_head == [by_pop.pop(charge=False).text for _ in range(3)] == ["x0", "x1", "x2"]
    assert (len(by_head), by_head.cost_sum, by_head.shares.depth, by_head.shares.queued) == (
        len(by_pop),
        by_pop.cost_sum,
        by_pop.shares.depth,
        by_pop.shares.queued,
    )
    by_head.push(make_item(loop, "other", tenant="other"))  # another tenant of the tier: turns, no sole lane
    assert by_head.sole_lane() is None
    q = FairQueue()
    q.push(make_item(loop, "paid", tier=PAID))
    q.push(make_item(loop, "free", tier=FREE))  # another tier waiting: no sole lane either
    assert q.sole_lane() is None
    assert FairQueue().sole_lane() is None


def _shares_state(q: FairQueue) -> tuple:
    sh = q.shares
    return (
        len(q),
        q.cost_sum,
        dict(sh.depth),
        dict(sh.queued),
        list(sh.tier_queued),
        list(sh.active),
        dict(sh.behind),
        dict(sh.counter),
        list(sh.vtime),
    )


@pytest.mark.parametrize("elsewhere", [0, 2], ids=["its-last-inputs", "more-in-another-class"])
def test_a_run_off_a_sole_lane_leaves_the_queue_and_shares_as_pop_head_one_by_one(loop, elsewhere):
    """`pop_run` + `charge_run` (the batcher's way to fill a lone tenant's batch) take the same items and leave
    the queue and the model's shares bit for bit as `pop_head` + `charge` item by item: fractional costs (float
    steps in the same order), another tenant waiting in another length class of the model (so the tenant's last
    input records what it is owed), and the tenant with `elsewhere` inputs of its own in that other class."""

    def build() -> tuple[FairQueue, FairQueue]:
        q = FairQueue()
        other = FairQueue(q.shares)  # another length class of the same model: the shares are the model's
        other.push(make_item(loop, "o", tenant="other"))
        for i in range(elsewhere):
            other.push(make_item(loop, f"e{i}"))
        for i, cost in enumerate((0.1, 0.7, 1.3, 0.2, 2.9)):
            item = make_item(loop, f"x{i}", arrived=1000.0 + i * 0.001)
            item.cost = cost
            q.push(item)
        return q, other

    (by_run, _), (by_head, _) = build(), build()
    lane = by_run.sole_lane()
    assert lane is not None
    head_lane = by_head.sole_lane()
    assert head_lane is not None
    first = by_run.pop_run(lane, 3)
    taken = [by_head.pop_head(head_lane, charge=False) for _ in range(3)]
    assert _shares_state(by_run) == _shares_state(by_head)  # part of the lane taken
    rest = by_run.pop_run(lane, 10)  # more than it holds: what is left
    by_run.shares.charge_run(lane.tier, lane.tenant, [*first, *rest[:1]])  # a run in which the last two were late
    taken += [by_head.pop_head(head_lane, charge=False) for _ in range(2)]
    for item in taken[:4]:
        by_head.charge(item)
    assert [i.text for i in [*first, *rest]] == [i.text for i in taken] == ["x0", "x1", "x2", "x3", "x4"]
    assert _shares_state(by_run) == _shares_state(by_head)
    assert by_run.pop_run(lane, 5) == [] and len(by_run) == 0


# -- batcher: flush causes and pacing ---------------------------------------------------------------------
def test_full_queue_is_due_now(loop):
    clock = Clock(1000.0)
    b = make_batcher(clock, max_batch=3)
    for i in range(3):
        b.submit(make_item(loop, str(i), arrived=clock.now))
    key, due, cause = b.most_urgent(clock.now)
    assert key == ("m", 0) and due == clock.now and cause == "full"
    batch = b.form(key, clock.now, cause, due)
    assert batch is not None and [i.text for i in batch.items] == ["0", "1", "2"] and b.depth["m"] == 0


def test_the_dispatch_deadline_comes_before_a_later_pace(loop):
    clock = Clock(1000.0)
    b = make_batcher(clock, workers=2, slo_s=0.14)
    b.last_dispatch = clock.now  # a batch just went out: pacing would wait S/2 = 50 ms
    b.submit(make_item(loop, arrived=clock.now))
    key, due, cause = b.most_urgent(clock.now)
    # slo 140 ms - S 100 ms - margin 5 ms = 35 ms of waiting for company, earlier than the pace (50 ms)
    assert cause == "deadline" and due == pytest.approx(clock.now + 0.035)
    assert b.take_now(0) is None  # not due yet
    clock.now += 0.036
    batch = b.take_now(0)
    assert batch is not None and batch.cause == "deadline" and len(batch.items) == 1


def test_one_device_takes_what_waits_as_soon_as_it_frees(loop):
    clock = Clock(1000.0)
    b = make_batcher(clock, workers=1)
    b.last_dispatch = clock.now - 0.03  # its batch ended after 30 ms, well before the learned S of 100
    for text in ("a", "b"):
        b.submit(make_item(loop, text, arrived=clock.now - 0.02))
    batch = b.take_now(0)
    assert batch is not None and [i.text for i in batch.items] == ["a", "b"]


def test_a_worker_freed_just_before_the_pace_takes_its_batch_at_once(loop):
    clock = Clock(1000.0)
    b = make_batcher(clock, workers=2)
    b.last_dispatch = clock.now - (S / 2 - 0.001)  # 1 ms before the pace of S/G
    b.submit(make_item(loop, "a", arrived=clock.now - 0.05))
    batch = b.take_now(0)
    assert batch is not None and batch.cause == "pace"
    b.last_dispatch = clock.now - (S / 2 - 0.004)  # 4 ms before it: pacing still waits
    b.submit(make_item(loop, "b", arrived=clock.now - 0.01))
    assert b.take_now(0) is None
    _, due, cause = b.most_urgent(clock.now)
    assert cause == "pace" and due == pytest.approx(clock.now + 0.004)


def test_several_devices_dispatch_paced_s_over_g_apart(loop):
    clock = Clock(1000.0)
    b = make_batcher(clock, workers=4)
    b.last_dispatch = clock.now
    b.submit(make_item(loop, arrived=clock.now))
    _, due, cause = b.most_urgent(clock.now)
    assert cause == "pace" and due == pytest.approx(clock.now + S / 4)


def test_a_slightly_late_paced_dispatch_keeps_its_slot(loop):
    clock = Clock(1000.0)
    b = make_batcher(clock, workers=4)
    b.last_dispatch = clock.now
    b.submit(make_item(loop, arrived=clock.now))
    _, due, cause = b.most_urgent(clock.now)
    clock.now = due + 0.003  # 3 ms late, under half an interval (12.5 ms)
    batch = b.take_now(0)
    assert batch is not None and batch.cause == "pace"
    assert b.last_dispatch == pytest.approx(due)  # the rhythm is kept, lateness does not pile up
    b.submit(make_item(loop, arrived=clock.now))
    _, due, cause = b.most_urgent(clock.now)
    assert cause == "pace" and due == pytest.approx(b.last_dispatch + S / 4)
    clock.now = due + 0.015  # a late one by more than half an interval (a stalled loop) starts a new rhythm
    assert b.take_now(0) is not None
    assert b.last_dispatch == pytest.approx(clock.now)


def test_draining_flushes_at_once(loop):
    clock = Clock(1000.0)
    b = make_batcher(clock)
    b.last_dispatch = clock.now
    b.submit(make_item(loop, arrived=clock.now))
    b.start_drain()
    _, due, cause = b.most_urgent(clock.now)
    assert cause == "drain" and due == clock.now


def test_expired_and_gone_items_never_reach_a_batch(loop):
    clock = Clock(1000.0)
    b = make_batcher(clock, max_batch=3)
    late = make_item(loop, "late", arrived=clock.now, deadline=clock.now + 0.01)
    gone = make_item(loop, "gone", arrived=clock.now)
    gone.gone = lambda: True
    ok = make_item(loop, "ok", arrived=clock.now)
    for item in (late, gone, ok):
        b.submit(item)
    clock.now += 0.02
    batch = b.take_now(0)
    assert batch is not None and [i.text for i in batch.items] == ["ok"]
    assert isinstance(late.future.exception(), ApiError) and late.future.exception().status == 504
    assert type(gone.future.exception()).__name__ == "ClientGone"
    assert b.total_depth() == 0


@pytest.mark.parametrize("budget", [0.0, 1e9], ids=["lone-lane-in-runs", "item-by-item-under-a-budget"])
def test_a_batch_skips_what_cannot_run_and_fills_up_behind_it(loop, budget):
    """Both ways `form` takes a lone tenant's items (in runs without a budget, one by one under one) answer the
    answered, expired, gone and doomed items as they meet them, keep a late probe, fill the batch with the live
    ones behind them and leave the rest queued, counted and uncharged."""
    clock = Clock(1000.0)
    b = make_batcher(clock, max_batch=3)  # S = 0.1 s
    b.costs.set_max_batch_cost(budget)
    now = clock.now
    answered = make_item(loop, "answered", arrived=now)
    answered.future.set_result(None)
    expired = make_item(loop, "expired", arrived=now, deadline=now)
    gone = make_item(loop, "gone", arrived=now)
    gone.gone = lambda: True
    doomed = make_item(loop, "doomed", arrived=now, deadline=now + 0.05)  # would end after its deadline
    probe = make_item(loop, "probe", arrived=now, deadline=now + 0.05)
    probe.probe = True  # runs even when late: what it takes is learned
    live = [make_item(loop, f"live{i}", arrived=now) for i in range(3)]
    for item in (answered, expired, live[0], doomed, probe, gone, live[1], live[2]):
        b.submit(item)
    batch = b.take_now(0)
    assert batch is not None and [i.text for i in batch.items] == ["live0", "probe", "live1"]
    assert expired.future.exception().status == 504 and type(gone.future.exception()).__name__ == "ClientGone"
    assert "before its batch could end" in doomed.future.exception().message
    assert b.depth["m"] == 1 and b.tier_depth[PAID] == 1 and len(b.queues[("m", 0)]) == 1
    shares = b.queues[("m", 0)].shares
    assert shares.counter[(PAID, "t")] == 3.0 and shares.depth == {(PAID, "t"): 1}  # the three run, charged
    assert [i.dispatched for i in batch.items] == [now] * 3 and not live[2].future.done()


def test_an_item_that_would_expire_while_its_batch_runs_gives_its_place_away(loop):
    clock = Clock(1000.0)
    b = make_batcher(clock, max_batch=2)  # S = 0.1 s
    doomed = make_item(loop, "doomed", arrived=clock.now, deadline=clock.now + 0.05)  # ends before a batch would
    edge = make_item(loop, "edge", arrived=clock.now, deadline=clock.now + 0.1)  # its batch ends right at it
    later = make_item(loop, "later", arrived=clock.now)
    for item in (doomed, edge, later):
        b.submit(item)
    batch = b.take_now(0)
    assert batch is not None and [i.text for i in batch.items] == ["edge", "later"]
    err = doomed.future.exception()
    assert isinstance(err, ApiError) and (err.status, err.code) == (504, "DEADLINE_EXCEEDED")
    assert "before its batch could end" in err.message
    assert b.total_depth() == 0


def test_a_batch_time_learned_from_one_slow_batch_does_not_drop_what_the_seed_allows(loop):
    # S(1) learned as 2.5 s from one slow batch; the seed (0.1 s) says a batch may well take 0.1 s: an item with
    # 1 s left runs (and its batch corrects S), where dropping it would leave nothing to ever correct it.
    clock = Clock(1000.0)
    b = make_batcher(clock, max_batch=2)
    b.batch_s.observe("m", 1, 2.5)
    item = make_item(loop, "a", arrived=clock.now, deadline=clock.now + 1.0)
    b.submit(item)
    batch = b.take_now(0)
    assert batch is not None and batch.items == [item] and not item.future.done()


def test_the_least_recently_served_model_goes_first_among_due_queues(loop):
    clock = Clock(1000.0)
    b = make_batcher(clock, models=("busy", "quiet"))
    b.served_at = {"busy": clock.now - 0.05, "quiet": clock.now - 5.0}
    b.submit(make_item(loop, "busy", arrived=clock.now - 1.0, model="busy"))  # older head
    b.submit(make_item(loop, "quiet", arrived=clock.now - 0.5, model="quiet"))
    key, due, _ = b.most_urgent(clock.now)
    assert key == ("quiet", 0) and due <= clock.now


def test_ahead_of_counts_higher_tiers_and_a_fair_share_of_its_own(loop):
    clock = Clock(1000.0)
    b = make_batcher(clock)
    for _ in range(5):
        b.submit(make_item(loop, tier=ENT, tenant="e"))
    for _ in range(30):
        b.submit(make_item(loop, tier=PAID, tenant="flood"))
    # a new paid item of a quiet tenant waits behind every enterprise item and the flood's one turn
    assert b.ahead_of(PAID, "quiet") == 5 + 1
    b.submit(make_item(loop, tier=PAID, tenant="quiet"))
    # its second item waits behind the flood's item, its own first and the flood's second (the figure once
    # counted the new item itself too: 5 + 4)
    assert b.ahead_of(PAID, "quiet") == 5 + 3
    assert b.ahead_of(ENT, "e") == 5


# -- the pool: retries and bisection ------------------------------------------------------------------------
def make_pool(loop, b: Batcher, healthy: int = 2, demand: float = 0.0) -> GpuPool:
    pool = GpuPool({}, b, make_metrics(), loop, [f"d{i}" for i in range(healthy)], gpu_timeout_s=1.0, clock=b.clock)
    pool.workers = [DeviceWorker(i, f"d{i}") for i in range(healthy)]
    pool.demand = lambda: demand
    pool._update_health()
    return pool


def test_a_failed_batch_runs_one_half_alone_and_holds_the_other(loop):
    clock = Clock(1000.0)
    b = make_batcher(clock)
    pool = make_pool(loop, b)
    items = [make_item(loop, str(i), arrived=clock.now) for i in range(6)]
    pool._retry_or_fail(Batch("m", items, clock.now, "pace"), pool.workers[0], "boom", "error")
    (retry,) = b.retries.interactive
    assert [i.text for i in retry.items] == ["0", "1", "2"] and [i.text for i in retry.held] == ["3", "4", "5"]
    assert retry.avoid_worker == 0  # prefers another worker than the one that failed it


def test_a_failing_half_returns_its_held_sibling_to_the_queue(loop):
    clock = Clock(1000.0)
    b = make_batcher(clock)
    pool = make_pool(loop, b)
    half, held = [make_item(loop, "a"), make_item(loop, "b")], [make_item(loop, "c"), make_item(loop, "d")]
    pool._retry_or_fail(Batch("m", half, clock.now, "retry", held=held), pool.workers[1], "boom", "error")
    assert b.depth["m"] == 2  # the held half is presumed clean: back at the head of its queue
    (retry,) = b.retries.interactive
    assert [i.text for i in retry.items] == ["a"] and [i.text for i in retry.held] == ["b"]


def test_a_lone_failing_item_is_retried_once_elsewhere_then_fails(loop):
    clock = Clock(1000.0)
    b = make_batcher(clock)
    pool = make_pool(loop, b, healthy=2)
    item = make_item(loop, "poison")
    pool._retry_or_fail(Batch("m", [item], clock.now, "retry"), pool.workers[0], "boom", "error")
    assert len(b.retries.interactive) == 1 and item.attempts == 1 and not item.future.done()
    b.retries.interactive.clear()
    pool._retry_or_fail(Batch("m", [item], clock.now, "retry"), pool.workers[1], "boom", "error")
    assert not b.retries.interactive and item.future.exception().status == 500


def test_with_one_worker_a_lone_failing_item_fails_at_once(loop):
    clock = Clock(1000.0)
    b = make_batcher(clock)
    pool = make_pool(loop, b, healthy=1)
    item = make_item(loop, "poison")
    pool._retry_or_fail(Batch("m", [item], clock.now, "retry"), pool.workers[0], "boom", "error")
    assert item.future.exception().status == 500


def test_a_retry_avoids_the_worker_that_failed_it_for_two_batch_times(loop):
    clock = Clock(1000.0)
    b = make_batcher(clock)
    make_pool(loop, b, healthy=2)
    b.requeue(Batch("m", [make_item(loop)], clock.now, "retry", avoid_worker=0))
    assert b.take_retry(0, clock.now) is None
    clock.now += 2 * S + 0.001  # nobody else took it: the failing worker may run it after all
    assert b.take_retry(0, clock.now) is not None


def test_a_hung_batch_is_rerun_spread_over_the_workers_when_capacity_allows(loop):
    clock = Clock(1000.0)
    b = make_batcher(clock)
    pool = make_pool(loop, b, healthy=3, demand=10.0)
    items = [make_item(loop, str(i)) for i in range(9)]
    w = pool.workers[0]
    batch = Batch("m", items, clock.now, "pace")
    w.batch, w.started = batch, clock.now
    w.running, w.running_since = batch, clock.now  # what the worker thread notes as it begins the batch
    clock.now += 0.5
    pool._abandon(w, batch, 1.0)  # a timer firing early (or a stalled loop's late one) is no evidence
    assert w.healthy and not b.retries.interactive
    clock.now += 1.0
    pool._abandon(w, batch, 1.0)
    assert not w.healthy and pool.healthy_count() == 2
    assert len(b.retries.interactive) == 2 and all(r.after_hang for r in b.retries.interactive)
    assert sum(len(r.items) for r in b.retries.interactive) == 9


def test_a_hung_batch_is_answered_504_when_another_loss_would_not_be_absorbed(loop):
    clock = Clock(1000.0)
    b = make_batcher(clock)
    pool = make_pool(loop, b, healthy=2, demand=5000.0)  # far more arrivals than one worker could serve
    items = [make_item(loop, str(i)) for i in range(4)]
    w = pool.workers[0]
    batch = Batch("m", items, clock.now, "pace")
    w.batch, w.started = batch, clock.now
    w.running, w.running_since = batch, clock.now
    clock.now += 1.5
    pool._abandon(w, batch, 1.0)
    assert not b.retries.interactive and all(i.future.exception().status == 504 for i in items)


# -- admission ---------------------------------------------------------------------------------------------
class FakeCapacity:
    def __init__(self, healthy: int = 1, workers: int = 1, until_free: float = 0.0) -> None:
        self.healthy, self.workers, self.until_free = healthy, workers, until_free

    def healthy_count(self) -> int:
        return self.healthy

    def worker_count(self) -> int:
        return self.workers

    def seconds_until_free(self, now: float) -> float:
        return self.until_free


def test_predicted_latency_counts_full_batches_ahead_shared_by_the_workers():
    assert predicted_latency_s(0.0, 0, 100, 0.1, 1) == pytest.approx(0.1)
    assert predicted_latency_s(0.05, 250, 100, 0.1, 1) == pytest.approx(0.05 + 0.2 + 0.1)
    assert predicted_latency_s(0.0, 400, 100, 0.1, 4) == pytest.approx(0.1 + 0.1)


def make_admission(loop, clock: Clock, capacity: FakeCapacity, queued: int = 0, max_queue: int = 10000):
    b = make_batcher(clock, workers=capacity.healthy)
    for _ in range(queued):
        b.submit(make_item(loop, arrived=clock.now))
    return Admission(b, capacity, max_queue, slo_s=0.2, slack=1.25, clock=clock)


def test_admission_refuses_what_would_miss_the_deadline(loop):
    clock = Clock(1000.0)
    adm = make_admission(loop, clock, FakeCapacity(until_free=0.05), queued=300)
    with pytest.raises(ApiError) as refused:
        adm.admit_ticket("m", PAID, "t", deadline_s=0.3)  # predicted 0.05 + 0.3 + 0.1 = 0.45 s
    assert refused.value.status == 503 and refused.value.code == "SERVICE_OVERLOADED"
    assert refused.value.retry_after_ms > 0
    adm.admit_ticket("m", PAID, "t", deadline_s=1.0)  # the same wait fits a longer deadline


def test_a_stale_slow_batch_time_does_not_refuse_what_a_free_worker_can_try(loop):
    # S learned from one slow batch (2.5 s) against a seed of 0.1 s: a 1 s deadline is not unmeetable, and with
    # a free worker and nothing ahead the item is admitted (its run corrects S); with work ahead it is refused.
    clock = Clock(1000.0)
    adm = make_admission(loop, clock, FakeCapacity())
    adm.max_timeout_s = 0.08  # no timeout a caller may ask for fits one batch: not the caller's fault
    adm.batcher.batch_s.observe("m", 1, 2.5)
    assert adm.admit_ticket("m", PAID, "t", deadline_s=1.0).probe is False  # admitted, not as a probe
    # Below even the seed: no batch can meet it, unless the seed is wrong too; one such request now and then
    # (an idle worker, none in the last PROBE_EVERY_S) runs as a probe, and the figure learns from it.
    assert adm.admit_ticket("m", PAID, "t", deadline_s=0.05).probe is True
    with pytest.raises(ApiError) as refused:
        adm.admit_ticket("m", PAID, "t", deadline_s=0.05)  # the next one within the interval is refused
    assert refused.value.status == 504
    clock.now += PROBE_EVERY_S
    assert adm.admit_ticket("m", PAID, "t", deadline_s=0.05).probe is True
    busy = make_admission(loop, clock, FakeCapacity(until_free=0.05))
    busy.batcher.batch_s.observe("m", 1, 2.5)
    with pytest.raises(ApiError) as refused:
        busy.admit_ticket("m", PAID, "t", deadline_s=1.0)
    assert refused.value.status == 503


def test_a_burst_within_capacity_is_queued_not_shed(loop):
    clock = Clock(1000.0)
    adm = make_admission(loop, clock, FakeCapacity(until_free=0.05), queued=150)
    adm.admit_ticket("m", FREE, "t", deadline_s=2.0)  # predicted 0.25 s > free's bound 0.2 s, but no pressure


def test_under_pressure_lower_tiers_are_shed_first(loop):
    clock = Clock(1000.0)
    # A worker lost is pressure. Predicted 0.05 + 1 full batch (0.1) + 0.1 = 0.25 s:
    adm = make_admission(loop, clock, FakeCapacity(healthy=1, workers=2, until_free=0.05), queued=150)
    assert adm.tier_bound_s(FREE) < 0.25 < adm.tier_bound_s(ENT)
    with pytest.raises(ApiError):
        adm.admit_ticket("m", FREE, "t", deadline_s=2.0)  # bound 0.2 s
    adm.admit_ticket("m", ENT, "t", deadline_s=2.0)  # bound 0.3 s


def test_a_flood_is_pressure_within_a_quarter_second(loop):
    clock = Clock(1000.0)
    adm = make_admission(loop, clock, FakeCapacity())  # capacity 100 / 0.1 s = 1000 per second
    for _ in range(600):  # 600 arrivals in 0.2 s: 3000 per second
        clock.now += 0.2 / 600
        adm.arrivals.tick(clock.now)
        adm.arrivals_fast.tick(clock.now)
    slow, fast = adm.arrivals.current(clock.now), adm.arrivals_fast.current(clock.now)
    assert slow < 1000 < fast  # the 2 s average has not seen it yet, the 0.25 s one has
    assert adm.under_pressure("m", slow, fast)


def test_admission_says_why_nothing_can_be_admitted(loop):
    clock = Clock(1000.0)
    adm = make_admission(loop, clock, FakeCapacity(healthy=0, workers=2))
    with pytest.raises(ApiError) as none:
        adm.admit_ticket("m", PAID, "t", 1.0)
    assert none.value.code == "NO_HEALTHY_WORKER"
    adm.capacity = None
    with pytest.raises(ApiError) as warming:
        adm.admit_ticket("m", PAID, "t", 1.0)
    assert warming.value.code == "NO_HEALTHY_WORKER" and "warming up" in warming.value.message
    adm.batcher.start_drain()
    with pytest.raises(ApiError) as draining:
        adm.admit_ticket("m", PAID, "t", 1.0)
    assert draining.value.code == "DRAINING"


def test_a_full_queue_is_refused(loop):
    clock = Clock(1000.0)
    adm = make_admission(loop, clock, FakeCapacity(), queued=5, max_queue=5)
    with pytest.raises(ApiError) as full:
        adm.admit_ticket("m", ENT, "t", 60.0)
    assert "queue" in full.value.message


def test_a_batch_freed_early_makes_the_next_dispatch_due_on_the_injected_clock():
    """`freed_early` once read time.monotonic() past the injected clock: on any clock but the real one the pace
    was left where it was (issue 23)."""
    clock = Clock(now=1e9)  # far from the real monotonic clock, so reading it shows
    b = make_batcher(clock, workers=2)
    b.last_dispatch = clock()
    b.freed_early("m")
    assert b.last_dispatch == pytest.approx(clock() - S / 2)  # one pace interval back: due now


def test_a_timeout_shorter_than_one_batch_is_the_requests_fault_when_a_longer_one_may_be_asked(loop):
    # S = 0.1 s, margin 5 ms: a 50 ms timeout cannot be met by any batch. With --max-timeout-ms above 105 ms the
    # caller can ask for enough: a 400 naming it, every time (no probe); the least timeout itself is admitted.
    clock = Clock(1000.0)
    adm = make_admission(loop, clock, FakeCapacity())
    adm.max_timeout_s = 60.0
    for _ in range(2):
        with pytest.raises(ApiError) as refused:
            adm.admit_ticket("m", PAID, "t", deadline_s=0.05)
        assert (refused.value.status, refused.value.code) == (400, "TIMEOUT_TOO_SHORT")
        assert refused.value.message.endswith("ask for at least 105 ms")
    assert adm.admit_ticket("m", PAID, "t", deadline_s=0.1051).probe is False
