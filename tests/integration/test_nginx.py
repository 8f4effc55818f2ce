"""batchserve behind a real nginx (Debian's package, deploy/nginx's config): issue 14 items 1 and 2.

Three sim servers on fixed loopback ports behind nginx: answers come back through the proxy as the servers
sent them, spread over every server; and a rolling restart under steady load (each server in turn: SIGTERM,
wait for its exit, a replacement on the same port, wait for /readyz) loses nothing — every request gets a 200,
the draining server's 503 DRAINING answers and its refused connections are retried once on another server.
"""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import aiohttp
import httpx
import pytest

from deploy.nginx.local import LocalNginx, free_port, start_nginx
from tests.conftest import LiveServer, open_loop, start_server

SERVERS = 3
RATE = 100.0  # requests per second through nginx during the rolling restart
GRACE_S = 1.0  # --drain-grace-s of the servers under test (the default, 5 s, would only make the test slower)
SERVER_ARGS = (
    "--devices",
    "1",
    "--sim-batch-ms",
    "50",
    "--drain-grace-s",
    str(GRACE_S),
    "--forwarded-allow-ips",
    "127.0.0.1",
)  # nginx's address, as the template's comment says


@dataclass
class Fleet:
    ports: list[int]
    servers: list[LiveServer]
    nginx: LocalNginx
    replaced: list[LiveServer] = field(default_factory=list)

    def restart(self, k: int) -> None:
        """SIGTERM server k, wait for it to exit, start its replacement on the same port, wait for /readyz."""
        old = self.servers[k]
        assert old.stop(signal.SIGTERM, timeout=60) == 0, old.log()
        self.replaced.append(old)
        self.servers[k] = start_server(*SERVER_ARGS, "--port", str(self.ports[k]))


@pytest.fixture(scope="module")
def fleet():
    ports = [free_port() for _ in range(SERVERS)]
    servers: list[LiveServer] = []
    replaced: list[LiveServer] = []
    nginx = None
    try:
        with ThreadPoolExecutor(SERVERS) as pool:  # in parallel: each start is mostly Python's imports
            futures = [pool.submit(start_server, *SERVER_ARGS, "--port", str(port)) for port in ports]
        failed = [f.exception() for f in futures if f.exception() is not None]
        servers.extend(f.result() for f in futures if f.exception() is None)
        if failed:
            raise failed[0]
        nginx = start_nginx([f"127.0.0.1:{p}" for p in ports])
        yield Fleet(ports, servers, nginx, replaced)
    finally:
        if nginx is not None:
            nginx.stop()
        for s in servers + replaced:
            s.stop(signal.SIGKILL)


def test_nginx_answers_through_the_proxy_from_every_server(fleet):
    with httpx.Client(base_url=fleet.nginx.url, timeout=10) as c:
        for i in range(12):
            r = c.post("/v1/inference", json={"input": f"through-{i}"})
            assert r.status_code == 200 and r.json()["output"] == f"through-{i}"[::-1], r.text
        # Any other answer goes back as the server sent it, in its shape.
        bad = c.post("/v1/inference", json={"input": ""})
        assert bad.status_code == 400 and bad.json()["error"] == "INVALID_REQUEST"
        missing = c.post("/v1/inference", json={"input": "x", "model": "nope"})
        assert missing.status_code == 404 and missing.json()["error"] == "MODEL_NOT_FOUND"
    by_upstream = Counter(
        re.search(r"upstream=(\S+)", line).group(1)
        for line in fleet.nginx.access_log()
        if "upstream=" in line and "/v1/inference 200" in line
    )
    assert sorted(by_upstream) == sorted(f"127.0.0.1:{p}" for p in fleet.ports)
    assert all(n >= 2 for n in by_upstream.values()), by_upstream


async def steady_load(url: str, rate: float, stop: threading.Event, outcomes: list) -> None:
    """Open-loop: one request every 1/rate s on a keep-alive session, whatever the answers, until `stop`."""
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=500), timeout=aiohttp.ClientTimeout(total=30)
    ) as session:

        async def one(i: int) -> None:
            text = f"roll-{i:05d}"
            try:
                async with session.post(url + "/v1/inference", json={"input": text}) as r:
                    body = await r.json(content_type=None)
                    ok = r.status == 200 and body.get("output") == text[::-1]
                    outcomes.append((r.status, "ok" if ok else body.get("error", "?")))
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                outcomes.append(("exception", type(exc).__name__))

        await open_loop(rate, stop, one)


def test_rolling_restart_under_load_loses_nothing(fleet):
    before = len(fleet.nginx.access_log())
    outcomes: list = []
    stop = threading.Event()
    load = threading.Thread(target=asyncio.run, args=(steady_load(fleet.nginx.url, RATE, stop, outcomes),))
    load.start()
    try:
        time.sleep(1.0)
        old_pids = [s.proc.pid for s in fleet.servers]
        for k in range(SERVERS):
            fleet.restart(k)
        time.sleep(1.0)
    finally:
        stop.set()
        load.join(60)
    assert [s.proc.pid for s in fleet.servers] != old_pids and all(s.proc.poll() is None for s in fleet.servers)

    counts = Counter(outcomes)
    lost = {
        k: n
        for k, n in counts.items()
        if not (k == (200, "ok") or (k[0] == 503 and k[1] in ("DRAINING", "SERVICE_OVERLOADED", "NO_HEALTHY_WORKER")))
    }
    assert len(outcomes) >= RATE * 3 and not lost, f"lost: {lost} of {len(outcomes)}; all: {dict(counts)}"
    # Stronger: nginx passed every refusal to another server, so no client saw even a 503.
    assert counts[(200, "ok")] == len(outcomes), dict(counts)
    # And the restarts did meet traffic: some requests were answered by a second server after a refusal.
    retried = [line for line in fleet.nginx.access_log()[before:] if re.search(r"upstream_status=\d+, 200", line)]
    assert retried, "no request was retried: the restarts never met the load"
