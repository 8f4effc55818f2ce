"""`serve --grpc-port` as a user gets it: a fresh virtualenv with the project installed from this tree (not
editable, its core dependencies only: no torch) and the latest `tritonclient[grpc]`, whose protobuf pin moves
protobuf to its range; the server started from a directory outside the checkout and called over gRPC by
tritonclient (server ready, ModelInfer). The project is installed first and tritonclient after it, as a user adds
Triton's client to a server's environment. Slow: pip fetches ~40 packages (a minute or two, less from its cache)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PORTS = re.compile(r"Uvicorn running on http://[\d.]+:(\d+)|gRPC \(KServe v2\) listening on [\d.]+:(\d+)")

CLIENT = """
import sys, time
import numpy as np
import tritonclient.grpc as triton
client = triton.InferenceServerClient(sys.argv[1])
give_up = time.monotonic() + 60
while not client.is_server_ready():
    assert time.monotonic() < give_up, "never ready"
    time.sleep(0.1)
tensor = triton.InferInput("input", [2], "BYTES")
tensor.set_data_from_numpy(np.array([b"a cat", b"a dog"], dtype=object))
print(" ".join(o.decode() for o in client.infer("sim", [tensor]).as_numpy("output")))
"""


@pytest.mark.slow
@pytest.mark.parallel  # answers only, no timing: CI runs it in the parallel workers
def test_a_fresh_venv_with_the_latest_tritonclient_serves_grpc_from_outside_the_checkout(tmp_path: Path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # As a user does: the server first, Triton's client added later (pip then moves protobuf into its pin,
    # leaving the server's own packages as they are).
    for what in (str(ROOT), "tritonclient[grpc]"):
        out = subprocess.run([*pip, what], capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
        assert out.returncode == 0, out.stdout + out.stderr
    check = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True, env=env, timeout=120)
    assert check.returncode == 0, check.stdout
    versions = subprocess.run(
        [
            python,
            "-c",
            "import importlib.metadata as m; print(*(m.version(p) for p in ('tritonclient', 'protobuf', 'grpcio')))",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    ).stdout.strip()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    server = subprocess.Popen(
        [
            str(venv / "bin" / "batchserve"),
            "serve",
            "--backend",
            "sim",
            "--port",
            "0",
            "--grpc-port",
            "0",
            "--log-level",
            "info",
        ],
        cwd=elsewhere,
        env={**env, "BATCHSERVE_DRAIN_GRACE_S": "0"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        grpc_port = None
        give_up = time.monotonic() + 60
        assert server.stdout is not None
        while grpc_port is None and time.monotonic() < give_up:
            line = server.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = PORTS.search(line)
            if m and m.group(2):
                grpc_port = int(m.group(2))
        assert grpc_port, f"tritonclient, protobuf, grpcio {versions}: no gRPC port\n" + "".join(lines)
        called = subprocess.run(
            [python, "-c", CLIENT, f"127.0.0.1:{grpc_port}"],
            capture_output=True,
            text=True,
            env=env,
            cwd=elsewhere,
            timeout=120,
        )
        assert called.stdout.strip() == "tac a god a", f"{versions}\n{called.stdout}{called.stderr}"
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
