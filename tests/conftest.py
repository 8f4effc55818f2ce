"""A real server process on an ephemeral port, and real HTTP clients against it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Awaitable, Callable

import httpx
import pytest

PORT_LINE = re.compile(r"Uvicorn running on http://[\d.]+:(\d+)")

# The servers the tests start run torch on one intra-op thread, not the default of every core: CI runs two or
# three pytest processes and their servers side by side on 2 cores, where a model split over 2 threads per
# server only trades the cores between them (a test that sets --torch-threads itself still wins).
os.environ.setdefault("BATCHSERVE_TORCH_THREADS", "1")
# And one in the test process, whenever a test first imports torch (the test modules import it where they use
# it, not at collection): torch reads OMP_NUM_THREADS as it loads. A torch op on 2 threads waits for whichever
# one is descheduled (a tiny model's forward took 2x the time and 2x the CPU, spinning).
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported before this conftest (a plugin)
    sys.modules["torch"].set_num_threads(1)


def _compiled_once() -> None:
    """The bytecode of the package and the benches, written once per test run: with PYTHONDONTWRITEBYTECODE set
    (as on this machine) every server process the tests start (~130, more with their children) compiled all of
    batchserve from source again, ~0.35 core-s each: ~45 core-s, ~20 s of the suite's time on 2 cores. py_compile writes
    whatever that variable says (the imports then only read it), atomically, and skips files already current."""
    import compileall
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for package in ("batchserve", "bench"):
        compileall.compile_dir(root / package, quiet=2)


_compiled_once()


@dataclass
class LiveServer:
    proc: subprocess.Popen
    url: str
    log_lines: list[str] = field(default_factory=list)

    def log(self) -> str:
        return "\n".join(self.log_lines)

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 30), **kw)

    def wait_ready(self, timeout: float = 60) -> None:
        """Until /readyz is 200 (the models loaded and warmed): a caller that started the server with
        `ready=False` does its own work (an in-process reference load) meanwhile."""
        give_up = time.monotonic() + timeout
        with self.client() as c:
            while c.get("/readyz").status_code != 200:
                if self.proc.poll() is not None or time.monotonic() > give_up:
                    self.stop()
                    raise RuntimeError("server did not become ready:\n" + self.log())
                time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def add_key(config: Path, tenant: str, tier: str, *extra: str) -> str:
    """A new API key for `tenant` in `tier`, written to `config` by the real `batchserve keys add`."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "batchserve",
            "keys",
            "add",
            "--config",
            str(config),
            "--tenant",
            tenant,
            "--tier",
            tier,
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.strip()


def start_server(
    *args: str,
    ready: bool = True,
    env: dict[str, str] | None = None,
    timeout: float = 60,
    preexec_fn: Callable[[], None] | None = None,
) -> LiveServer:
    """Start `batchserve serve` on port 0 and return once it listens (and, if `ready`, once /readyz is 200).
    `preexec_fn` runs in the child before the server starts (e.g. to lower its descriptor limit)."""
    cmd = [sys.executable, "-m", "batchserve", "serve", "--port", "0", "--log-level", "info", *args]
    # No drain grace unless a test asks for one (--drain-grace-s wins over the variable): most tests stop
    # their servers with SIGTERM, and each would otherwise wait the default grace with nobody to answer.
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={"BATCHSERVE_DRAIN_GRACE_S": "0", **os.environ, **(env or {})},
        preexec_fn=preexec_fn,
    )
    lines: list[str] = []
    port: list[int] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())
            m = PORT_LINE.search(line)
            if m:
                port.append(int(m.group(1)))

    threading.Thread(target=pump, daemon=True).start()
    give_up = time.monotonic() + timeout
    while not port:
        if proc.poll() is not None or time.monotonic() > give_up:
            proc.kill()
            raise RuntimeError("server did not start:\n" + "\n".join(lines))
        time.sleep(0.02)
    server = LiveServer(proc, f"http://127.0.0.1:{port[0]}", lines)
    if ready:
        server.wait_ready(give_up - time.monotonic())
    return server


async def open_loop(rate: float, stop: threading.Event, one: Callable[[int], Awaitable[None]]) -> None:
    """Open-loop load: `one(i)` started every 1/rate s whatever the answers, until `stop`; then waits for all."""
    tasks, start, i = [], time.monotonic(), 0
    while not stop.is_set():
        await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        tasks.append(asyncio.create_task(one(i)))
        i += 1
    await asyncio.gather(*tasks)


def hang_up_behind_a_busy_worker(url: str, path: str, busy: dict, gone: bytes, request_id: str) -> int:
    """POST `busy` to `path` (an input that holds the only worker), then, while it runs, send `gone` with
    `request_id` on a raw socket and hang up before it is answered. Returns the busy request's status."""
    import asyncio

    import aiohttp

    host, port = url.removeprefix("http://").split(":")

    async def scenario() -> int:
        async with aiohttp.ClientSession() as s:
            held = asyncio.ensure_future(s.post(url + path, json=busy))
            await asyncio.sleep(0.2)  # the worker is busy: what comes now waits in the queue
            sock = socket.create_connection((host, int(port)))
            sock.sendall(
                b"POST %s HTTP/1.1\r\nHost: x\r\nX-Request-ID: %s\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (path.encode(), request_id.encode(), len(gone), gone)
            )
            await asyncio.sleep(0.2)
            sock.close()
            r = await held
            return r.status

    return asyncio.run(scenario())


@pytest.fixture
def server_factory():
    started: list[LiveServer] = []

    def make(*args: str, **kw) -> LiveServer:
        s = start_server(*args, **kw)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop(signal.SIGKILL if s.proc.poll() is None else signal.SIGTERM)


@pytest.fixture(scope="module")
def sim_server():
    """A shared sim server: 4 devices, 100 ms batches, roomy SLO so bursts are admitted."""
    s = start_server("--devices", "4", "--slo-ms", "3000", "--timeout-ms", "10000")
    yield s
    s.stop()


pytest_plugins = ["tests.pg_server"]  # the `pg_server` fixture: a real PostgreSQL server for the session
