"""Start and stop the servers a benchmark measures: batchserve on the sim backend, and the bare baseline.

Why a module of its own: a benchmark that leaves a server behind poisons the next run (and the neighbours'
CPU). Every server started here is recorded, started in its own session (so a Ctrl-C in the terminal does not
half-kill it), and stopped by its PID: SIGTERM (batchserve drains), then SIGKILL after a bounded wait.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUNNING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


class ServerFailed(RuntimeError):
    """The server exited or never became ready; the message carries its log's tail."""


@dataclass
class Server:
    name: str
    cmd: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    port: int = 0
    started_at: float = field(default_factory=time.monotonic)
    ready_s: float = 0.0  # from the process's start to /readyz answering 200 (loading, warm-up, graph capture)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


_started: list[Server] = []


def clean_env() -> dict[str, str]:
    """The environment without BATCHSERVE_* variables, so only the flags on the command line apply."""
    return {k: v for k, v in os.environ.items() if not k.startswith("BATCHSERVE_")}


def spawn(server: Server, env: dict[str, str] | None = None, cwd: Path = REPO) -> Server:
    """Start `server.cmd` in `cwd`, in a session of its own, its output in its log; the run guard stops it
    however the run ends (`stop_all`). `env`: variables added to the (BATCHSERVE_*-free) environment."""
    server.log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(server.log_path, "wb") as log:
        server.proc = subprocess.Popen(
            server.cmd,
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**clean_env(), **(env or {})},
            start_new_session=True,
        )
    _started.append(server)
    return server


def start(
    name: str,
    cmd: list[str],
    log_dir: Path,
    timeout_s: float = START_TIMEOUT_S,
    env: dict[str, str] | None = None,
    *,
    port: int = 0,
    health: str = "/readyz",
    cwd: Path = REPO,
) -> Server:
    """`spawn` `cmd`, then wait for GET `health` to answer 200 on `port`, or, port 0, on the port uvicorn's
    "running on" line names."""
    server = spawn(Server(name, cmd, log_dir / f"{name}.log", port=port), env, cwd)
    assert server.proc is not None
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        if server.proc.poll() is not None:
            raise ServerFailed(f"{name} exited with {server.proc.returncode}:\n{server.log_tail()}")
        if not server.port:
            found = RUNNING.search(server.log_path.read_text(errors="replace"))
            if found:
                server.port = int(found.group(1))
        if server.port and ready(server.base, health):
            server.ready_s = time.monotonic() - server.started_at
            return server
        time.sleep(0.1)
    stop(server)
    raise ServerFailed(f"{name} was not ready within {timeout_s:.0f}s:\n{server.log_tail()}")


def add_key(config: Path, tenant: str, tier: str, rate: float | None = 100000.0, root: Path = REPO) -> str:
    """`batchserve keys add` of the tree at `root` (another commit's, for a base run): it appends only the key's
    digest to `config` and prints the key, returned here. `rate`: the key's own limit, by default far above what
    a bench sends, so only the fair queue and admission act (None: its tier's)."""
    cmd = [sys.executable, "-m", "batchserve", "keys", "add", "--config", str(config), "--tenant", tenant]
    cmd += ["--tier", tier, *(["--rate", f"{rate:g}"] if rate is not None else [])]
    env = {**clean_env(), "PYTHONPATH": str(root)}
    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=60)
    key = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    if not key:
        raise RuntimeError(f"keys add failed ({out.returncode}): {out.stderr.strip()}")
    return key


def ready(base: str, health: str = "/readyz") -> bool:
    try:
        with urllib.request.urlopen(base + health, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def stop(server: Server) -> None:
    """SIGTERM by PID, then SIGKILL if it has not exited within STOP_TIMEOUT_S."""
    proc = server.proc
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT_S)
    except ProcessLookupError:
        pass


def stop_all() -> None:
    """Stop every server this process started that is still running (safe to call more than once)."""
    while _started:
        stop(_started.pop())


def serve_cmd(backend: str, *flags: str) -> list[str]:
    """`batchserve serve` of `backend` on a free port, with no drain grace (a bench stops its server with nobody
    left to answer); `flags` come after, so they may give one."""
    serve = [sys.executable, "-m", "batchserve", "serve", "--port", "0", "--backend", backend]
    return [*serve, "--drain-grace-s", "0", *flags]


def batchserve_cmd(devices: int, sim_batch_ms: float, max_batch_size: int, extra: list[str]) -> list[str]:
    """The sim on `devices` devices, `sim_batch_ms` a batch, batches up to `max_batch_size`."""
    sim = ["--devices", str(devices), "--sim-batch-ms", f"{sim_batch_ms:g}", "--max-batch-size", str(max_batch_size)]
    return serve_cmd("sim", *sim, *extra)


def bare_cmd(hold_ms: float = 0.0) -> list[str]:
    return [sys.executable, "-m", "bench.bare_app", "--port", "0", "--hold-ms", f"{hold_ms:g}"]


def minimal_cmd() -> list[str]:
    """The minimal asyncio batcher (bench/minimal_batcher.py): the reference row for one device."""
    return [sys.executable, "-m", "bench.minimal_batcher", "--port", "0"]


def stop_on_signals() -> list[int]:
    """On SIGTERM/SIGINT stop every server started here at once and raise KeyboardInterrupt; returns the list
    the received signals are appended to, so a run loop can check it (an interrupt raised inside a callback of
    the event loop may be swallowed, and then no new row should start)."""
    stopping: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        stopping.append(signum)
        stop_all()
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stopping
