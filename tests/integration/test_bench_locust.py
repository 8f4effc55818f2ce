"""The shipped locustfile (bench/locustfile.py), run headless by locust itself against live sim servers: a clean
run has no failures and runs only the classes whose surface the server serves, and past capacity the server's
refusals are counted apart, not as failures."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import LiveServer, start_server

ROOT = Path(__file__).resolve().parents[2]


def run_locust(url: str, out: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[dict[str, str]]]:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "locust",
            "-f",
            "bench/locustfile.py",
            "--headless",
            "-H",
            url,
            "--csv",
            str(out / "run"),
            "--exit-code-on-error",
            "1",
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
    )
    rows = list(csv.DictReader((out / "run_stats.csv").open())) if (out / "run_stats.csv").exists() else []
    return run, rows


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, list[dict[str, str]]]:
    """20 users for 4 s against a sim server (1 device, batches of up to 100 every 100 ms: ~1,000/s) with a job
    store: far below capacity."""
    tmp = tmp_path_factory.mktemp("locust-clean")
    server = start_server("--jobs-db", str(tmp / "jobs.db"))
    try:
        return run_locust(
            server.url,
            tmp,
            "-u",
            "20",
            "-r",
            "20",
            "-t",
            "4s",
            "--bs-job-items",
            "5",
            "--bs-job-pace",
            "0.5",
            "--bs-job-poll",
            "0.3",
        )
    finally:
        server.stop()


def test_a_run_below_capacity_has_no_failures_and_the_servers_timings(clean_run) -> None:
    run, rows = clean_run
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    by_name = {r["Name"]: r for r in rows}
    http = [r for r in rows if r["Type"] in ("GET", "POST", "DELETE")]
    assert http and sum(int(r["Request Count"]) for r in http) > 50, rows
    assert all(r["Failure Count"] == "0" for r in rows), rows
    inference = int(by_name["/v1/inference"]["Request Count"])
    # The server's own timings, as rows of type `server`: one per answer of /v1/inference.
    for name in ("latency_ms /v1/inference", "queue_ms /v1/inference", "compute_ms /v1/inference"):
        assert by_name[name]["Type"] == "server" and abs(int(by_name[name]["Request Count"]) - inference) <= 2
    assert 100 <= float(by_name["compute_ms /v1/inference"]["Median Response Time"]) <= 150  # the sim's 100 ms


def test_only_the_classes_whose_surface_the_server_serves_run(clean_run) -> None:
    """The sim serves /v1/inference, KServe v2 and (with a job store) batch jobs; not embeddings, chat or rerank,
    which would fail here with 404s were their classes run."""
    run, rows = clean_run
    names = {r["Name"] for r in rows}
    assert {
        "/v1/inference",
        "/v2/models/{name}/infer",
        "/v1/batches",
        "/v1/batches/{id}/results",
        "done /v1/batches",
    } <= names, names
    assert not names & {"/v1/embeddings", "/v1/chat/completions", "/v1/rerank"}, names
    assert "left out: ChatUser, EmbeddingsUser, RerankUser" in run.stderr + run.stdout


def test_past_capacity_the_refusals_are_counted_apart(tmp_path: Path) -> None:
    """30 users at 2 requests/s each (60/s) against a sim of ~20/s (batches of at most 2 every 100 ms): the
    503s with retry_after_ms are rows of their own, successes, and the run passes."""
    server: LiveServer = start_server("--max-batch-size", "2", "--jobs-db", "")
    try:
        run, rows = run_locust(server.url, tmp_path, "-u", "30", "-r", "30", "-t", "3s", "--bs-pace", "2")
    finally:
        server.stop()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    refused = [r for r in rows if r["Name"].endswith(" refused 503")]
    assert refused and sum(int(r["Request Count"]) for r in refused) > 20, rows
    assert all(r["Failure Count"] == "0" for r in rows), rows
    counts = {r["Name"]: int(r["Request Count"]) for r in rows}
    surfaces = ("/v1/inference", "/v2/models/{name}/infer")
    # Both classes sent, and answers came back; one class may have been refused throughout 3 s at 3x capacity (its
    # users spawned after the other's had filled the queue), which is the door's doing, not the locustfile's.
    assert all(counts.get(name, 0) + counts.get(f"{name} refused 503", 0) > 0 for name in surfaces), counts
    assert sum(counts.get(name, 0) for name in surfaces) > 0, counts
