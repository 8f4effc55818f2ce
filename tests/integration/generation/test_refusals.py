"""A caller refused again and again waits its turn before its next body is read (issue 28, the soak's 1 MB
prompts): through a live generation
server (the policy's unit tests: tests/unit/core/test_refusals.py)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from batchserve.core.refusals import MAX_WAIT_S
from tests.conftest import LiveServer
from tests.integration.jobs.test_routes import wait_for


@pytest.mark.slow  # --generation on: the engine loads and warms SmolLM2's real weights
def test_a_tenant_looping_refused_prompts_is_slowed_and_another_is_not(
    keyed_generation: tuple[LiveServer, dict[str, str]],
) -> None:
    s, keys = keyed_generation  # conftest.py: --refused-per-s 4, and tenants acme and globex of their own
    huge = {"messages": [{"role": "user", "content": "hello world " * 80_000}], "max_tokens": 2}  # ~0.96 MB: 400
    statuses: list[int] = []
    stop = threading.Event()

    def flood() -> None:
        with httpx.Client(base_url=s.url, timeout=60, headers={"Authorization": f"Bearer {keys['acme']}"}) as c:
            while not stop.is_set():
                statuses.append(c.post("/v1/chat/completions", json=huge).status_code)

    floods = [threading.Thread(target=flood) for _ in range(2)]
    for t in floods:
        t.start()
    try:
        # Until acme's burst (8) is spent and it is being slowed: a few refusals past it, not a fixed 3 s.
        wait_for(lambda: len(statuses) >= 12, timeout=30, every=0.05)
        with httpx.Client(base_url=s.url, timeout=60, headers={"Authorization": f"Bearer {keys['globex']}"}) as c:
            began = time.perf_counter()
            other = c.post("/v1/chat/completions", json=huge)
            other_s = time.perf_counter() - began
            ok = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        counted_at, counted = time.monotonic(), len(statuses)
        time.sleep(2.0)  # ~8 answers at 4 a second (~9 with one at each edge: 4.5/s), hundreds unslowed
        rate = (len(statuses) - counted) / (time.monotonic() - counted_at)
    finally:
        stop.set()
        for t in floods:
            t.join(60)
    assert set(statuses) == {400}, statuses
    # At 4 refusals a second (burst 8), two clients looping get about 4 answers a second, not hundreds (the
    # soak's two clients got ~650 a second, each 1 MB read and parsed). Slower is fine: a loaded machine.
    assert rate <= 4 * 1.5 + 1, rate
    # globex was refused too, but was never slowed by acme's refusals; its good request is served.
    assert other.status_code == 400 and other_s < MAX_WAIT_S, other_s
    assert ok.status_code == 200, ok.text
