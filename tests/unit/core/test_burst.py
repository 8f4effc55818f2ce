"""A burst rides one batch (`core/batch_hold.py`): the rule on arrival times, then the batcher on an injected clock."""

from __future__ import annotations

import math
import random

import pytest

from batchserve.core.batch import BatchTimes
from batchserve.core.batcher import Batcher
from batchserve.core.batch_hold import GAP_MAX_S, QUIET_MIN_S, WINDOW_BATCH_SHARE, WINDOW_MAX_S, Bursts
from batchserve.core.fairqueue import Item
from tests.unit.fakes import Clock

M = "m"


def bursts_of(size: int, gap_s: float, every_s: float, count: int, start: float = 100.0) -> Bursts:
    b = Bursts()
    for i in range(count):
        for j in range(size):
            b.arrived(start + i * every_s + j * gap_s)
    return b


def test_spread_arrivals_hold_nothing() -> None:
    rng = random.Random(7)
    for rate in (10.0, 20.0, 50.0):  # Poisson: a gap under GAP_MAX_S is rare at these rates
        b, t = Bursts(), 100.0
        for _ in range(500):
            t += rng.expovariate(rate)
            b.arrived(t)
        assert b.until(t, 0.1) == -math.inf, rate


def test_a_burst_waits_for_its_quiet_then_goes() -> None:
    b = bursts_of(10, 0.0003, 1.0, 20)  # 10 users answered together, paced at 1/s
    last = 100.0 + 19 + 9 * 0.0003
    due = b.until(100.0 + 19, 0.1)
    assert last + QUIET_MIN_S <= due <= last + GAP_MAX_S  # a few typical gaps after the latest input
    assert due <= 100.0 + 19 + WINDOW_BATCH_SHARE * 0.1


def test_a_burst_never_holds_past_its_window_from_the_oldest_input() -> None:
    b = bursts_of(20, 0.0009, 1.0, 5)  # bursts of 20 over 17 ms
    oldest = 100.0 + 4
    assert b.until(oldest, 0.05) == pytest.approx(oldest + WINDOW_BATCH_SHARE * 0.05)  # a share of a short batch
    assert b.until(oldest, 10.0) <= oldest + WINDOW_MAX_S  # at most WINDOW_MAX_S of a long one
    # an input that waited through a running batch: its window has long passed
    assert b.until(oldest - 0.1, 0.1) < oldest
    # close arrivals for longer than any window: a stream, not a burst
    assert bursts_of(200, 0.0009, 1.0, 5).until(oldest, 10.0) == -math.inf


def test_out_of_order_arrivals_count_as_no_gap() -> None:
    b = Bursts()
    for t in (1.0, 1.0005, 1.0002, 1.0007):  # the door stamps first bytes; submits can come a hair out of order
        b.arrived(t)
    assert b.last == 1.0007 and b.gap_s >= 0.0


def items(loop, times: list[float]) -> list[Item]:
    return [Item(f"x{i}", M, 0, loop.create_future(), t, t + 10, None, 1, "t") for i, t in enumerate(times)]


def batcher(clock: Clock) -> Batcher:
    return Batcher(100, 0.2, 0.005, BatchTimes(100, {M: 0.1}), healthy_workers=1, clock=clock)


@pytest.mark.parametrize("bursty", [True, False])
def test_an_idle_device_takes_a_whole_burst_in_one_batch(loop, bursty: bool) -> None:
    """Closed-loop users answered together send together: an idle device's first look at a burst waits for the
    rest of it, where arrivals that are spread go at once (a lone input answered at once, as before)."""
    clock = Clock(1000.0)
    b = batcher(clock)
    # bursts of 10 before, or lone inputs a second apart
    warm = bursts_of(10, 0.0003, 1.0, 20, start=900.0) if bursty else bursts_of(1, 0.0, 1.0, 20, start=900.0)
    b.bursts[M] = warm
    burst = items(loop, [clock.now + j * 0.0003 for j in range(10)])
    b.submit(burst[0])
    key, due, cause = b.most_urgent(clock.now)
    if not bursty:
        assert due <= clock.now and cause == "pace"
        return
    assert cause == "burst" and clock.now < due <= clock.now + WINDOW_BATCH_SHARE * 0.1
    for it in burst[1:]:
        clock.t = it.arrived
        b.submit(it)
        assert b.most_urgent(clock.now)[1] > clock.now  # still coming: still waiting
    clock.t = b.most_urgent(clock.now)[1]
    key, due, cause = b.most_urgent(clock.now)
    assert due <= clock.now and key is not None
    batch = b.form(key, clock.now, cause, due)
    assert batch is not None and [i.text for i in batch.items] == [i.text for i in burst]


def test_a_fresh_servers_first_burst_rides_one_batch_and_a_lone_input_waits_one_quiet_at_most() -> None:
    b = Bursts()
    b.arrived(50.0)
    assert 50.0 < b.until(50.0, 0.1) <= 50.0 + GAP_MAX_S  # the first input: it may be a burst's
    b.arrived(50.0003)
    assert b.until(50.0, 0.1) > 50.0003  # it is: the worker waits for the rest
    lone = Bursts()
    for t in (10.0, 11.0, 12.0):  # inputs a second apart: not bursts, after the second of them
        lone.arrived(t)
    assert lone.until(12.0, 0.1) == -math.inf


def test_a_stream_that_never_goes_quiet_is_no_burst() -> None:
    # Poisson at 1,800/s: gaps of 0.55 ms on average, never 8 ms of quiet. Waiting for a quiet that does not come
    # would hold every free worker for the whole window.
    rng = random.Random(3)
    b, t = Bursts(), 100.0
    for _ in range(400):
        t += rng.expovariate(1800.0)
        b.arrived(t)
    assert b.share > 0.9 and b.until(t - 0.001, 0.1) == -math.inf
