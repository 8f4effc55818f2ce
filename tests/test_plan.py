"""`batchserve plan` (batchserve/plan.py): the batcher model checked against cases computed independently and
against bench/ideal.py's simulation, the planner's arithmetic, and `--measure` against a real server.
Whether the predictions match measured latency is a timing claim: bench/plan_check.py reports it."""

from __future__ import annotations

import math

import pytest

from batchserve import cli
from batchserve.plan import (Arrivals, BatchTime, Contract, capacity, make_plan, measure, percentile, predict,
                             simulate)

SEED = Contract(BatchTime.constant(100))  # the seed contract: 100 ms per batch of 1..100, SLO 200 ms


def test_batch_time_by_size_is_linear_between_points_and_flat_beyond():
    bt = BatchTime.parse("100:100, 1:20,50:60")
    assert bt.sizes == (1, 50, 100)
    assert [round(bt(s) * 1000, 6) for s in (1, 25, 50, 75, 100, 500)] == [20, 39.591837, 60, 80, 100, 100]
    assert BatchTime.constant(70)(1) == BatchTime.constant(70)(100) == 0.07
    for bad in ("", "0:10", "5:-1", "5", "a:b"):
        with pytest.raises(ValueError):
            BatchTime.parse(bad)


def test_a_lone_request_takes_one_batch_time_plus_overhead():
    """Arrivals far apart: each finds the device idle and the pace long past, so it leaves at once."""
    c = Contract(BatchTime.constant(100), overhead_s=0.007)
    p = predict(0.05, c, sim_s=4000)  # ~200 arrivals, 20 s apart on average
    assert p.p50_ms == pytest.approx(107) and p.expired == 0 and p.mean_batch == pytest.approx(1, abs=0.02)


def test_steady_arrivals_on_four_devices_wait_for_the_next_pace_slot():
    """2,000 evenly spaced requests/s on 4 devices of 100 ms: a batch leaves every S/G = 25 ms (the deadline,
    95 ms away, never comes first), so each request waits for the next 25 ms slot, then runs 100 ms."""
    c = Contract(BatchTime.constant(100), devices=4)
    arrivals = [k / 2000 for k in range(1, 20001)]
    done, sizes = simulate(arrivals, c)
    slot = 0.025
    expected = sorted((math.ceil(t / slot - 1e-9) * slot - t + 0.1) * 1000 for t in arrivals[200:])
    measured = sorted((d - t) * 1000 for t, d in zip(arrivals[200:], done[200:]))
    for q in (50, 95, 99):
        assert percentile(measured, q) == pytest.approx(percentile(expected, q), abs=0.6)
    assert sum(sizes[5:-5]) / len(sizes[5:-5]) == pytest.approx(50, abs=1)


@pytest.mark.parametrize("devices,rate", [(1, 500), (1, 900), (1, 1100), (4, 400), (4, 2000)])
def test_the_model_matches_bench_ideal_on_the_same_arrivals(devices, rate):
    """An independent implementation (numpy, bench/ideal.py) of the same policy: same answers, arrival by
    arrival, including past the ceiling (1,100 requests/s on one device, where requests expire)."""
    np = pytest.importorskip("numpy")
    ideal = pytest.importorskip("bench.ideal")
    schedule = pytest.importorskip("bench.schedule")
    arrivals = schedule.poisson_schedule(rate, 15.0, seed=7)
    theirs, their_sizes = ideal.simulate(arrivals, devices, 0.1, 100)
    ours, our_sizes = simulate(arrivals.tolist(), Contract(BatchTime.constant(100), devices=devices))
    assert np.allclose(np.asarray(ours), theirs, equal_nan=True, atol=1e-9)
    assert our_sizes == their_sizes.tolist()


def test_capacity_is_where_p95_meets_the_slo_when_the_slo_binds():
    c = Contract(BatchTime.constant(100), max_busy=0.99)  # a cap loose enough that the SLO binds first
    arrivals = Arrivals(3)
    cap = capacity(c, arrivals)
    assert 0 < cap < c.max_busy * c.ceiling()
    assert predict(cap, c, arrivals).p95_ms <= 200 < predict(cap * 1.02, c, arrivals).p95_ms


def test_capacity_is_capped_below_the_ceiling_where_the_slo_does_not_bind():
    c = Contract(BatchTime.constant(100), devices=4)
    assert c.ceiling() == 4000
    assert capacity(c) == pytest.approx(0.95 * 4000)


@pytest.mark.parametrize("devices,rates", [(1, (800, 900, 950, 1000, 1050, 1100)),
                                           (4, (3600, 3800, 3900, 4000, 4200))])
def test_p95_rises_with_the_rate_towards_the_ceiling(devices, rates):
    """(Below that the deadline policy holds p95 near slo - margin on one device, and near S + S/G on four,
    whatever the rate.) Common random numbers: every rate sees the same draws, so the rise is smooth."""
    c = Contract(BatchTime.constant(100), devices=devices)
    arrivals = Arrivals(1)
    p95s = [predict(rate, c, arrivals, sim_s=10).p95_ms for rate in rates]
    assert p95s == sorted(p95s) and p95s[-1] > 2 * p95s[0]


def test_nodes_are_the_target_over_one_node_capacity_rounded_up():
    plans = [make_plan(rate, SEED, sim_s=10) for rate in (500, 2000, 5000, 10000, 10500, 20000)]
    cap = plans[0].capacity
    for plan in plans:
        assert plan.capacity == cap  # the same node, whatever the target
        assert plan.nodes == math.ceil(plan.target_rate / cap)
        assert plan.at_target.p95_ms <= 200 and plan.at_target.expired == 0
        assert plan.headroom == pytest.approx(plan.nodes * cap / plan.target_rate - 1)
        if plan.nodes > 1:
            assert plan.target_rate / (plan.nodes - 1) > cap  # one node fewer would not do
    assert [p.nodes for p in plans] == sorted(p.nodes for p in plans)


def test_the_plan_command_prints_the_seed_plan(capsys):
    assert cli.main(["plan", "--rate", "10000", "--slo-ms", "200", "--batch-ms", "100", "--max-batch", "100",
                     "--devices", "1", "--sim-s", "10"]) == 0
    out = capsys.readouterr().out
    expected = make_plan(10000, SEED, sim_s=10)
    assert f"nodes needed      {expected.nodes}  " in out
    assert f"p95 {expected.at_target.p95_ms:.0f} ms" in out and "one node down" in out


@pytest.mark.parametrize("args,message", [
    (["--rate", "100"], "exactly one of"),
    (["--rate", "100", "--batch-ms", "100", "--batch-ms-by-size", "1:100"], "exactly one of"),
    (["--rate", "100", "--batch-ms", "250"], "no rate meets a 200 ms SLO"),
    (["--rate", "100", "--batch-ms-by-size", "1:x"], "size:ms"),
    (["--rate", "100", "--batch-ms", "100", "--overhead-ms", "10"], "it takes more devices per node"),
    (["--rate", "100", "--measure", "http://127.0.0.1:9"], "refused"),
])
def test_bad_plan_arguments_say_why(capsys, args, message):
    assert cli.main(["plan", *args]) == 2
    assert message in capsys.readouterr().err


def test_measure_reads_devices_and_batch_time_from_a_running_server(server_factory):
    server = server_factory("--devices", "2", "--sim-batch-ms", "40", "--max-batch-size", "16")
    m = measure(server.url, None, [])
    assert m.devices == 2 and m.batch_time == BatchTime.constant(40)
    probed = measure(server.url, "sim@v1", [1, 8]).batch_time
    assert 1 in probed.sizes and all(0.039 <= t <= 0.08 for t in probed.seconds)
