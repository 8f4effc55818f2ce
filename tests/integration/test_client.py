"""batchserve.client and the CLI on it (`batchserve infer`, `batchserve jobs`): the retry policy as pure
functions with an injected random source, then against a real sim server: callers that a small queue refuses
(503 SERVICE_OVERLOADED with retry_after_ms) all get their answer through the client's retries, sync and async;
a job submitted from the CLI is watched to its end (with a progress bar on a terminal) and its results
printed."""

from __future__ import annotations

import ast
import asyncio
import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest

from batchserve.client import AsyncClient, BatchserveError, Client, Retry
from tests.conftest import LiveServer, start_server

CALLERS = 12


# -- against a live server ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_queue(tmp_path_factory: pytest.TempPathFactory):
    """One device, batches of at most 2 taking 300 ms, room for 2 waiting: a burst of 12 is mostly refused."""
    root = tmp_path_factory.mktemp("client")
    s = start_server(
        "--devices",
        "1",
        "--max-batch-size",
        "2",
        "--sim-batch-ms",
        "300",
        "--max-queue",
        "2",
        "--slo-ms",
        "20000",
        "--timeout-ms",
        "30000",
        "--jobs-db",
        str(root / "jobs.db"),
    )
    yield s
    s.stop()


def burst(call) -> list:
    """`call(i)` from CALLERS threads released at once; what each returned (or raised)."""
    out: list = [None] * CALLERS
    gate = threading.Barrier(CALLERS)

    def one(i: int) -> None:
        gate.wait()
        try:
            out[i] = call(i)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(CALLERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_the_burst_overloads_the_server_without_retries(small_queue: LiveServer):
    """The premise of the next tests: the same burst, one plain try each, gets refusals with a hint."""
    with small_queue.client() as c:
        answers = burst(lambda i: c.post("/v1/inference", json={"input": f"x{i}"}))
    refused = [r for r in answers if r.status_code == 503]
    assert refused and all(r.json()["error"] == "SERVICE_OVERLOADED" for r in refused)
    assert all(r.json()["retry_after_ms"] > 0 for r in refused)
    with Client(small_queue.url, retry=Retry(attempts=1)) as bs:  # and without retries the client raises it
        failures = [a for a in burst(lambda i: bs.infer(f"y{i}")) if isinstance(a, BatchserveError)]
    assert failures and all(f.status == 503 and f.error == "SERVICE_OVERLOADED" and f.request_id for f in failures)


def test_every_caller_gets_its_answer_through_the_retries(small_queue: LiveServer):
    retries: list[tuple[int, float, BatchserveError]] = []
    with Client(small_queue.url, retry=Retry(attempts=50, deadline_s=90), on_retry=lambda *a: retries.append(a)) as bs:
        answers = burst(lambda i: bs.infer(f"input {i}"))
    assert [a["output"] for a in answers] == [f"input {i}"[::-1] for i in range(CALLERS)], answers
    assert retries, "nobody was refused: the burst did not overload the server"
    for _attempt, wait, err in retries:
        assert err.status == 503 and err.retry_after_ms is not None and wait >= err.retry_after_ms / 1000


def test_the_async_client_retries_the_same_way(small_queue: LiveServer):
    retries: list = []

    async def main() -> list[dict]:
        async with AsyncClient(
            small_queue.url, retry=Retry(attempts=50, deadline_s=90), on_retry=lambda *a: retries.append(a)
        ) as bs:
            return await asyncio.gather(*(bs.infer(f"async {i}") for i in range(CALLERS)))

    answers = asyncio.run(main())
    assert [a["output"] for a in answers] == [f"async {i}"[::-1] for i in range(CALLERS)]
    assert retries


def test_the_client_runs_a_job_from_submit_to_results(small_queue: LiveServer):
    with Client(small_queue.url) as bs:
        job = bs.submit_job(["a", "bc", "def"], metadata={"who": "test"})
        seen: list[str] = []
        done = bs.wait_job(job["id"], poll_s=0.1, on_progress=lambda j: seen.append(j["status"]))
        assert done["status"] == "completed" and seen[-1] == "completed"
        assert [r["output"] for r in bs.job_results(job["id"])] == ["a", "cb", "fed"]
        assert bs.cancel_job(job["id"])["status"] == "completed"  # a finished job comes back unchanged
        with pytest.raises(BatchserveError) as missing:
            bs.get_job("batch_nonexistent")
        assert missing.value.status == 404


def cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "batchserve", *args], capture_output=True, text=True, timeout=120, **kw
    )


def test_cli_infer_prints_the_output(small_queue: LiveServer):
    done = cli("infer", "hello", "--url", small_queue.url)
    assert done.returncode == 0 and done.stdout == "olleh\n", done.stderr
    whole = json.loads(cli("infer", "hello", "--json", "--url", small_queue.url).stdout)
    assert whole["output"] == "olleh" and whole["model"] == "sim@v1"
    refused = cli("infer", "hello", "--model", "nope", "--url", small_queue.url)
    assert refused.returncode == 1 and refused.stderr.startswith("batchserve infer: error: 404 MODEL_NOT_FOUND")


def test_cli_jobs_submit_wait_completes_and_prints_results_without_a_bar_in_a_pipe(
    small_queue: LiveServer, tmp_path: Path
):
    inputs = tmp_path / "inputs.txt"
    inputs.write_text("one\n\ntwo\nthree\n")
    done = cli("jobs", "submit", str(inputs), "--wait", "--poll-s", "0.1", "--url", small_queue.url)
    assert done.returncode == 0, done.stderr
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["index"], r["status"], r["output"]) for r in results] == [
        (0, "completed", "eno"),
        (1, "completed", "owt"),
        (2, "completed", "eerht"),
    ]
    assert done.stderr == ""  # stderr is a pipe here: no progress drawn into it
    job_id = json.loads(cli("jobs", "submit", str(inputs), "--url", small_queue.url).stdout)["id"]
    got = json.loads(cli("jobs", "get", job_id, "--url", small_queue.url).stdout)
    assert got["id"] == job_id and got["total"] == 3


def test_cli_jobs_submit_wait_draws_a_progress_bar_on_a_terminal(small_queue: LiveServer, tmp_path: Path):
    inputs = tmp_path / "inputs.json"
    inputs.write_text(json.dumps([f"item {i}" for i in range(6)]))
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal's size
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "batchserve",
                "jobs",
                "submit",
                str(inputs),
                "--wait",
                "--poll-s",
                "0.1",
                "--url",
                small_queue.url,
            ],
            stdout=subprocess.PIPE,
            stderr=follower,
            text=True,
        )
        os.close(follower)
        drawn = b""
        while True:  # read the terminal until the process closes it
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: no writer left
                break
            if not chunk:
                break
            drawn += chunk
        out, _ = proc.communicate(timeout=120)
    finally:
        os.close(leader)
    assert proc.returncode == 0
    assert len(out.splitlines()) == 6
    bar = drawn.decode(errors="replace")
    assert "6/6" in bar and "completed" in bar, bar


def test_the_readme_client_example_runs_as_written(small_queue: LiveServer, capsys: pytest.CaptureFixture):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    example = readme.split("## Python client", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert len(example.strip().splitlines()) == 5
    exec(example.replace("http://127.0.0.1:8000", small_queue.url), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == " slauqe E"
    assert [r["output"] for r in ast.literal_eval(printed[1])] == ["tac a", "god a"]


def test_embed_returns_one_vector_per_input_in_order(tmp_path: Path):
    (tmp_path / "vec.py").write_text(
        "class Model:\n    output_kind = 'embedding'\n"
        "    def batch(self, inputs):\n"
        "        return [[float(len(s)), 1.0] for s in inputs]\n"
    )
    path = os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])
    server = start_server("--backend", "vec:Model", "--jobs-db", "", env={"PYTHONPATH": path})
    try:
        with Client(server.url) as bs:
            assert bs.embed(["a", "bcd", "fg"], model="vec") == [[1.0, 1.0], [3.0, 1.0], [2.0, 1.0]]
            assert bs.embed("hello", model="vec") == [[5.0, 1.0]]
            with pytest.raises(BatchserveError) as missing:
                bs.embed("x", model="nope")
        assert missing.value.status == 404 and missing.value.error == "model_not_found"

        async def main() -> list[list[float]]:
            async with AsyncClient(server.url) as abs_:
                return await abs_.embed(["xy"], model="vec")

        assert asyncio.run(main()) == [[2.0, 1.0]]
    finally:
        server.stop()


def test_cli_infer_against_a_dead_port_names_the_url_without_a_status_0():
    """It printed `error: 0 CONNECTION_FAILED: [Errno 111] Connection refused`: no URL, and a status no server
    gave. --deadline-s 1 keeps the retries short."""
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    done = cli("infer", "hello", "--url", url, "--deadline-s", "1")
    assert done.returncode == 1
    assert done.stderr.startswith(
        f"batchserve infer: error: CONNECTION_FAILED: could not connect to {url}/v1/inference"
    )
    assert " 0 " not in done.stderr
