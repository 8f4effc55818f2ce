"""The refill policy's arithmetic (`jobs/refill.py`), alone: places, tenant shares, a model's spare room by cost
and by its queue, and the budget one refill takes from. In-process scheduler tests: test_job_pricing.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchserve.jobs.refill import Budget, Ledger, batch_rows, model_cap, model_spare, places, shares


@dataclass(frozen=True)
class Room:
    depth: int = 0
    max_queue: int = 10000
    rows: int = 64
    budget: float = math.inf
    unit: float = 1.0
    healthy: int = 1


def test_places_are_two_batches_per_worker_grown_to_two_per_tenant_unless_set() -> None:
    assert places(0, 64, 1) == 128
    assert places(0, 64, 1, tenants=3) == 384
    assert places(0, 64, 0, tenants=3) == 0  # no healthy worker: nothing is fed
    assert places(500, 64, 1, tenants=3) == 500  # the operator's value is kept


def test_each_tenant_may_fill_its_share_whatever_the_others_hold() -> None:
    assert shares(128, {"a": 128}, ["a", "b"]) == {"a": 0, "b": 64}
    assert shares(128, {"a": 10, "b": 70}, ["a", "b"]) == {"a": 54, "b": 0}


def test_a_full_batch_is_what_the_cost_budget_holds_of_the_costlier_mean_input() -> None:
    assert batch_rows(Room(), 40.0) == 64  # no cost budget: the batch size
    assert batch_rows(Room(budget=640.0, unit=10.0), 1.0) == 64  # the batcher's mean input: 64 of 10
    assert batch_rows(Room(budget=640.0, unit=10.0), 40.0) == 16  # the job's inputs cost more: 16 of 40
    assert batch_rows(Room(budget=10.0, unit=1.0), 100.0) == 1  # never less than one


def test_a_models_cap_is_two_full_batches_per_worker_within_a_quarter_of_its_queue() -> None:
    assert model_cap(Room(healthy=2), 1.0) == 256
    assert model_cap(Room(), 1.0, tenants=3) == 384  # two batches per tenant with work, as the places
    assert model_cap(Room(healthy=0), 1.0) == 0
    assert model_cap(Room(max_queue=400), 1.0) == 100
    assert model_cap(Room(), 1.0, configured=100_000) == 2500


def test_spare_room_is_what_the_cap_and_the_queue_both_leave() -> None:
    assert model_spare(Room(), 1.0, held=100) == 28
    assert model_spare(Room(depth=2400), 1.0, held=0) == 100  # 2,400 queued (interactive): 100 to a quarter
    assert model_spare(Room(depth=9000), 1.0, held=0) == 0
    assert model_spare(Room(), 1.0, held=500) == 0


def test_the_budget_takes_places_and_shares_and_reads_each_models_room_afresh() -> None:
    room = {"m": 5, "g": None}
    b = Budget(10, room.get, {"a": 7, "b": 3})
    assert b.can("a", "m") == 5 and b.can("a", "g") == 7 and b.can("b", "g") == 3
    b.take("a", 7)
    assert b.can("a", "g") == 0 and b.can("b", "g") == 3 and b.free == 3
    room["m"] = 0
    assert b.can("b", "m") == 0


def test_the_ledger_counts_shared_inputs_by_tenant_and_every_input_by_model() -> None:
    ledger = Ledger()
    ledger.add("a", "m", 5, shared=True)
    ledger.add("a", "m", 2, shared=False)
    assert (ledger.shared, ledger.isolated, ledger.tenants, ledger.models) == (5, 2, {"a": 5}, {"m": 7})
    ledger.isolate("a", 5)
    ledger.add("a", "m", -7, shared=False)
    assert (ledger.total, ledger.tenants, ledger.models) == (0, {}, {})
