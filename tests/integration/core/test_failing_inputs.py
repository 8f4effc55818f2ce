"""Failing inputs, issue 28 item 3, through live servers: a backend that says which input failed (an exception
in place of that output) has that input alone answered 500 with no re-run; an input that failed alone is
quarantined (a retry is answered at once, not run); and one tenant's job with 10 % failing inputs leaves
another tenant's clean job near its own speed. Plus the quarantine's bounds with an injected clock."""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import pytest

from tests.conftest import LiveServer, open_loop
from tests.integration.inference.test_routes import metric
from tests.integration.jobs.test_routes import finished, results, wait_for
from tests.integration.backends.test_plugin import write_plugins
from batchserve.http.guards import digest, new_key
from tests.integration.http.test_tenancy import bearer

PER_INPUT_PLUGIN = """
import time

def batch(inputs):
    time.sleep(0.02)
    return [ValueError("no answer for " + t) if t.startswith("BAD") else t.upper() for t in inputs]
"""


async def post_all(url: str, inputs: list[str]) -> list[tuple[int, dict]]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=len(inputs))) as session:

        async def one(text: str) -> tuple[int, dict]:
            async with session.post(url + "/v1/inference", json={"input": text}) as r:
                return r.status, await r.json()

        return await asyncio.gather(*(one(t) for t in inputs))


def batches_run(text: str, model: str) -> float:
    return sum(
        metric(text, "batchserve_batches_total", model=model, cause=cause)
        for cause in ("full", "deadline", "pace", "hold", "drain", "retry", "isolated")
    )


def test_a_backend_that_names_the_failing_input_fails_it_alone_without_bisection(tmp_path, server_factory):
    env = write_plugins(tmp_path, perinput=PER_INPUT_PLUGIN)
    s: LiveServer = server_factory(
        "--backend",
        "perinput:batch",
        "--devices",
        "2",
        "--max-batch-size",
        "16",
        "--slo-ms",
        "2000",
        "--timeout-ms",
        "10000",
        env=env,
    )
    inputs = [f"BAD-{i}" if i % 10 == 3 else f"ok-{i}" for i in range(40)]
    results_ = asyncio.run(post_all(s.url, inputs))
    for text, (status, body) in zip(inputs, results_):
        if text.startswith("BAD"):
            assert status == 500 and body["error"] == "INFERENCE_FAILED", body
            assert f"ValueError: no answer for {text}" in body["message"], body  # the backend's own words
        else:
            assert status == 200 and body["output"] == text.upper(), body
    with s.client() as c:
        text = c.get("/metrics").text
    assert metric(text, "batchserve_batch_retries_total", model="perinput@v1", cause="error") == 0
    assert metric(text, "batchserve_batches_total", model="perinput@v1", cause="retry") == 0
    # Not quarantined either (naming it cost nothing, and the failure may be transient): it runs again.
    with s.client() as c:
        again = c.post("/v1/inference", json={"input": "BAD-3"})
        after = c.get("/metrics").text
    assert again.status_code == 500 and "quarantined" not in again.json()["message"]
    assert batches_run(after, "perinput@v1") == batches_run(text, "perinput@v1") + 1


def test_the_sims_input_fail_marker_fails_that_input_alone_and_its_job_completes_unisolated(tmp_path, server_factory):
    """`--sim-input-fail-marker` (the soak's failing job): the sim names the failing input as a backend that
    can tell does, so a job with 10 % such inputs rides shared batches at a clean job's pace (no bisection,
    no isolation) and completes with exactly those inputs failed."""
    s = server_factory(
        "--devices",
        "2",
        "--sim-batch-ms",
        "20",
        "--max-batch-size",
        "20",
        "--slo-ms",
        "2000",
        "--sim-input-fail-marker",
        "FAIL",
        "--jobs-db",
        str(tmp_path / "j.db"),
    )
    inputs = ["FAIL-1" if i == 5 else f"mate-{i}" for i in range(20)]
    first = asyncio.run(post_all(s.url, inputs))
    assert first[5][0] == 500 and "input fail marker" in first[5][1]["message"], first[5]
    assert all(st == 200 and body["output"] == inputs[i][::-1] for i, (st, body) in enumerate(first) if i != 5)
    failing = [f"FAIL-{i}" if i % 10 == 0 else f"ok-{i}" for i in range(500)]
    with s.client() as c:
        job = c.post("/v1/batches", json={"inputs": failing}).json()
        done = wait_for(lambda: finished(c, job["id"]), timeout=60, every=0.05)
        lines = results(c, job["id"])
        text = c.get("/metrics").text
    assert (done["completed"], done["failed"]) == (450, 50)
    assert all((line["status"] == "failed") == failing[i].startswith("FAIL") for i, line in enumerate(lines))
    assert metric(text, "batchserve_batch_retries_total", model="sim@v1", cause="error") == 0
    assert metric(text, "batchserve_batches_total", model="sim@v1", cause="isolated") == 0


def test_an_input_that_failed_alone_is_answered_at_once_on_retry(tmp_path, server_factory):
    s = server_factory(
        "--devices",
        "2",
        "--sim-batch-ms",
        "30",
        "--max-batch-size",
        "20",
        "--slo-ms",
        "2000",
        "--timeout-ms",
        "10000",
        "--sim-fail-marker",
        "POISON",
        "--jobs-db",
        str(tmp_path / "j.db"),
    )
    inputs = ["POISON-1" if i == 7 else f"mate-{i}" for i in range(20)]
    first = asyncio.run(post_all(s.url, inputs))
    assert first[7][0] == 500 and all(st == 200 for i, (st, _) in enumerate(first) if i != 7)
    with s.client() as c:
        before = c.get("/metrics").text
        started = time.monotonic()
        again = c.post("/v1/inference", json={"input": "POISON-1"})
        took = time.monotonic() - started
        # A job holding it many times: each copy is answered failed at once, the clean items run.
        job = c.post("/v1/batches", json={"inputs": ["POISON-1"] * 30 + ["clean"]}).json()
        done = wait_for(lambda: finished(c, job["id"]), timeout=30)
        lines = results(c, job["id"])
        after = c.get("/metrics").text
    assert again.status_code == 500 and again.json()["error"] == "INFERENCE_FAILED"
    assert "quarantined" in again.json()["message"], again.json()
    assert took < 1.0  # no batch ran for it (a batch is 30 ms, but bisecting 30 copies would be many)
    assert (done["completed"], done["failed"]) == (1, 30)
    assert all("quarantined" in line["error"]["message"] for line in lines[:30])
    assert batches_run(after, "sim@v1") - batches_run(before, "sim@v1") == 1  # only the clean item ran
    assert metric(after, "batchserve_batch_retries_total", model="sim@v1", cause="error") == metric(
        before, "batchserve_batch_retries_total", model="sim@v1", cause="error"
    )


def _tenants(tmp_path, *names: str) -> tuple[str, dict[str, str]]:
    keys = {t: new_key() for t in names}
    config = tmp_path / "keys.toml"
    config.write_text(
        "".join(
            f'[[keys]]\ntenant = "{t}"\ntier = "paid"\nsha256 = "{digest(k)}"\nrate = 1000\n' for t, k in keys.items()
        )
    )
    return str(config), keys


def _run_job(c, inputs: list[str], timeout: float = 90) -> tuple[float, dict]:
    started = time.monotonic()
    job = c.post("/v1/batches", json={"inputs": inputs}).json()
    done = wait_for(lambda: finished(c, job["id"]), timeout=timeout, every=0.02)
    return time.monotonic() - started, done


@pytest.mark.serial  # its clean job's time beside the failing one against alone: other workers' load skews it
def test_one_tenants_failing_job_leaves_anothers_clean_job_near_its_own_speed(tmp_path, server_factory):
    """A job with 10 % failing inputs (the sim raises for the whole batch: bisection is the only way to find
    them) beside another tenant's clean job: the clean job takes at most a few times its solo time (here 0.5 s
    alone; beside a 1,000-item failing job 18 s before the fix, 0.65 s after; 500 items here), and the failing
    job itself completes, every clean item of it answered.

    Each rule of the fix (2fa881f) must show when undone, not only both at once. With the automatic job places
    (two batches per worker) each covers for the other: the failing job's held places leave it no room to
    crowd the clean job, isolated or not. With 200 places (`--jobs-max-inflight`) the failing job holds 200 in
    slow re-runs when the clean job comes: with one pool of places for all tenants (the per-tenant share
    undone) the clean job got places one at a time as re-runs ended, 3.1 s against 0.5 s alone (0.6 s with
    the share). Isolation undone, the clean job's time barely moves here (the per-tenant share and the
    background share of re-runs bound it: 0.6-0.8 s), and whether the failing job is isolated at all turns on
    the order its outcomes come back in (2 costly failures among its last 64), so it is not asserted here:
    tests/unit/jobs/test_failing_job_policy.py checks each rule alone, in-process."""
    config, keys = _tenants(tmp_path, "acme", "globex")
    s = server_factory(
        "--devices",
        "1",
        "--sim-batch-ms",
        "20",
        "--max-batch-size",
        "20",
        "--config",
        config,
        "--sim-fail-marker",
        "FAIL",
        "--jobs-max-inflight",
        "200",
        "--jobs-db",
        str(tmp_path / "j.db"),
    )
    clean = [f"clean-{i}" for i in range(400)]
    failing = [f"FAIL-{i}" if i % 10 == 0 else f"ok-{i}" for i in range(500)]  # its bisection runs ~5 s
    acme = s.client(headers=bearer(keys["acme"]))
    globex = s.client(headers=bearer(keys["globex"]))
    with acme, globex:
        solo, done = _run_job(globex, clean)
        assert done["completed"] == 400
        bad = acme.post("/v1/batches", json={"inputs": failing}).json()
        wait_for(lambda: acme.get(f"/v1/batches/{bad['id']}").json()["failed"] > 0, timeout=30, every=0.02)
        beside, done = _run_job(globex, clean)
        assert done["completed"] == 400
        assert finished(acme, bad["id"]) is None  # the clean job ran beside the failing one, all the way
        bad_done = wait_for(lambda: finished(acme, bad["id"]), timeout=120, every=0.1)
        lines = results(acme, bad["id"])
    assert beside <= 2.5 * solo + 0.5, f"clean job: {solo:.2f} s alone, {beside:.2f} s beside the failing job"
    assert (bad_done["completed"], bad_done["failed"]) == (450, 50)
    assert all((line["status"] == "failed") == failing[i].startswith("FAIL") for i, line in enumerate(lines))


def _interactive_until(url: str, key: str, rate: float, stop: threading.Event, statuses: list[int]) -> None:
    """Steady interactive load from another tenant, in a thread, until `stop`."""

    async def main() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=bearer(key)) as session:

            async def one(i: int) -> None:
                async with session.post(url + "/v1/inference", json={"input": f"live-{i}"}) as r:
                    statuses.append(r.status)

            await open_loop(rate, stop, one)

    asyncio.run(main())


@pytest.mark.serial  # its clean job's time beside the failing one against alone: other workers' load skews it
def test_beside_interactive_load_a_failing_job_does_not_hold_another_tenants_job(tmp_path, server_factory):
    """With interactive work queued most of the time, job re-runs wait for its gaps. A batch holding job items
    of two tenants, one failing, dragged the other's items into those slow re-runs, and the places the failing
    job took first stayed held there (before: the clean job did not finish in 60 s; here 0.7 s alone, 0.9 to
    1.3 s beside). A batch now takes job items of one tenant only, and each tenant takes its share at once."""
    config, keys = _tenants(tmp_path, "live", "acme", "globex")
    s = server_factory(
        "--devices",
        "2",
        "--sim-batch-ms",
        "50",
        "--max-batch-size",
        "20",
        "--config",
        config,
        "--slo-ms",
        "200",
        "--sim-fail-marker",
        "FAIL",
        "--jobs-db",
        str(tmp_path / "j.db"),
    )
    stop, statuses = threading.Event(), []
    load = threading.Thread(target=_interactive_until, args=(s.url, keys["live"], 300.0, stop, statuses))
    load.start()
    try:
        time.sleep(1.0)
        with s.client(headers=bearer(keys["acme"])) as acme, s.client(headers=bearer(keys["globex"])) as globex:
            clean = [f"clean-{i}" for i in range(300)]
            solo, done = _run_job(globex, clean, timeout=60)
            assert done["completed"] == 300
            failing = [f"FAIL-{i}" if i % 10 == 0 else f"ok-{i}" for i in range(1000)]
            acme.post("/v1/batches", json={"inputs": failing}).raise_for_status()
            beside, done = _run_job(globex, clean, timeout=60)
            assert done["completed"] == 300
    finally:
        stop.set()
        load.join()
    assert statuses and all(st == 200 for st in statuses[:50])  # the load was real and served
    assert beside <= 3 * solo + 1.0, f"clean job: {solo:.2f} s alone, {beside:.2f} s beside the failing job"
