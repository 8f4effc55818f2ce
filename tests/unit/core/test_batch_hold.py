"""Holding a free worker's batch while the load is high (issue 36, `core/batch_hold.py`), on an injected clock.

The device below is CPU-like: a batch takes 20 ms plus 10 ms per input, so an input costs 30 ms alone and ~10 ms
in a batch of 64: waiting for company pays only when the inputs come fast enough that the worker would
otherwise be busy most of the time with small batches."""

from __future__ import annotations

import math
import random

import pytest

from batchserve.core import batch_hold
from batchserve.core.batch_hold import (
    BUSY_HOLD,
    BUSY_MAX,
    EFFICIENT_WITHIN,
    HOLD_BATCHES,
    SLO_SHARE,
    Arrivals,
    greedy_busy,
    hold_until,
)
from batchserve.core.batch import BatchTimes
from batchserve.core.batcher import Batcher
from batchserve.core.batch_hold import Bursts
from batchserve.core.fairqueue import Item
from tests.unit.fakes import Clock

M = "m"
FIXED_S, PER_INPUT_S = 0.020, 0.010


def cpu_s(k: float) -> float:
    return FIXED_S + PER_INPUT_S * k


def cpu_like(max_batch: int = 64) -> BatchTimes:
    times = BatchTimes(max_batch, {M: cpu_s(1)})
    for k in (1, 2, 4, 8, 16, 32, 64):
        times.observe(M, k, cpu_s(k))
    return times


def make_batcher(clock: Clock, slo_s: float = 1.0, max_batch: int = 64, times: BatchTimes | None = None) -> Batcher:
    b = Batcher(
        max_batch_size=max_batch,
        slo_s=slo_s,
        margin_s=0.005,
        batch_s=times if times is not None else cpu_like(max_batch),
        healthy_workers=1,
        clock=clock,
    )
    b.bursts[M] = Bursts(share=0.0)  # inputs here come at one instant by construction: no burst prior
    return b


def make_item(loop, arrived: float, text: str = "x", deadline: float = 1e9) -> Item:
    return Item(text, M, 0, loop.create_future(), arrived, deadline, None, 1, "t")


# -- the rule on numbers --------------------------------------------------------------------------------------
# A full batch: 20 + 640 ms for 64, 10.3 ms an input; within 15 % of that from 11 inputs (0.02 / k + 0.01 <= 0.01186).
EFFICIENT = 11


def test_the_efficient_size_is_where_the_cost_per_input_flattens() -> None:
    best = (1 + EFFICIENT_WITHIN) * cpu_s(64) / 64
    assert cpu_s(EFFICIENT) / EFFICIENT <= best < cpu_s(EFFICIENT - 1) / (EFFICIENT - 1)


def test_greedy_busy_is_the_share_of_time_small_batches_keep_the_worker() -> None:
    assert greedy_busy(4.0, 64, cpu_s) == pytest.approx(4 * cpu_s(1))  # batches of 1, 12 % of the time
    # 45/s: batches settle at 2 (45 x 40 ms = 1.8 <= 2), the worker busy 90 % of the time
    assert greedy_busy(45.0, 64, cpu_s) == pytest.approx(45 * cpu_s(2) / 2)
    assert greedy_busy(120.0, 64, cpu_s) == math.inf  # past what full batches serve (97/s)


def test_low_load_goes_at_once() -> None:
    assert greedy_busy(5.0, 64, cpu_s) <= BUSY_HOLD
    assert hold_until(10.0, 10.0, 1, 64, cpu_s, 5.0, 5.0, 1, 1.0) == 10.0


def test_high_load_waits_for_the_batch_whose_cost_per_input_has_flattened() -> None:
    rate = 45.0
    assert greedy_busy(rate, 64, cpu_s) > BUSY_HOLD
    got = hold_until(10.0, 10.0, 8, 64, cpu_s, rate, rate, 1, 1.0)
    assert got == pytest.approx(10.0 + (EFFICIENT - 8) / rate)  # when its 11th input is expected
    assert hold_until(10.0, 10.0, EFFICIENT, 64, cpu_s, rate, rate, 1, 1.0) == 10.0  # there: at once


def test_a_hold_lasts_two_batch_times_at_most() -> None:
    # 9 more inputs at 30/s would take 300 ms; the batch of 11 runs 130 ms: about what its inputs would have
    # waited behind a running batch, and all the end of a burst (arrivals that stop) waits for company
    assert HOLD_BATCHES * cpu_s(EFFICIENT) < (EFFICIENT - 2) / 30.0
    assert hold_until(10.0, 10.0, 2, 64, cpu_s, 45.0, 30.0, 1, 1.0) == pytest.approx(
        10.0 + HOLD_BATCHES * cpu_s(EFFICIENT)
    )


def test_a_queue_of_one_length_class_waits_at_its_own_rate() -> None:
    # The model's 45/s make the load; this class receives 30 of them, so its 3 more take 100 ms
    got = hold_until(10.0, 10.0, 8, 64, cpu_s, 45.0, 30.0, 1, 1.0)
    assert got == pytest.approx(10.0 + (EFFICIENT - 8) / 30.0)


def test_the_held_batch_ends_within_its_share_of_the_slo() -> None:
    # SLO 300 ms: the 11th input would come too late; it waits for the largest batch that, formed when its last
    # input is expected, ends SLO_SHARE x slo after the oldest input arrived.
    rate, slo, oldest, now = 45.0, 0.3, 10.0, 10.02
    got = hold_until(now, oldest, 2, 64, cpu_s, rate, rate, 1, slo)
    k = round(2 + (got - now) * rate)  # the batch it waits for
    assert 2 < k < EFFICIENT
    assert got + cpu_s(k) <= oldest + SLO_SHARE * slo + 1e-9
    assert (got + 1 / rate) + cpu_s(k + 1) > oldest + SLO_SHARE * slo  # one more input would not fit
    # once no larger batch fits: at once
    late = oldest + SLO_SHARE * slo - cpu_s(3)
    assert hold_until(late, oldest, 3, 64, cpu_s, rate, rate, 1, slo) == late


def test_no_hold_near_capacity() -> None:
    # 80/s: batches of 11 would still keep the worker 80 x 130 ms / 11 = 95 % busy: no time to idle while they
    # fill (a full batch serves 97/s), so what waits goes now and the backlog alone grows the batches
    assert greedy_busy(80.0, 64, cpu_s) > BUSY_HOLD
    assert 80.0 * cpu_s(EFFICIENT) / EFFICIENT > BUSY_MAX
    assert hold_until(10.0, 10.0, 4, 64, cpu_s, 80.0, 80.0, 1, 1.0) == 10.0
    assert hold_until(10.0, 10.0, 4, 64, cpu_s, 60.0, 60.0, 1, 1.0) > 10.0  # 71 %: time to spare


def test_no_hold_when_a_larger_batch_is_no_cheaper_per_input() -> None:
    # A device whose time is proportional to its inputs (no fixed part): waiting gains nothing.
    def proportional(k: float) -> float:
        return 0.015 * k

    assert greedy_busy(60.0, 64, proportional) > BUSY_HOLD
    assert hold_until(10.0, 10.0, 2, 64, proportional, 60.0, 60.0, 1, 1.0) == 10.0


def test_a_full_batch_and_unknown_rates_go_at_once() -> None:
    assert hold_until(10.0, 10.0, 64, 64, cpu_s, 90.0, 90.0, 1, 1.0) == 10.0
    assert hold_until(10.0, 10.0, 2, 64, cpu_s, 0.0, 0.0, 1, 1.0) == 10.0


def test_several_workers_share_the_load() -> None:
    # 45/s over 4 workers is ~11/s each: batches of 1 keep each busy a third of the time
    assert hold_until(10.0, 10.0, 1, 64, cpu_s, 45.0, 45.0, 4, 1.0) == 10.0
    assert hold_until(10.0, 10.0, 1, 64, cpu_s, 45.0, 45.0, 1, 1.0) > 10.0


def test_arrivals_decay_between_batches() -> None:
    a = Arrivals(tau_s=1.0)
    assert a.current(5.0) == 0.0
    a.tick(5.0, 10)
    assert a.current(5.0) == pytest.approx(10.0)
    assert a.current(6.0) == pytest.approx(10.0 * math.exp(-1))


# -- the batcher with it ----------------------------------------------------------------------------------------
def run_one_worker(
    loop, rate: float, seconds: float, slo_s: float = 1.0, seed: int = 3
) -> tuple[list[int], list[float]]:
    """One worker pulling batches (`take_now` when it frees, else at the batcher's next due time) from Poisson
    arrivals at `rate`, each batch taking cpu_s(its size): the batch sizes and every input's latency."""
    clock = Clock(1000.0)
    b = make_batcher(clock, slo_s=slo_s)
    rng = random.Random(seed)
    arrivals, t = [], clock.now
    while t < 1000.0 + seconds:
        t += rng.expovariate(rate)
        arrivals.append(t)
    sizes: list[int] = []
    latencies: list[float] = []
    free_at, i = clock.now, 0
    step = 0.001
    while clock.now < 1000.0 + seconds:
        clock.now += step
        while i < len(arrivals) and arrivals[i] <= clock.now:
            b.submit(make_item(loop, arrivals[i]))
            i += 1
        if clock.now < free_at:
            continue
        batch = b.take_now(0)
        if batch is None:
            continue
        end = clock.now + cpu_s(len(batch.items))
        sizes.append(len(batch.items))
        latencies += [end - item.arrived for item in batch.items]
        free_at = end
    return sizes, latencies


def p95(xs: list[float]) -> float:
    return sorted(xs)[int(0.95 * (len(xs) - 1))]


def test_under_high_load_one_worker_runs_larger_batches_within_the_slo(loop) -> None:
    # 45/s: taking what waits whenever it frees, the worker runs batches of ~2 back to back (busy ~90 %)
    sizes, latencies = run_one_worker(loop, 45.0, 20.0)
    mean = sum(sizes) / len(sizes)
    busy = sum(cpu_s(k) for k in sizes) / 20.0
    assert mean >= 6, mean
    assert busy < 0.75, busy
    assert p95(latencies) <= 1.0 * SLO_SHARE + 0.1  # within the SLO, about its share
    assert max(latencies) <= 1.0


def test_under_low_load_each_input_goes_at_once(loop) -> None:
    sizes, latencies = run_one_worker(loop, 4.0, 20.0)
    assert sum(sizes) / len(sizes) < 1.2
    assert p95(latencies) < 2 * cpu_s(1) + 0.005


def test_a_held_batch_is_counted_as_a_hold_and_a_full_queue_goes_at_once(loop) -> None:
    clock = Clock(1000.0)
    b = make_batcher(clock)
    for _ in range(80):  # two seconds of 40/s, the worker taking what it may: the batcher learns the rate
        b.submit(make_item(loop, clock.now))
        clock.now += 0.025
        b.take_now(0)
    assert b.holds.model_arrivals[M].current(clock.now) > 20
    while b.take_now(0) is not None:
        pass
    clock.now = max([clock.now, *(due for _, due in b.holds.held.values())])
    while b.take_now(0) is not None:  # whatever was held goes: an empty queue
        pass
    assert b.depth[M] == 0
    for _ in range(2):
        b.submit(make_item(loop, clock.now))
    assert b.take_now(0) is None  # held: a larger batch would serve its inputs for much less
    key, due, cause = b.most_urgent(clock.now)
    assert cause == "hold" and due > clock.now
    clock.now = due
    for _ in range(10):
        b.submit(make_item(loop, clock.now))
    batch = b.take_now(0)
    assert batch is not None and batch.cause == "hold" and len(batch.items) == 12
    for _ in range(64):
        b.submit(make_item(loop, clock.now))
    batch = b.take_now(0)
    assert batch is not None and batch.cause == "full" and len(batch.items) == 64


def test_the_dispatch_deadline_still_bounds_a_hold(loop) -> None:
    # SLO 120 ms: the dispatch deadline (120 - S - 5 ms) comes before any hold could end
    clock = Clock(1000.0)
    b = make_batcher(clock, slo_s=0.12)
    b.holds.arrivals[(M, 0)] = Arrivals(rate=80.0, last=clock.now)
    b.holds.model_arrivals[M] = Arrivals(rate=80.0, last=clock.now)
    for _ in range(2):
        b.submit(make_item(loop, clock.now))
    _, due, cause = b.most_urgent(clock.now)
    assert due <= clock.now + 0.12 - cpu_s(2) - 0.005 + 1e-9
    assert cause in ("deadline", "pace")


def test_without_the_hold_module_rule_batches_stay_small(loop, monkeypatch) -> None:
    """The same run as above with the hold switched off (the rule before issue 36): small batches, the worker
    nearly always busy. Shows what the rule changes, and that the run above measures it."""
    monkeypatch.setattr(batch_hold, "BUSY_HOLD", math.inf)
    sizes, _ = run_one_worker(loop, 45.0, 20.0)
    assert sum(sizes) / len(sizes) < 4


def test_a_hold_is_decided_once_per_batch(loop) -> None:
    """The end of a burst: two inputs held for company at 60/s that then stops coming go when that one wait
    ends, not after another and another (each new look at the still high rate would hold them again)."""
    clock = Clock(1000.0)
    b = make_batcher(clock)
    b.holds.arrivals[(M, 0)] = Arrivals(rate=60.0, last=clock.now)
    b.holds.model_arrivals[M] = Arrivals(rate=60.0, last=clock.now)
    for _ in range(2):
        b.submit(make_item(loop, clock.now))
    assert b.take_now(0) is None
    _, due, cause = b.most_urgent(clock.now)
    # 60/s, and the two inputs queued since the last batch counted too (over the rate's 1 s horizon)
    assert cause == "hold" and due == pytest.approx(clock.now + (EFFICIENT - 2) / 62.0)
    clock.now = due
    assert (
        hold_until(
            clock.now,
            1000.0,
            2,
            64,
            cpu_s,
            b.holds.model_arrivals[M].current(clock.now),
            b.holds.arrivals[(M, 0)].current(clock.now),
            1,
            1.0,
        )
        > clock.now
    )  # a new look would hold again
    batch = b.take_now(0)
    assert batch is not None and batch.cause == "hold" and len(batch.items) == 2


def test_a_flat_batch_time_never_holds_at_a_small_share_of_capacity() -> None:
    # A GPU-like device (the sim): 100 ms whatever the batch. At 20/s taking what waits keeps it "busy" (batches
    # of 2 back to back), but full batches would serve 1,000/s: waiting buys nothing, and every answer would pay it.
    def flat(k: float) -> float:
        return 0.1

    assert greedy_busy(20.0, 100, flat) > BUSY_HOLD
    assert hold_until(10.0, 10.0, 2, 100, flat, 20.0, 20.0, 1, 0.3) == 10.0
    assert hold_until(10.0, 10.0, 2, 100, flat, 20.0, 20.0, 1, 1.0) == 10.0
