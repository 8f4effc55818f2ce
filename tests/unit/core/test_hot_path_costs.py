"""What the request path must not pay per request (issue 23, item 5): in-process, no server, injected clock.

Admission asks the pool, for every request, how long the running batch has left. That batch's cost is fixed
once it is handed to its worker; computing it again walked every item of the batch (~100 at 900 requests/s),
or, for a model with `cost_of_batch`, ran the backend's costing over all its texts, once per request. And an
anonymous caller's identity is the same object for every request from its address, and a deadline's lane
is keyed once per timeout value.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import pytest

from batchserve.core.batcher import Batcher
from batchserve.core.batch import Batch, BatchTimes
from batchserve.errors import ApiError
from batchserve.core.work import KEYS_KEPT, DeadlineWatch
from batchserve.core.fairqueue import Item
from batchserve.gpu_pool import GpuPool, DeviceWorker
from batchserve.metrics import make_metrics
from batchserve.http.guards import ANONYMOUS_CACHE, Tenancy
from tests.unit.fakes import Clock

M = "m@v1"


class CountingCost:
    """A backend's `cost_of_batch` that counts its calls: 1 per token-ish character."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, texts: list[str]) -> float:
        self.calls += 1
        return float(sum(len(t) for t in texts))


def test_the_running_batch_is_costed_once_when_handed_not_on_every_admission(loop) -> None:
    clock = Clock()
    times = BatchTimes(100, {M: 0.1})
    batcher = Batcher(max_batch_size=100, slo_s=1.0, margin_s=0.01, batch_s=times, clock=clock)
    pool = GpuPool({}, batcher, make_metrics(), loop, ["gpu:0"], clock=clock)
    worker = DeviceWorker(0, "gpu:0")
    pool.workers.append(worker)
    costing = CountingCost()
    items = [
        Item(f"input {i:03d}", M, 0, loop.create_future(), arrived=clock.t, deadline=clock.t + 60, batch_cost=costing)
        for i in range(100)
    ]
    batch = Batch(M, items, clock.t, "full")
    pool._hand(worker, batch)
    handed = costing.calls
    assert handed >= 1  # the hand-off costs it (the watchdog's limit, and what the worker runs)
    expected = times.at(M, batch.cost)
    clock.t += 0.03
    for _ in range(50):  # fifty admissions while the batch runs
        assert pool.seconds_until_free(clock.t) == pytest.approx(expected - 0.03)
    assert costing.calls == handed + 1  # the one `batch.cost` above, not one per admission
    assert worker.watchdog is not None
    worker.watchdog.cancel()


def test_an_anonymous_caller_is_built_once_per_address_and_the_cache_stays_bounded() -> None:
    tenancy = Tenancy()
    first = tenancy.identify(None, "10.0.0.1")
    assert first.owner == "anonymous@10.0.0.1" and first.tenant == "anonymous" and first.key_id == ""
    assert tenancy.identify(None, "10.0.0.1") is first  # no new Caller per request
    assert tenancy.identify("", "10.0.0.1") is first  # an empty Authorization header is no key either
    for i in range(ANONYMOUS_CACHE + 10):  # a sweep of addresses
        assert tenancy.identify(None, f"10.1.{i // 256}.{i % 256}").owner == f"anonymous@10.1.{i // 256}.{i % 256}"
    assert len(tenancy._anonymous) <= ANONYMOUS_CACHE
    assert tenancy.identify(None, "10.0.0.2").owner == "anonymous@10.0.0.2"


def test_deadlines_group_callers_by_timeout_and_answer_504_at_the_deadline(loop) -> None:
    async def scenario() -> None:
        watch = DeadlineWatch()
        now = time.monotonic()
        late, answered, close, later = (loop.create_future() for _ in range(4))
        watch.watch(0.05, now + 0.05, late)
        watch.watch(0.05, now + 0.05, answered)
        watch.watch(0.0504, now + 0.0504, close)  # the same lane as 0.05 (timeouts are keyed to the ms)
        watch.watch(5.0, now + 5.0, later)
        answered.set_result("ok")
        assert len(watch._timers) == 2  # one timer per timeout value, not per caller
        await asyncio.sleep(0.15)
        for fut in (late, close):
            assert isinstance(fut.exception(), ApiError) and fut.exception().code == "DEADLINE_EXCEEDED"
        assert answered.result() == "ok" and not later.done()
        for i in range(KEYS_KEPT + 50):  # callers may send any timeout: what is remembered stays bounded
            watch.watch(10 + i / 1000, now + 10, later)
        assert len(watch._keys) <= KEYS_KEPT
        for timer in watch._timers.values():
            timer.cancel()

    loop.run_until_complete(scenario())


def test_answered_callers_leave_their_deadline_lane_as_others_are_watched(loop) -> None:
    """A lane keeps about the callers still waiting, not every caller of the last timeout: an answered future
    (and its answer) at the head is let go when the next caller is watched, so nothing of a request answered
    long before its 30 s deadline stays alive for the collector to scan. One still waiting keeps its place,
    and those behind it wait for it (the lane stays in deadline order); its 504 still comes at its deadline."""

    async def scenario() -> None:
        watch = DeadlineWatch()
        now = time.monotonic()
        futures = [loop.create_future() for _ in range(1000)]
        for i, fut in enumerate(futures):
            watch.watch(30.0, now + i * 1e-6, fut)
            if i >= 2:
                futures[i - 2].set_result("answered")  # two in flight at a time
        assert watch.pending() <= 3
        slow = loop.create_future()
        watch.watch(0.05, now + 0.05, slow)  # waits; those behind it are answered at once
        for _ in range(100):
            fut = loop.create_future()
            watch.watch(0.05, now + 0.05, fut)
            fut.set_result("answered")
        assert watch.pending() <= 3 + 101
        await asyncio.sleep(0.1)
        assert isinstance(slow.exception(), ApiError) and slow.exception().code == "DEADLINE_EXCEEDED"
        for timer in watch._timers.values():
            timer.cancel()

    loop.run_until_complete(scenario())


class Unwalkable(deque):
    """A lane's items that fail the test if anything walks them."""

    def __iter__(self):
        raise AssertionError("the queue was walked")


def test_a_tenants_share_is_read_without_walking_the_queue(loop) -> None:
    """Issue 33: the door asks, per request, what a new input waits behind by cost (its tenant's share). That is
    read off the model's counters (`Shares`), kept as items come and go, never by walking the queued items."""
    clock = Clock()
    b = Batcher(max_batch_size=64, slo_s=1.0, margin_s=0.01, batch_s=BatchTimes(64, {M: 0.1}), clock=clock)
    for _ in range(2000):
        b.submit(
            Item("l", M, 1, loop.create_future(), arrived=clock.t, deadline=clock.t + 60, tenant="long", cost=220.0)
        )
        b.submit(
            Item("s", M, 0, loop.create_future(), arrived=clock.t, deadline=clock.t + 60, tenant="short", cost=8.0)
        )
    for q in b.queues.values():
        for lane in q.lanes.values():
            lane.items = Unwalkable(lane.items)
    assert b.ahead_of(1, "long", M, 220.0) == 4000  # over its share: behind everything
    assert b.ahead_of(1, "short", M, 8.0) < 2200  # under it: its own and as much of long's
    assert b.ahead_of(1, "new", M, 8.0) < 10  # a newcomer: one input's worth of each


def test_a_batchs_queue_waits_observed_at_once_count_as_one_by_one() -> None:
    """The worker's hand-off observes every item's queue wait with one call (`observe_all`): the same buckets
    and sum as observing them one by one."""
    from batchserve.metrics import HistogramChild

    waits = [0.0005, 0.01, 0.01, 0.2, 0.0, 3.5, 12.0, 0.049999]
    one, all_ = HistogramChild((0.001, 0.01, 0.05, 0.1, 1.0, 10.0)), HistogramChild((0.001, 0.01, 0.05, 0.1, 1.0, 10.0))
    for w in waits:
        one.observe(w)
    all_.observe_all(waits)
    assert all_.counts == one.counts and all_.sum == one.sum
    assert all_.counts == [2, 2, 1, 0, 1, 1, 1]  # le 0.001, 0.01, 0.05, 0.1, 1, 10, +Inf
