"""The batch's size and cost model (`core/batch.py`, split out of the batcher in issue 35 item 5): what one
batch of a model may hold and cost, the mean input cost it is read at, the budget lowered to fit the time bounds,
and the padded cost of a queue's rows. Numbers only: no queue, no loop, no clock (the batch times are learned
from the observations the tests make). The batcher's own use of it (batches filled to the budget, the door's
predictions) is tests/unit/core/test_cost.py; the flush ladder's two callers are at the end."""

from __future__ import annotations

import asyncio
import math

import pytest

from batchserve.core.batch import ROW_ALPHA, UNIT_ALPHA, BatchBudget, BatchTimes
from batchserve.core.batcher import Batcher
from batchserve.core.fairqueue import Item
from tests.unit.fakes import Clock, token_s

M = "m@v1"


def learned() -> BatchTimes:
    """A token model's line: 10 ms plus 0.5 ms a token, measured at 200 and 3,200 tokens."""
    times = BatchTimes(100, {M: token_s(200)})
    times.observe(M, 200, token_s(200))
    times.observe(M, 3200, token_s(3200))
    return times


def test_a_count_model_has_no_budget_and_a_full_batch_is_its_limit() -> None:
    costs = BatchBudget(100, BatchTimes(100, {M: 0.1}))
    for _ in range(10):
        costs.note_cost(M, 1.0)
    assert M not in costs.unit and M not in costs.batch_s.caps  # left exactly as a count model
    assert costs.budget(M) == math.inf and costs.full_n(M) == 100 and costs.limit(M) == 100
    assert costs.estimate_cost(M, 40) == 40.0
    costs.model_limits[M] = 32  # a plugin's own lower batch size
    assert costs.limit(M) == 32 and costs.full_n(M) == 32
    assert costs.shape(M) == (32, math.inf, 32)  # the door's one read of the three
    assert costs.too_costly(M, 1.0) is None


def test_the_budget_is_the_lower_of_the_configured_one_and_the_one_lowered_to_fit() -> None:
    costs = BatchBudget(100, BatchTimes(100, {M: 0.1}), max_batch_cost=4000)
    assert costs.budget(M) == 4000
    costs.cost_limits[M] = 1000
    assert costs.budget(M) == 1000
    costs.cost_limits[M] = 5000
    assert costs.budget(M) == 4000
    costs.max_batch_cost = 0  # none configured: the lowered one alone
    assert costs.budget(M) == 5000
    assert costs.estimate_cost(M, 100, unit=80.0) == 5000  # rows x cost, clamped to the budget


def test_costed_inputs_keep_a_mean_cost_and_a_full_batch_holds_what_the_budget_does() -> None:
    costs = BatchBudget(100, learned(), max_batch_cost=1200)
    costs.note_cost(M, 30.0)
    assert costs.unit[M] == pytest.approx(30.0) and costs.batch_s.caps[M] == math.inf
    costs.note_cost(M, 40.0)
    assert costs.unit[M] == pytest.approx(30.0 + UNIT_ALPHA * 10.0)
    assert costs.full_n(M) == int(1200 // costs.unit[M])  # the budget holds fewer than 100 of them
    assert costs.shape(M) == (costs.limit(M), costs.budget(M), costs.full_n(M)) == (100, 1200, costs.full_n(M))
    assert costs.batch_s.full[M] == pytest.approx(costs.full_n(M) * costs.unit[M])  # what times[M] is read at


def test_an_input_that_can_never_run_is_named_and_why() -> None:
    costs = BatchBudget(100, learned(), max_batch_cost=1000, max_batch_s=1.0)
    assert "--max-batch-tokens 1000" in (costs.too_costly(M, 1500.0) or "")
    unbounded = BatchBudget(100, learned(), max_batch_s=1.0)
    alone = unbounded.too_costly(M, 5000.0)  # 2.51 s alone, past half the longest timeout
    assert alone is not None and "alone it would take about 2510 ms" in alone
    assert unbounded.too_costly(M, 100.0) is None


def test_a_full_batch_past_the_time_bound_lowers_the_budget_and_forgets_the_points_above() -> None:
    costs = BatchBudget(100, learned(), max_batch_s=1.0)
    for _ in range(100):
        costs.note_cost(M, 100.0)  # a full batch: 10,000 tokens, ~5 s on the line
    lowered = costs.cost_limits[M]
    assert token_s(lowered) <= 1.0 < token_s(2 * lowered)  # halved from a full batch until it fits, on the line
    assert costs.full_n(M) == int(lowered // costs.unit[M]) < 100
    assert all(p.size <= lowered for p in costs.batch_s.points[M].values())  # 3,200 is above: forgotten
    # Batches within it run far quicker than the line said: the budget climbs back, at most doubling each time.
    seen = [lowered]
    while M in costs.cost_limits and len(seen) < 30:
        costs.observe(M, token_s(seen[-1]) / 10, seen[-1])
        seen.append(costs.cost_limits.get(M, 100 * 100.0))
    assert M not in costs.cost_limits and all(b <= 2 * a for a, b in zip(seen, seen[1:]))


def test_a_queues_rows_cost_its_longest_input_and_a_count_queue_keeps_none() -> None:
    costs = BatchBudget(100, BatchTimes(100, {M: 0.1}))
    costs.note_row((M, 0), 1.0)
    assert (M, 0) not in costs.row_cost
    costs.note_row((M, 1), 32.0)
    costs.note_row((M, 1), 64.0)
    assert costs.row_cost[(M, 1)] == pytest.approx(32.0 + ROW_ALPHA * 32.0)


def test_what_a_worker_served_is_kept_for_costed_models_only() -> None:
    costs = BatchBudget(100, learned())
    costs.observe(M, 0.1, 100, rows=100)
    assert costs.served_rate(M) is None  # a count model: its capacity is read off its batch time
    costs.note_cost(M, 20.0)
    costs.observe(M, 0.2, 800, rows=40)
    assert costs.served_rate(M) == pytest.approx(200.0)


def test_a_new_cost_budget_makes_every_door_figure_stale() -> None:
    """The door keeps its figures until `BatchTimes.version` moves: a new budget must move it."""
    times = learned()
    costs = BatchBudget(100, times, max_batch_cost=40)
    before = times.version
    costs.set_max_batch_cost(80)
    assert costs.budget(M) == 80 and times.version == before + 1


# -- the flush ladder, one pass for the two callers ------------------------------------------------------------
def test_a_due_queue_of_items_too_late_to_run_is_looked_at_again_then_the_worker_sleeps(loop) -> None:
    clock = Clock()
    b = Batcher(max_batch_size=100, slo_s=0.2, margin_s=0.005, batch_s=BatchTimes(100, {M: 0.1}), clock=clock)
    late = Item("late", M, 0, loop.create_future(), clock.t, clock.t + 0.05)  # its batch would end after it
    b.submit(late)
    b.draining = True  # due at once
    assert b._take(0, clock.t) == (None, "again", clock.t)  # answered 504 at formation, nothing to run
    assert isinstance(late.future.exception(), Exception) and late.future.exception().status == 504
    assert b._take(0, clock.t) == (None, "sleep", math.inf)  # nothing queued: sleep until woken
    on_time = Item("on time", M, 0, loop.create_future(), clock.t, clock.t + 10)
    b.submit(on_time)
    assert b.take_now(0).items == [on_time]  # the finishing worker's path takes the same ladder


def test_take_now_leaves_the_batch_to_the_worker_holding_the_turn(loop) -> None:
    clock = Clock()
    b = Batcher(max_batch_size=100, slo_s=0.2, margin_s=0.005, batch_s=BatchTimes(100, {M: 0.1}), clock=clock)
    b.submit(Item("x", M, 0, loop.create_future(), clock.t, clock.t + 10))
    b.draining = True

    async def held() -> object:
        async with b._turn:
            return b.take_now(1)

    assert loop.run_until_complete(held()) is None
    assert loop.run_until_complete(asyncio.wait_for(b.next_batch(0), 1.0)).cause == "drain"
