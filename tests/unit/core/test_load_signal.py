"""The autoscaling signals (batchserve/core/load_signal.py): their arithmetic, and the gauges a real server exports
on /metrics and /internal/health under real open-loop load. (How far they lead the SLO is a timing claim:
bench/autoscale_signal.py.)"""

from __future__ import annotations


import pytest

from batchserve.core.load_signal import SATURATED, Reading


def reading(**kw) -> Reading:
    base = dict(arrivals_per_s=500.0, healthy=2, max_batch=100, batch_s=0.1, until_free_s=0.02, depth=0,
                slo_s=0.2)
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


