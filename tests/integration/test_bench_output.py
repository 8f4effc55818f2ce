"""Bench runs write into the checkout only when asked (issue 9 §5), the part that starts servers, subprocesses or the
real model; the in-process part is tests/unit/test_bench_output.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


def listing() -> set[str]:
    return {str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*")} if RESULTS.exists() else set()


def bench(*args: str, tmp: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TMPDIR": str(tmp), **(env or {})},
    )


def test_the_run_guard_stops_its_servers_and_says_why(tmp_path: Path) -> None:
    from bench import common, servers

    def sleeper() -> servers.Server:  # stands in for a server: stop() only needs the process
        server = servers.Server("sleeper", [], tmp_path / "sleeper.log")
        server.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        servers._started.append(server)
        return server

    handler = signal.getsignal(signal.SIGINT)
    rep: dict = {}
    with common.guarded(rep) as stopping:
        server = sleeper()
        assert stopping == [] and signal.getsignal(signal.SIGINT) is not handler
        raise servers.ServerFailed("boom")
    assert server.proc is not None and server.proc.poll() is not None
    assert rep == {"error": "boom"} and signal.getsignal(signal.SIGINT) is handler
    with pytest.raises(KeyboardInterrupt), common.guarded():  # without a report the interrupt goes on
        server = sleeper()
        raise KeyboardInterrupt
    assert server.proc is not None and server.proc.poll() is not None


def test_a_run_prints_and_writes_only_where_asked(tmp_path: Path) -> None:
    before = listing()
    run = bench(sys.executable, "-m", "bench.overload", "--duration", "1", "--rate", "50", tmp=tmp_path)
    assert "# " in run.stdout and "not recorded" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    assert listing() == before
    out = tmp_path / "out"
    bench(
        sys.executable,
        "-m",
        "bench.overload",
        "--duration",
        "1",
        "--rate",
        "50",
        "--out",
        str(out),
        "--name",
        "smoke",
        tmp=tmp_path,
    )
    assert (out / "smoke.md").exists() and (out / "smoke.json").exists()
    assert list((out / "logs" / "smoke").glob("*.log"))
    assert listing() == before


def test_the_gpu_check_writes_only_into_out(tmp_path: Path) -> None:
    # The script with a stand-in for python that records its arguments: the real runs need a GPU (or minutes).
    calls = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    fake.chmod(0o755)
    before = listing()
    for out in ("", str(tmp_path / "out")):
        calls.write_text("")
        run = bench("bash", "bench/gpu_check.sh", "--tiny", tmp=tmp_path, env={"OUT": out, "PYTHON": str(fake)})
        assert run.returncode == 0, run.stderr
        runs = [line for line in calls.read_text().splitlines() if "--out " in line]
        assert len(runs) >= 2, runs  # the parts that write tables (offline, continuous batching, ...)
        outs = [line.split("--out ", 1)[1].split()[0] for line in runs]
        # the stages write into a temporary work folder, never the checkout ...
        assert all(os.path.isabs(o) and not o.startswith(str(ROOT)) for o in outs), outs
        if out:  # ... and $OUT gets the few files a device call brings back (at most 8): the tables, packed
            got = sorted(p.name for p in (tmp_path / "out").iterdir())
            assert "check.md" in got and "tables.tgz" in got and len(got) <= 8, got
            assert "## agree" in (tmp_path / "out" / "check.md").read_text()
    assert listing() == before


@pytest.mark.slow
@pytest.mark.parallel  # in process, its times only bounded (under 60 s): CI runs it in the parallel workers
def test_the_executor_bench_times_the_real_backend_offline() -> None:
    # The GPU check runs this part first on the lent machine: a backend API change must fail here, not there.
    import argparse

    from bench import executor_bench

    a = argparse.Namespace(
        max_new_tokens=2, smollm2_dir="", decode="static", backend="smollm2", sizes=[1, 2], repeats=1
    )
    off = executor_bench.offline(a)
    assert sorted(off.seconds) == [1, 2] and all(0 < t < 60 for t in off.seconds.values())
    assert off.padded_to == ()  # the CPU runs a batch at its own size


def test_a_recorded_load_table_gets_its_plot_beside_it(tmp_path: Path) -> None:
    """p95 and goodput versus offered load, batchserve beside the ideal batcher: a PNG next to the table,
    shown in the markdown; a plain run still writes nothing (test_a_run_prints_and_writes_only_where_asked)."""
    import json

    from matplotlib.image import imread

    out = tmp_path / "out"
    run = bench(
        sys.executable,
        "-m",
        "bench.run_standard",
        "--rows",
        "1:50,1:150",
        "--duration",
        "1",
        "--warmup",
        "0.25",
        "--skip-cpu",
        "--out",
        str(out),
        "--tag",
        "plot",
        tmp=tmp_path,
    )
    pngs = list(out.glob("standard-*-plot.png"))
    assert len(pngs) == 1, run.stdout[-2000:] + run.stderr[-2000:]
    md = pngs[0].with_suffix(".md").read_text()
    assert f"]({pngs[0].name})" in md and str(pngs[0]) in run.stdout
    height, width, _ = imread(pngs[0]).shape
    assert width > height > 200
    assert len(json.loads(pngs[0].with_suffix(".json").read_text())["rows"]) == 2


def test_the_agreement_check_runs_both_paths_on_the_cpu(tmp_path: Path) -> None:
    # On a CPU the candidate is the same code at exact shapes against the GPU's padded ones: they must agree,
    # and the run must exercise what it claims (rows ending at EOS, sampled requests, more requests than slots).
    import json

    from bench import gpu_agree

    out = tmp_path / "agree.md"
    assert gpu_agree.main(["--device", "cpu", "--tiny", "--slots", "8", "--requests", "16", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["path"] for r in rows] == ["static", "slots"] and all(r["agree"] for r in rows)
    assert all(r["ended_at_eos"] > 0 for r in rows) and rows[1]["sampled"] > 0 and rows[1]["requests"] == 16
    assert "**yes**" in out.read_text()


FAKE_EMBEDDER = """
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the bench's client expects

    def log_message(self, *args):
        pass

    def do_POST(self):
        text = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["input"]
        status, width = (503, 0) if text == "refuse" else (200, 3 if text == "short" else 384)
        answer = {"data": [{"embedding": [0.5] * width}]} if status == 200 else {"error": {"code": "busy"}}
        body = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def test_the_embedding_load_counts_each_answer_by_what_it_was() -> None:
    """bench/embed_bench.drive (capacity_embed's load, sent by bench/rawclient.py): every scheduled request after
    the warm-up is counted once, as answered (a 200 with one vector of the model's width), refused (by its
    status) or wrong, against an HTTP/1.1 server that answers each input its own way."""
    import numpy as np
    import uvloop

    from bench import servers
    from bench.embed_bench import Target, drive
    from bench.schedule import poisson_schedule

    server = servers.Server("fake", [sys.executable, "-c", FAKE_EMBEDDER], Path(os.devnull))
    server.proc = subprocess.Popen(server.cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert server.proc.stdout is not None
        url = f"http://127.0.0.1:{int(server.proc.stdout.readline())}/v1/embeddings"
        texts = ["a", "refuse", "short"]
        row = uvloop.run(drive(Target("fake", server, url, False), 90.0, 1.5, 0.5, 7, texts, 5.0))
    finally:
        server.proc.kill()
        server.proc.wait()
    index = np.arange(len(poisson_schedule(90.0, 2.0, 7)))
    measured = index[poisson_schedule(90.0, 2.0, 7) >= 0.5]
    kinds = [int((measured % 3 == k).sum()) for k in range(3)]
    assert row.count == len(measured) and min(kinds) > 10
    assert row.ok == kinds[0] and row.errors == {"503": kinds[1], "wrong length": kinds[2]}
    assert row.p95_ms < 1000
