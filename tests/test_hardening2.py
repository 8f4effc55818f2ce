"""Issue 28's second hardening round, each finding through a live server (items 2, 4, 6 and 7; the rest of the
issue is tested beside its own code). Each test failed before its fix; docs/hardening.md states the guarantee.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import statistics
import sys
import textwrap
from pathlib import Path
import threading
import time

import httpx
import orjson
import pytest

from tests.conftest import LiveServer
from tests.test_hardening import _free_port, _try_get, connect, read_answer
from tests.test_jobs import wait_for


def owned_by(address: str) -> dict[str, str]:
    return {"X-Forwarded-For": address}


# -- item 4: proxy headers only from the proxies the operator names ----------------------------------------------
def test_forwarded_for_is_believed_only_from_named_proxies(server_factory):
    plain = server_factory("--devices", "1", "--sim-batch-ms", "5")
    with plain.client() as c:
        # A local caller poses as 10.0.0.9: by default that header is ignored, the record is its own address's.
        assert c.post("/v1/inference", json={"input": "ab"},
                      headers={**owned_by("10.0.0.9"), "X-Request-ID": "posed"}).status_code == 200
        assert c.get("/v1/requests/posed").status_code == 200
        assert c.get("/v1/requests/posed", headers=owned_by("10.0.0.9")).status_code == 200
    behind = server_factory("--devices", "1", "--sim-batch-ms", "5", "--forwarded-allow-ips", "127.0.0.1",
                            "--request-history", "20")
    with behind.client() as c:
        assert c.post("/v1/inference", json={"input": "ab"},
                      headers={**owned_by("10.0.0.9"), "X-Request-ID": "kept"}).status_code == 200
        assert c.get("/v1/requests/kept").status_code == 404  # the proxy's own address is another caller
        assert c.get("/v1/requests/kept", headers=owned_by("10.0.0.9")).status_code == 200
        # item 7: the request history is kept per caller: another caller's 60 requests (3 x the history)
        # evict its own oldest records, not 10.0.0.9's one.
        for i in range(60):
            r = c.post("/v1/inference", json={"input": "x"}, headers={**owned_by("10.0.0.8"), "X-Request-ID": f"f{i}"})
            assert r.status_code == 200
        assert c.get("/v1/requests/kept", headers=owned_by("10.0.0.9")).status_code == 200
        assert c.get("/v1/requests/f59", headers=owned_by("10.0.0.8")).status_code == 200
        assert c.get("/v1/requests/f0", headers=owned_by("10.0.0.8")).status_code == 404


def test_a_bad_forwarded_allow_ips_stops_the_start():
    done = subprocess.run([sys.executable, "-m", "batchserve", "serve", "--port", "0", "--forwarded-allow-ips",
                           "127.0.0.1,not-an-address"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--forwarded-allow-ips" in done.stderr and "not-an-address" in done.stderr
