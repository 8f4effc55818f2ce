"""The autoscaling signals (batchserve/core/load_signal.py): their arithmetic, and the gauges a real server exports
on /metrics and /internal/health under real open-loop load. (How far they lead the SLO is a timing claim:
bench/autoscale_signal.py.)"""

from __future__ import annotations


import pytest

from batchserve.core.load_signal import SATURATED, EngineLoad, Reading


def reading(**kw) -> Reading:
    base = dict(arrivals_per_s=500.0, healthy=2, max_batch=100, batch_s=0.1, until_free_s=0.02, depth=0, slo_s=0.2)
    return Reading(**{**base, **kw})


def test_load_ratio_is_arrivals_over_full_batch_capacity_of_the_healthy_workers():
    assert reading().load_ratio() == pytest.approx(0.25)  # 500 / (2 x 100 / 0.1)
    assert reading(healthy=1).load_ratio() == pytest.approx(0.5)  # a lost worker doubles it
    assert reading(batch_s=0.2).load_ratio() == pytest.approx(0.5)
    assert reading(arrivals_per_s=0).load_ratio() == 0
    assert reading(healthy=0).load_ratio() == SATURATED
    assert reading(arrivals_per_s=1e9).load_ratio() == SATURATED


def test_predicted_wait_ratio_is_the_wait_for_a_batch_over_what_the_slo_leaves():
    assert reading().predicted_wait_ratio() == pytest.approx(0.02 / 0.1)
    # 250 queued = 2 full batches ahead, shared by 2 workers: 0.02 + 2 x 0.1 / 2 = 0.12 s of a 0.1 s budget
    assert reading(depth=250).predicted_wait_ratio() == pytest.approx(1.2)
    assert reading(batch_s=0.25).predicted_wait_ratio() == SATURATED  # the batch alone passes the SLO
    assert reading(healthy=0, depth=3).predicted_wait_ratio() == SATURATED
    assert reading(healthy=0, depth=0, arrivals_per_s=0).predicted_wait_ratio() == 0


# -- the generation engine's side (its stepper answers /v1/inference of a model the batcher never sees) ------
def engine(wait_s: float = 0.0, **kw) -> EngineLoad:
    base = dict(running=2, waiting=0, slots=4, predicted_start_s=lambda: wait_s, answer_s=0.5)
    return EngineLoad(**{**base, **kw})


def test_the_load_ratio_does_not_replay_the_engines_queue():
    def replay() -> float:
        raise AssertionError("the load ratio asked for the predicted wait")

    assert engine(running=4, waiting=4, predicted_start_s=replay).load_ratio() == pytest.approx(2.0)


def test_engine_load_is_sequences_running_and_waiting_over_its_slots():
    assert engine().load_ratio() == pytest.approx(0.5)
    assert engine(running=4, waiting=6).load_ratio() == pytest.approx(2.5)  # demand past the slots reads > 1
    assert engine(running=0).load_ratio() == 0
    assert engine(healthy=False).load_ratio() == SATURATED
    assert engine(running=0, healthy=False).load_ratio() == 0


def test_engine_predicted_wait_is_the_wait_for_a_slot_over_what_the_slo_leaves_after_the_answer():
    assert engine(wait_s=0.25).predicted_wait_ratio(slo_s=1.5) == pytest.approx(0.25)  # 0.25 s of 1.5 - 0.5
    assert engine(wait_s=0.0).predicted_wait_ratio(slo_s=1.5) == 0
    assert engine(wait_s=0.1, answer_s=2.0).predicted_wait_ratio(slo_s=1.5) == SATURATED
    assert engine(wait_s=float("inf")).predicted_wait_ratio(slo_s=1.5) == SATURATED  # never fits: finite
    assert engine(healthy=False).predicted_wait_ratio(slo_s=1.5) == SATURATED


def test_a_node_busy_only_on_the_engine_reads_the_engines_load_not_zero():
    idle_batcher = reading(arrivals_per_s=0, depth=0, until_free_s=0.0)
    assert idle_batcher.load_ratio() == 0
    busy = reading(
        arrivals_per_s=0, depth=0, until_free_s=0.0, slo_s=1.5, engine=engine(running=4, waiting=2, wait_s=0.5)
    )
    assert busy.load_ratio() == pytest.approx(1.5)
    assert busy.predicted_wait_ratio() == pytest.approx(0.5)
    # each signal is the larger side's: a busier batcher still reads its own
    both = reading(engine=engine(running=1, slots=10))
    assert both.load_ratio() == pytest.approx(0.25) and both.predicted_wait_ratio() == pytest.approx(0.2)
