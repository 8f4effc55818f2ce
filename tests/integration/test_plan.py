"""`batchserve plan`'s measure against a running server (the model itself is tests/unit/test_plan.py)."""

from __future__ import annotations

from batchserve.plan import BatchTime
from batchserve.plan_measure import cpu_per_request, measure


def test_measure_reads_devices_and_batch_time_from_a_running_server(server_factory):
    server = server_factory("--devices", "2", "--sim-batch-ms", "40", "--max-batch-size", "16")
    m = measure(server.url, None, [])
    assert m.devices == 2 and m.batch_time == BatchTime.constant(40)
    assert "the same at every size (--probe" in m.source  # says what it assumed, and how to measure instead
    probed = measure(server.url, "sim@v1", [1, 8]).batch_time
    assert 1 in probed.sizes and all(0.039 <= t <= 0.08 for t in probed.seconds)


def test_measure_reads_cpu_per_request_from_the_server_under_load(server_factory):
    """process_cpu_seconds_total over the requests answered in a window, from a real server carrying load from
    two client threads; with no load in the window it says so instead of a figure."""
    import threading

    server = server_factory("--devices", "2", "--sim-batch-ms", "5", "--max-batch-size", "16")
    idle, note = cpu_per_request(server.url, 0.5)
    assert idle is None and "CPU per request not measured" in note
    stop = threading.Event()

    def load() -> None:
        with server.client() as c:
            while not stop.is_set():
                assert c.post("/v1/inference", json={"input": "cpu"}).status_code == 200

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        m = measure(server.url, None, [], cpu_window_s=2.0)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert m.cpu_s_per_request is not None and 10e-6 < m.cpu_s_per_request < 20e-3
    assert "us per request" in m.source


def test_plan_measure_with_its_defaults_against_a_live_server(server_factory):
    """`batchserve plan --rate 10000 --measure URL` as a new user types it: the default CPU window (5 s) is as
    long as the server's default keep-alive timeout (5 s), so the connection that holds both /metrics readings
    must not idle out between them (it did: "Remote end closed connection without response")."""
    import subprocess
    import sys
    import threading

    server = server_factory("--sim-batch-ms", "5", "--max-batch-size", "16")  # keep-alive left at its default
    stop = threading.Event()

    def load() -> None:
        with server.client() as c:
            while not stop.is_set():
                assert c.post("/v1/inference", json={"input": "plan"}).status_code == 200

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        run = subprocess.run(
            [sys.executable, "-m", "batchserve", "plan", "--rate", "10000", "--measure", server.url],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert "closed" not in run.stderr and "Remote end" not in run.stderr, run.stderr
    if run.returncode == 2 and run.stderr.startswith("batchserve plan: p95 meets 200 ms only below"):
        # Measured, then planned: on a loaded shared machine the sim's 5 ms batch can be learned as 100+ ms,
        # and then no real load meets the default 200 ms SLO: the planner's verdict, not a failed measurement.
        return
    assert run.returncode == 0, run.stderr
    assert "us per request" in run.stdout and "nodes needed" in run.stdout


HELD = """
import os
import time


class Held:
    def __init__(self, gate):
        while not os.path.exists(gate):  # loading, until the test says
            time.sleep(0.02)

    def batch(self, inputs):
        time.sleep(0.3)  # a real model's batch: longer than the planner's own 200 ms default
        return inputs
"""


def test_plan_measure_says_warming_up_then_plans_at_the_servers_slo(tmp_path, capsys):
    """One reason at a time: while the server loads, that it is warming up (it once said `--devices ... must be
    >= 1` then, and after the load `no rate meets a 200 ms SLO`, the planner's default, where the server held
    1,500 ms); loaded, the plan is at the server's SLO and timeout."""
    from batchserve import cli
    from tests.conftest import start_server
    from tests.integration.backends.test_plugin import write_plugins

    env = write_plugins(tmp_path, heldplug=HELD)
    gate = tmp_path / "loaded"
    (tmp_path / "bs.toml").write_text(
        f'[[models]]\nname = "m"\nbackend = "heldplug:Held"\n[models.options]\ngate = "{gate}"\n'
    )
    server = start_server(
        "--config", str(tmp_path / "bs.toml"), "--slo-ms", "1500", "--timeout-ms", "6000", env=env, ready=False
    )
    args = ["plan", "--rate", "5", "--measure", server.url, "--cpu-us-per-request", "100", "--sim-s", "10"]
    try:
        assert cli.main(args) == 2
        err = capsys.readouterr().err
        assert "is still warming up" in err and err.count("batchserve plan:") == 1, err
        gate.touch()
        server.wait_ready()
        assert cli.main(args) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert "at p95 <= 1500 ms" in out and "the server's SLO 1500 ms and timeout 6000 ms" in out, out
        assert cli.main([*args, "--slo-ms", "200"]) == 2
        assert "--probe 1,8,32" in capsys.readouterr().err
    finally:
        server.stop()
