"""deploy/rayserve's sizing and autoscaling policy, without a Ray cluster: the places a replica takes, and the
replica count the load ratios ask for (the HPA's rule: ceil(sum / target), within the bounds)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deploy.rayserve.app import (
    LOAD_RATIO,
    ONGOING_PER_BATCH,
    load_ratio_policy,
    max_ongoing,
    settings_of,
)


def context(ratios: dict[str, float], target: int = 2, low: int = 1, high: int = 8) -> SimpleNamespace:
    return SimpleNamespace(
        aggregated_metrics={LOAD_RATIO: ratios} if ratios else {},
        target_num_replicas=target,
        capacity_adjusted_min_replicas=low,
        capacity_adjusted_max_replicas=high,
    )


def test_a_replica_takes_several_full_batches_per_worker():
    assert max_ongoing(settings_of("--backend sim --max-batch-size 32")) == 32 * ONGOING_PER_BATCH
    assert max_ongoing(settings_of("--backend sim --max-batch-size 32 --devices 2")) == 64 * ONGOING_PER_BATCH
    assert max_ongoing(settings_of("--backend sim")) > 5  # Ray's default, which would cap every batch at 5


@pytest.mark.parametrize(
    ("ratios", "wanted"),
    [
        ({"a": 0.75, "b": 0.75}, 2),  # at the target: as many as now
        ({"a": 1.2, "b": 1.2}, 4),  # 2.4 / 0.75 = 3.2 -> 4
        ({"a": 0.1, "b": 0.05}, 1),  # idle: down to the floor
        ({"a": 9.0, "b": 9.0}, 8),  # capped by the bound
    ],
)
def test_replicas_follow_the_load_ratio(ratios: dict[str, float], wanted: int):
    replicas, _ = load_ratio_policy(context(ratios))  # type: ignore[arg-type]
    assert replicas == wanted


def test_no_reports_yet_keeps_the_target():
    assert load_ratio_policy(context({}, target=3))[0] == 3  # type: ignore[arg-type]
