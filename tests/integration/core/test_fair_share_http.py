"""Tenants of a tier share the model by tokens, over real HTTP (issue 33, item 2, its first "Done when" line).

A real server with the real all-MiniLM-L6-v2 model; two API keys of tier `paid` (rates far above what is sent),
tenants `long` and `short`, both backlogged by closed loops (8 and 16: each keeps several batches of inputs
outstanding; bench/fairness.py's client and LOOPS: a refused request is sent again after 50 ms): `long` sends 4
inputs of 220 tokens a request, `short` 16 of 8, to /v1/embeddings.
The tokens served to each (summed usage.prompt_tokens of its answers inside the window) are within 1.25x of each
other in the bench; this test allows 1.35x, as it runs beside other tests' load. On b6ba887 the length classes
took a batch a turn (a batch of 4 long inputs against one of 16-64 short
ones), the short class went first whenever it was full by count, and admission counted items: the long tenant
got 2.2x the tokens in this scenario (bench/results/fairness-*). The timing figures (tokens per second,
refusals) belong to the bench; this asserts the share only.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.fairness import closed_loops, ratio
from tests.conftest import start_server
from tests.integration.http.test_tenancy import add_key

WARMUP_S = 3.0
WINDOW_S = 20.0  # extended (up to MAX_S) until each tenant has MIN_ANSWERS answers: a long request is 880 tokens
MIN_ANSWERS, MAX_S = 12, 45.0
# Pinned, not derived from a warm-up a busy machine slows: the bound admission keeps under pressure (slo x slack),
# and each request's deadline, so a long request's 4 inputs (each alone in a batch when a busy CPU lowers the
# batch budget) are refused by the objective rather than all by a 4 s deadline.
SLO_MS, TIMEOUT_MS = 5000, 20000


@pytest.mark.slow
def test_two_backlogged_tenants_of_long_and_short_inputs_are_served_equal_tokens(tmp_path: Path) -> None:
    config = tmp_path / "bs.toml"
    config.write_text('[[models]]\nname = "minilm"\nbackend = "minilm"\n')
    keys = {tenant: add_key(config, tenant, "paid", "--rate", "100000") for tenant in ("long", "short")}
    server = start_server("--config", str(config), "--slo-ms", str(SLO_MS), timeout=300)
    try:
        served = asyncio.run(
            closed_loops(
                server.url,
                keys,
                WINDOW_S,
                WARMUP_S,
                backoff_s=0.05,
                timeout_ms=TIMEOUT_MS,
                min_answers=MIN_ANSWERS,
                max_s=MAX_S,
            )
        )
    finally:
        server.stop()
    figures = {t: (s.tokens, s.answered, s.refused, s.other, round(s.window_s, 1)) for t, s in served.items()}
    print("tokens, answered, refused, other, window s:", figures)
    # Refused at the door or answered; a 504 (an admitted input that waited past its deadline: the door's
    # prediction on a machine whose speed changes under it) is counted but is not what this test is about.
    assert not any(set(s.other) - {"504"} for s in served.values()), figures
    assert all(s.answered for s in served.values()), figures
    # The 1.25x is the bench's claim (bench/fairness.py, recorded): beside CI's other workers at load 8
    # one run measured 1.2509. 1.35 still fails the count-shared queue (2.2x) and the 1.5x.
    assert ratio(served) <= 1.35, figures
