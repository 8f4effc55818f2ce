"""The port opens at once: /healthz answers while the models load and warm, /readyz and the model routes say
503 "warming up" until they are ready, every stage logs a line, and SIGTERM during warm-up stops the process
without waiting for the warm-up. Driven through HTTP against a real server whose plugin warms until the test
lets it (a gate file), so nothing here depends on timing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import start_server

GATED = """
import os, time

class Model:
    def warm(self):
        while not os.path.exists(os.environ["WARM_GATE"]):
            time.sleep(0.02)

    def batch(self, inputs):
        return [s.upper() for s in inputs]
"""


def gated_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    (tmp_path / "gated.py").write_text(GATED)
    gate = tmp_path / "gate"
    path = os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {"PYTHONPATH": path, "WARM_GATE": str(gate)}, gate


def wait_for(predicate, timeout: float = 30.0) -> None:
    give_up = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < give_up, "condition not reached"
        time.sleep(0.05)


def test_healthz_answers_and_readyz_says_warming_up_until_the_warm_up_ends(tmp_path: Path):
    env, gate = gated_env(tmp_path)
    server = start_server(
        "--backend",
        "gated:Model",
        "--jobs-db",
        str(tmp_path / "jobs.db"),
        "--slo-ms",
        "5000",
        "--timeout-ms",
        "10000",
        env=env,
        ready=False,
    )
    try:
        with server.client() as c:
            assert c.get("/healthz").status_code == 200
            ready = c.get("/readyz")
            assert ready.status_code == 503 and ready.json()["reason"] == "warming up"
            # every model route answers at once with a JSON 503 the caller can retry, none hangs
            r = c.post("/v1/inference", json={"input": "hi"}, timeout=5)
            assert r.status_code == 503 and r.json()["error"] == "NO_HEALTHY_WORKER", r.text
            assert r.json()["retry_after_ms"] > 0 and r.json()["request_id"]
            jobs = c.get("/v1/batches/batch_none", timeout=5)
            assert jobs.status_code == 503 and "warming up" in jobs.json()["message"]
            wait_for(lambda: "warm-up round 1 " not in server.log() and "loaded gated@v1" in server.log())
            gate.touch()
            wait_for(lambda: c.get("/readyz").status_code == 200)
            r = c.post("/v1/inference", json={"input": "hi"})
            assert r.status_code == 200 and r.json()["output"] == "HI"
        log = server.log()
        # one line per stage, in order: loading, loaded, set up, each warm-up round with its time, ready
        stages = [
            "loading gated@v1",
            "loaded gated@v1 in",
            "set up gated@v1 on cpu",
            "warm-up round 1 of gated@v1",
            "warm-up round 2 of gated@v1",
            "ready: 1 worker",
        ]
        positions = [log.find(s) for s in stages]
        assert -1 not in positions and positions == sorted(positions), log
        assert log.find("Uvicorn running") < log.find("warm-up round 1")  # the port opened before warming
    finally:
        assert server.stop() == 0


# A warm-up inside torch when the process stops: the interpreter finalizing under that thread once made torch's
# C++ runtime abort the process (SIGABRT, "terminate called without an active exception").
TORCH_WARM = """
import torch

class Model:
    def warm(self):
        a = torch.randn(400, 400)
        while True:
            a = torch.tanh(a @ a)

    def batch(self, inputs):
        return inputs
"""


@pytest.mark.parametrize("plugin", ["gated", "torchwarm"])
def test_sigterm_during_the_warm_up_stops_the_process_at_once_and_cleanly(tmp_path: Path, plugin: str):
    env, _gate = gated_env(tmp_path)  # the gate never opens: the warm-up would run for ever
    (tmp_path / "torchwarm.py").write_text(TORCH_WARM)
    server = start_server("--backend", f"{plugin}:Model", "--jobs-db", "", env=env, ready=False)
    with server.client() as c:
        assert c.get("/healthz").status_code == 200
    wait_for(lambda: f"set up {plugin}@v1" in server.log())
    time.sleep(0.5)  # well inside the warm-up
    started = time.monotonic()
    assert server.stop(signal.SIGTERM, timeout=20) == 0, server.log()
    assert time.monotonic() - started < 20
    assert "draining" in server.log() and "terminate called" not in server.log()


def test_a_backend_that_fails_its_warm_up_exits_2_with_its_line_last(tmp_path: Path):
    (tmp_path / "badwarm.py").write_text(
        "class Model:\n    def warm(self):\n        raise ValueError('cannot warm')\n"
        "    def batch(self, inputs):\n        return inputs\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "batchserve", "serve", "--port", "0", "--backend", "badwarm:Model", "--jobs-db", ""],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("batchserve: error: backend 'badwarm:Model'") and "cannot warm" in last, done.stderr
    assert "Traceback" not in done.stderr


def test_no_progress_bars_when_stderr_is_not_a_terminal():
    """transformers reads the hub's switch when it is imported: the CLI sets it first (not on a terminal)."""
    code = (
        "import os, sys; os.environ.pop('HF_HUB_DISABLE_PROGRESS_BARS', None); os.environ.pop('TQDM_DISABLE', None)\n"
        "from batchserve.cli import quiet_progress_bars\n"
        "quiet_progress_bars(sys.argv[1] == 'tty')\n"
        "from transformers.utils import logging\n"
        "print(logging.is_progress_bar_enabled())\n"
    )
    for mode, enabled in (("file", "False"), ("tty", "True")):
        done = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=120)
        assert done.stdout.strip() == enabled, done.stderr
