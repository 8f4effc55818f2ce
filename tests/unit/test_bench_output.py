"""Bench runs write into the checkout only when asked (issue 9 §5): a plain run prints its table and leaves
bench/results/ as it was; `--record` writes there, `--out DIR` into DIR."""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
SCRIPTS = [
    "run_standard",
    "drill",
    "overload",
    "tenancy_bench",
    "jobs_bench",
    "generation_bench",
    "fleet",
    "soak",
    "autoscale_signal",
    "embed_bench",
    "plan_check",
    "engine_loop",
    "stepper_host",
    "startup",
    "scale",
    "protocols",
    "prefill_burst",
    "cpu_compare",
    "inference_paths",
    "hung_child",
    "priority",
    "fair_service",
]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_bench_defaults_to_print_only(script: str) -> None:
    from bench import common

    module = importlib.import_module(f"bench.{script}")
    assert common.out_dir(module.parse_args([])) is None
    assert common.out_dir(module.parse_args(["--record"])) == RESULTS
    assert common.out_dir(module.parse_args(["--out", "/somewhere"])) == Path("/somewhere")
    assert common.out_dir(module.parse_args(["--out-dir", "/somewhere"])) == Path("/somewhere")


@pytest.mark.parametrize("lagged", ["0", "1"])
def test_the_stood_in_gpu_runs_the_real_decode_loop(lagged: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/static_host.py: the smollm2 backend and `Runner.run` with a clock for a device. A batch takes at
    least its device time (a prefill and a step per further token), padded to the GPU's buckets."""
    import argparse

    from bench import executor_bench

    monkeypatch.setenv(
        "STATIC_STAND_IN",
        f"step_ms=5,step_ms_per_row=0,prefill_ms=3,prefill_ms_per_row=0,host_prefill_ms=1,lagged={lagged}",
    )
    a = argparse.Namespace(
        max_new_tokens=9,
        smollm2_dir="",
        decode="static",
        backend="bench.static_host:StandInSmolLM2",
        sizes=[1, 8],
        repeats=1,
    )
    off = executor_bench.offline(a)
    assert off.padded_to == (1, 8)
    assert all(0.044 <= t < 5 for t in off.seconds.values()), off.seconds  # 3 + 1 ms, then 8 steps of 5 ms


def test_the_server_histogram_gives_the_batches_of_each_size_bin() -> None:
    from prometheus_client import generate_latest

    from batchserve.metrics import make_metrics
    from bench.model_load import bins, histogram_counts

    m = make_metrics()
    for size in (3, 20, 24, 1):
        m.batch_size.labels("a").observe(size)
    before = histogram_counts(generate_latest(m.registry).decode(), "batchserve_batch_size")
    for size in (1, 20, 24, 100, 100, 100):
        m.batch_size.labels("a").observe(size)
    m.batch_size.labels("b").observe(7)  # another model's batches count too
    after = histogram_counts(generate_latest(m.registry).decode(), "batchserve_batch_size")
    assert before[math.inf] == 4 and after[24.0] == 8
    assert bins(before, after) == {1.0: 1, 8.0: 1, 24.0: 2, 100.0: 3}


def test_a_padding_backend_is_compared_at_the_sizes_its_batches_ran() -> None:
    from bench.executor_bench import Offline, offline_reference_s

    off = Offline({1: 0.2, 8: 0.23, 16: 0.24, 32: 0.25, 64: 0.27, 100: 0.28}, padded_to=(1, 8, 16, 32, 64, 100))
    # 3 batches of 17-24 (run at 32) and one of 2-4 (run at 8): not the time at their mean size, 18.25
    seconds, how = offline_reference_s(off, {"24": 3, "4": 1}, mean_batch=18.25)
    assert how == "padded" and seconds == pytest.approx((3 * 0.25 + 0.23) / 4)
    # no padding (a CPU): the time at the mean size, between the measured sizes
    seconds, how = offline_reference_s(Offline(off.seconds, ()), {"24": 3, "4": 1}, mean_batch=24)
    assert how == "mean size" and seconds == pytest.approx(0.24 + 0.01 * 8 / 16)
    # a padded size inside a bin (a max batch of 40: bin 33-48 holds batches run at 40 and at 48): the mean size
    seconds, how = offline_reference_s(Offline({32: 0.25, 40: 0.26}, (1, 8, 16, 32, 40)), {"48": 2}, 36)
    assert how == "mean size"


def test_the_agreement_check_tells_a_broken_path_from_rounding() -> None:
    """bench/gpu_agree.py (the GPU check's first part): every greedy request must match the reference; a seeded
    sampled one may part where a draw sits on a boundary, but only rarely."""
    from bench.gpu_agree import compare, differences

    assert [vars(d) for d in differences([[1, 2, 3], [4, 5]], [[1, 2, 3], [4]])] == [
        {"index": 1, "first": 1, "reference_len": 2, "candidate_len": 1}
    ]
    reference = [[7, i, 2] for i in range(20)]
    sampled = set(range(10, 20))
    same = compare("slots", "graphs", reference, [list(r) for r in reference], sampled, [2])
    assert same["agree"] and same["ended_at_eos"] == 20 and same["greedy_identical"] == 10
    one_greedy = [list(r) for r in reference]
    one_greedy[3][1] = 99
    row = compare("slots", "graphs", reference, one_greedy, sampled, [2])
    assert not row["agree"] and row["first_diffs"][0]["index"] == 3 and row["first_diffs"][0]["first"] == 1
    one_sampled = [list(r) for r in reference]
    one_sampled[12][2] = 5
    assert compare("slots", "graphs", reference, one_sampled, sampled, [2])["agree"]  # 9 of 10 sampled
    one_sampled[15][0] = 5
    assert not compare("slots", "graphs", reference, one_sampled, sampled, [2])["agree"]  # 8 of 10


def test_the_load_curves_put_batchserve_beside_its_peers() -> None:
    from bench import embed_bench, report
    from bench.plot import PNG_MAGIC, load_png

    rows = [
        embed_bench.Row(
            server=s,
            rate=r,
            sustained_rps=r * f,
            count=10,
            ok=10,
            p50_ms=1,
            p95_ms=p,
            p99_ms=p,
            errors={},
            server_cores=None,
        )
        for s, f, p in (("batchserve", 1.0, 50.0), ("infinity", 0.8, 400.0))
        for r in (20.0, 40.0)
    ]
    curves = embed_bench.curves_of(rows)
    assert sorted(curves) == ["batchserve", "infinity"]
    assert [(p.offered, p.p95_ms, p.goodput) for p in curves["infinity"]] == [(20.0, 400.0, 16.0), (40.0, 400.0, 32.0)]
    assert load_png(curves, "t").startswith(PNG_MAGIC)
    assert report.write("x", {}, "md", None, curves=curves) is None  # print only: no file


def test_the_fair_service_reads_whole_usage_readings_only() -> None:
    """bench/fair_service.py: D and Jain's index come from usage readings taken between two batches' answers; a
    reading taken while a batch's answers were being recorded (one tenant's counted, the other's not yet) is left
    out, and the device's idle time is the interval less its busy time's growth."""
    from bench.fair_metrics import jain
    from bench.fair_service import Sample, analyse
    from bench.plot import PNG_MAGIC, series_png

    assert jain([5.0, 5.0]) == 1.0 and jain([1.0, 0.0]) == 0.5
    samples = []
    for k in range(60):  # a batch of 100 inputs every 0.1 s, 50 to each tenant, read every 0.2 s
        done = 2 * k + (1 if k == 30 else 0)  # batches finished
        cost = {"small": 50.0 * done, "large": 50.0 * done}
        if k == 30:  # read just as a batch ended, while its answers went out: the small tenant's counted only
            cost["large"] -= 50.0
        samples.append(
            Sample(
                t=0.2 * k + 0.01,
                cost=cost,
                t_health=0.2 * k,
                busy=True,
                running_s=0.03,
                running_size=100,
                batches=done,
                queue_depth=200,
                compute_sum=0.098 * 2 * k,  # 2 ms of every 100 idle: the hand-off
                compute_count=done,
                formed=done + 1,
                formed_inputs=100.0 * (done + 1),
            )
        )
    res = analyse(samples, ("small", "large"), unit=8.0, window_s=10.0)
    assert res["readings"] == len(res["diff"]) == res["samples"] - 1  # the reading at k = 30 left out
    assert res["max_abs_d"] == 0.0 and res["goals"]["|D| never above 2 after the first second"]
    (window,) = [w for w in res["windows"] if w["to_s"] - w["from_s"] >= 9]
    assert window["jain"] == 1.0 and window["idle_share"] == pytest.approx(0.02, abs=1e-6)
    assert not res["goals"]["device idle while inputs wait <= 1% of each window"]
    png = series_png({"D": ([0.0, 1.0], [0.0, 0.5])}, "t", "s", "D", bounds=(2.0, -2.0))
    assert png.startswith(PNG_MAGIC)


def test_fair_metrics_difference_windows_and_idle_time() -> None:
    """bench/fair_metrics.py: the accumulated difference moves by each answer's cost from t0 on, Jain's index is
    per whole window, and idle time counts only intervals with inputs waiting at both ends, per worker."""
    from bench.fair_metrics import Answered, DeviceReading, DeviceSampler, difference, idle_while_waiting, windows

    # a: one 880-token answer a second; b: 110 tokens every 1/8 s; and a warm-up answer of b before t0 = 1
    log = [Answered(0.5, "b", 999.0)]
    log += [Answered(1.0 + k, "a", 880.0) for k in range(20)]
    log += [Answered(1.0 + k / 8, "b", 110.0) for k in range(1, 161)]
    diff = difference(log, ("a", "b"), t0=1.0)
    assert diff[0] == (0.0, 0.0) and max(abs(d) for _, d in diff) == 880.0 + 110.0  # a answered before b at 2 s
    assert diff[-1][1] == 20 * 880.0 - 160 * 110.0  # the warm-up answer is not counted
    per = windows(log, ("a", "b"), t0=1.0, t1=25.0, window_s=10.0)
    assert [(w["from_s"], w["to_s"]) for w in per] == [(1.0, 11.0), (11.0, 21.0)]  # 21-25 is under 90 % of 10 s
    assert per[0]["served"] == {"a": 8800.0, "b": 79 * 110.0} and 0.99 < per[0]["jain"] < 1.0

    # 2 workers read every 0.2 s, busy 0.38 of every 0.4 device-seconds while 50 inputs wait; idle 0.2 s at rest
    readings = [DeviceReading(0.2 * k, 50 if k < 10 else 0, 2, 0.38 * k) for k in range(15)]
    idle = idle_while_waiting(readings)
    assert idle["waiting_s"] == pytest.approx(9 * 0.2) and idle["idle_ms"] == pytest.approx(9 * 20.0)
    assert idle["idle_share"] == pytest.approx(0.1)

    sampler = DeviceSampler("http://x", start=0.0)
    worker = {"busy": True, "running_ms": 40, "batches": 3}
    first = sampler.reading(1.0, {"queue_depth": 7, "workers": [worker]}, {
        "batchserve_batch_compute_seconds_sum": 0.3, "batchserve_batch_compute_seconds_count": 3.0,
    })  # fmt: skip
    assert (first.queue_depth, first.workers, first.busy_s) == (7, 1, pytest.approx(0.34))
    # a batch ended between the health and metrics calls: its time is in the sum, the running time not added
    torn = sampler.reading(1.2, {"queue_depth": 7, "workers": [worker | {"running_ms": 95}]}, {
        "batchserve_batch_compute_seconds_sum": 0.4, "batchserve_batch_compute_seconds_count": 4.0,
    })  # fmt: skip
    assert torn.busy_s == pytest.approx(0.4)
