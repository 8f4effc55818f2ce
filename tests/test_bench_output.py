"""Bench runs write into the checkout only when asked (issue 9 §5): a plain run prints its table and leaves
bench/results/ as it was; `--record` writes there, `--out DIR` into DIR."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SCRIPTS = ["run_standard", "drill", "overload", "tenancy_bench", "jobs_bench", "generation_bench", "fleet", "soak",
           "autoscale_signal", "embed_bench", "plan_check", "engine_loop"]


def listing() -> set[str]:
    return {str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*")} if RESULTS.exists() else set()


def bench(*args: str, tmp: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TMPDIR": str(tmp), **(env or {})})


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_bench_defaults_to_print_only(script: str) -> None:
    from bench import common

    module = importlib.import_module(f"bench.{script}")
    assert common.out_dir(module.parse_args([])) is None
    assert common.out_dir(module.parse_args(["--record"])) == RESULTS
    assert common.out_dir(module.parse_args(["--out", "/somewhere"])) == Path("/somewhere")
    assert common.out_dir(module.parse_args(["--out-dir", "/somewhere"])) == Path("/somewhere")


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
    bench(sys.executable, "-m", "bench.overload", "--duration", "1", "--rate", "50", "--out", str(out),
          "--name", "smoke", tmp=tmp_path)
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
        if out:
            assert all(o.startswith(f"{out}/") for o in outs) and (tmp_path / "out").is_dir()
        else:  # a temporary folder, never the checkout
            assert all(os.path.isabs(o) and not o.startswith(str(ROOT)) for o in outs), outs
    assert listing() == before


@pytest.mark.slow
def test_the_executor_bench_times_the_real_backend_offline() -> None:
    # The GPU check runs this part first on the lent machine: a backend API change must fail here, not there.
    import argparse

    from bench import executor_bench

    a = argparse.Namespace(max_new_tokens=2, smollm2_dir="", decode="static", sizes=[1, 2], repeats=1)
    times = executor_bench.offline(a)
    assert sorted(times) == [1, 2] and all(0 < t < 60 for t in times.values())
