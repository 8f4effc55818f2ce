"""deploy/rayserve on a local Ray: two replicas of the sim behind Ray Serve's HTTP proxy. Answers are right,
both replicas serve, and a replica forms batches larger than Ray's default max_ongoing_requests (5) would let
it see. Slow: a local Ray takes tens of seconds to start on the 2-core CI machine."""

from __future__ import annotations

import concurrent.futures
import os
import socket
import time
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve


pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RAY_DEFAULT_MAX_ONGOING = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def proxy_url():
    # Ray's worker processes inherit the driver's environment: let them import this checkout's packages.
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), saved]))
    from deploy.rayserve.app import build_app

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # A long default timeout: on a busy machine (the slow lane beside three xdist workers) a request that
        # Ray's proxy holds can reach its replica past the default the warm-up derives (one 504 in 96, once).
        # This test is about routing and batch sizes; deadlines have tests of their own.
        args = "--backend sim --sim-batch-ms 200 --max-batch-size 64 --timeout-ms 20000"
        app = build_app({"args": args, "replicas": 2, "num_cpus": 0.5})
        serve.run(app, name="batchserve", route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        give_up = time.monotonic() + 120
        while time.monotonic() < give_up:
            if serve.status().applications["batchserve"].status == "RUNNING":
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"not running: {serve.status()}")
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def replicas_health(client: httpx.Client, want: int = 2, within_s: float = 60.0) -> dict[int, dict]:
    """/internal/health of each replica by pid. Ray's router sends each GET to one replica, preferring the one
    with fewer requests in flight, and its proxy learns of a replica some time after the app reads RUNNING:
    so ask in rounds of concurrent GETs (two in flight at once split between idle replicas) until every replica
    has answered, for a time rather than a count (200 quick sequential GETs once all met one replica)."""
    seen: dict[int, dict] = {}
    give_up = time.monotonic() + within_s
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        while time.monotonic() < give_up:
            for response in pool.map(lambda _: client.get("/internal/health"), range(8)):
                health = response.raise_for_status().json()
                seen[health["pid"]] = health
            if len(seen) == want:
                return seen
            time.sleep(0.2)
    raise AssertionError(f"only {len(seen)} replica(s) answered /internal/health in {within_s:.0f} s")


def served_batches(health: dict) -> int:
    return sum(w["batches"] for w in health["workers"])


def test_two_replicas_answer_through_rays_proxy_in_full_batches(proxy_url: str):
    with httpx.Client(base_url=proxy_url, timeout=30) as client:
        before = replicas_health(client)
        assert all(h["status"] == "ok" for h in before.values()), before  # warm before Ray routed to them
        texts = [f"ray-{i:03d}" for i in range(96)]

        def infer(text: str) -> httpx.Response:
            return client.post("/v1/inference", json={"input": text})

        with concurrent.futures.ThreadPoolExecutor(48) as pool:
            answers = list(pool.map(infer, texts))
        assert [a.status_code for a in answers] == [200] * len(texts), [a.text for a in answers if a.status_code != 200]
        assert [a.json()["output"] for a in answers] == [t[::-1] for t in texts]

        after = replicas_health(client)
        assert after.keys() == before.keys()
        for pid in after:
            assert served_batches(after[pid]) > served_batches(before[pid]), f"replica {pid} served nothing"
        biggest = max(int(size) for h in after.values() for m in h["batch_ms_by_size"].values() for size in m)
        assert biggest > RAY_DEFAULT_MAX_ONGOING, "no batch larger than Ray's default max_ongoing_requests"
