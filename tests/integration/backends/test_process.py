"""`--executor process` (issue 13): each device's batches run in a spawned child, and the pool's contract holds
unchanged through the pipe: answers, bisection of a poison input, a broken device, a hung device, and a device
process that dies. Live servers (sim backend), real HTTP."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.integration.inference.test_routes import metric
from tests.integration.test_gpu_pool import check_isolated, post_many


def children(pid: int) -> list[int]:
    """The device processes of a server: its children running multiprocessing's spawn entry point."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(c) for c in f.read().split()]
    spawned = []
    for child in out:
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    spawned.append(child)
        except FileNotFoundError:
            pass
    return sorted(spawned)


def test_batches_run_in_one_process_per_device(server_factory):
    server = server_factory("--executor", "process", "--devices", "2", "--slo-ms", "3000")
    assert len(children(server.proc.pid)) == 2
    inputs = [f"in-{i}" for i in range(50)]
    results = asyncio.run(post_many(server.url, inputs))
    assert all(s == 200 and b["output"] == t[::-1] for t, (s, b) in zip(inputs, results)), results
    assert any(b["batch_size"] > 1 for _, b in results)


def test_a_poison_input_fails_alone_through_the_pipe(server_factory):
    server = server_factory(
        "--executor", "process", "--devices", "2", "--sim-fail-marker", "POISON", "--slo-ms", "3000"
    )
    inputs = [f"mate-{i}" for i in range(40)]
    inputs[11] = "a POISON pill"
    results = asyncio.run(post_many(server.url, inputs))
    check_isolated(results, inputs, "POISON")
    assert "SimFault: fail marker in batch" in server.log()  # the child's exception, named, in the parent's log


def test_a_broken_device_process_is_routed_around(server_factory):
    server = server_factory("--executor", "process", "--devices", "2", "--sim-flaky-device", "1", "--slo-ms", "3000")
    inputs = [f"in-{i}" for i in range(30)]
    for _ in range(2):
        results = asyncio.run(post_many(server.url, inputs))
        assert all(s == 200 and b["output"] == t[::-1] for t, (s, b) in zip(inputs, results)), results
    with server.client() as c:  # the broken device really failed batches, and they were retried
        assert metric(c.get("/metrics").text, "batchserve_batch_retries_total", model="sim@v1", cause="error") >= 1


def test_a_hung_device_process_is_abandoned_then_taken_back(server_factory):
    server = server_factory(
        "--executor",
        "process",
        "--devices",
        "2",
        "--sim-hang-marker",
        "HANG",
        "--sim-hang-ms",
        "1500",
        "--gpu-timeout-ms",
        "400",
        "--slo-ms",
        "3000",
    )
    with server.client() as c:
        r = c.post("/v1/inference", json={"input": "HANG here", "timeout_ms": 8000})
        assert r.status_code == 504  # hung once, then hung its retry's worker too: answered, not retried again
        healthy = [w["healthy"] for w in c.get("/internal/health").json()["workers"]]
        assert healthy.count(False) >= 1
        give_up = time.monotonic() + 10
        while not all(w["healthy"] for w in c.get("/internal/health").json()["workers"]):
            assert time.monotonic() < give_up, "the hung workers were never taken back"
            time.sleep(0.1)
        r = c.post("/v1/inference", json={"input": "after"})
        assert r.status_code == 200 and r.json()["output"] == "retfa"


@pytest.mark.serial  # a new device process starts and warms within the request's 20 s: beside other load it did not
def test_a_dead_device_process_is_replaced(server_factory):
    server = server_factory("--executor", "process", "--devices", "1", "--slo-ms", "3000")
    before = children(server.proc.pid)
    assert len(before) == 1
    os.kill(before[0], signal.SIGKILL)
    with server.client() as c:
        # the next batch for the device finds its process gone and starts (and warms) a new one first
        r = c.post("/v1/inference", json={"input": "again", "timeout_ms": 20000})
        assert r.status_code == 200 and r.json()["output"] == "niaga"
    after = children(server.proc.pid)
    assert len(after) == 1 and after != before
    assert "process is gone: starting a new one" in server.log()
