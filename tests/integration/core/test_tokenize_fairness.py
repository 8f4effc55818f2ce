"""The tokenizer stage serves tenants in turn (core/tokenize_stage.py), over real HTTP on a real server.

A folder embedder the test builds (tests/hf_folders: WordPiece, 64 tokens, random weights), two API keys of tier
`paid`. Tenant `small` sends one short input a request from 2 closed loops, first alone, then beside tenant `big`,
whose 4 closed loops each send 60 inputs of 16,000 characters a request (~960 KB bodies) with `timeout_ms` 1,
so every one of its requests is refused at the door, after the tokenizer stage. `small` keeps at least
`MIN_SHARE` of the answers it got alone (before and after the flood, in the same test). Before, the stage
tokenized every waiting text in arrival order in one call: each of `small`'s requests waited behind calls of up
to 4 x 60 x 16,000 characters and got a few answers where it had hundreds. `big`'s refusals are all clear JSON
errors (400 `timeout_too_short`, known once its inputs are priced); the server's memory is not what this checks
(bench/tokenize_bench.py measures it).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import aiohttp
import pytest

from tests import hf_folders
from tests.conftest import start_server
from tests.integration.http.test_tenancy import add_key, bearer

PHASE_S = 4.0
BIG_INPUTS, BIG_CHARS, BIG_LOOPS, SMALL_LOOPS = 60, 16_000, 4, 2
# The share of its answers alone `small` keeps beside the flood. Before the stage took turns it kept a few of
# hundreds (under 5 %); with turns it keeps 40-70 % here, the rest going to the loop reading big's ~1 MB bodies
# on the same 2 cores, which no tokenizer order gives back.
MIN_SHARE = 0.3


def long_text(seed: int) -> str:
    rng = random.Random(seed)
    text = ""
    while len(text) < BIG_CHARS:
        text += rng.choice(hf_folders.WORDS) + " "
    return text[:BIG_CHARS]


async def small_answers(url: str, key: str, seconds: float) -> int:
    answered = 0
    stop = time.monotonic() + seconds

    async def loop(s: aiohttp.ClientSession, i: int) -> None:
        nonlocal answered
        n = 0
        while time.monotonic() < stop:
            n += 1
            async with s.post(
                url + "/v1/embeddings", json={"input": f"the cat {i} {n}", "model": "emb"}, headers=bearer(key)
            ) as r:
                await r.read()
                answered += r.status == 200

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(loop(s, i) for i in range(SMALL_LOOPS)))
    return answered


async def beside_big(url: str, small: str, big: str) -> tuple[int, dict[int, int]]:
    statuses: dict[int, int] = {}
    done = asyncio.Event()
    # Encoded once: the test's own client must not take the CPU the server's loop needs.
    bodies = [
        json.dumps(
            {"input": [long_text(i * BIG_INPUTS + j) for j in range(BIG_INPUTS)], "model": "emb", "timeout_ms": 1}
        ).encode()
        for i in range(BIG_LOOPS)
    ]
    headers = {**bearer(big), "Content-Type": "application/json"}

    async def flood(s: aiohttp.ClientSession, body: bytes) -> None:
        while not done.is_set():
            async with s.post(url + "/v1/embeddings", data=body, headers=headers) as r:
                answer = await r.json()
                statuses[r.status] = statuses.get(r.status, 0) + 1
                assert r.status == 200 or "error" in answer, answer

    async with aiohttp.ClientSession() as s:
        floods = [asyncio.ensure_future(flood(s, body)) for body in bodies]
        await asyncio.sleep(0.5)  # the flood under way
        answered = await small_answers(url, small, PHASE_S)
        done.set()
        await asyncio.gather(*floods)
    return answered, statuses


@pytest.mark.serial
def test_a_tenant_of_huge_refused_inputs_leaves_another_most_of_its_answers(tmp_path: Path) -> None:
    folder = hf_folders.embedder(tmp_path / "emb")
    config = tmp_path / "bs.toml"
    keys = {tenant: add_key(config, tenant, "paid", "--rate", "100000") for tenant in ("small", "big")}
    server = start_server("--config", str(config), "--model", f"emb={folder}", "--slo-ms", "2000", timeout=180)
    try:
        asyncio.run(small_answers(server.url, keys["small"], 0.5))  # warm
        before = asyncio.run(small_answers(server.url, keys["small"], PHASE_S))
        beside, statuses = asyncio.run(beside_big(server.url, keys["small"], keys["big"]))
        after = asyncio.run(small_answers(server.url, keys["small"], PHASE_S))
    finally:
        server.stop()
    alone = (before + after) / 2  # around the flood: a shared machine's speed drifts within seconds
    print(f"small alone {before} then {after}, beside big {beside}; big's statuses {statuses}")
    assert alone > 20 and sum(statuses.values()) >= BIG_LOOPS and 200 not in statuses, (alone, statuses)
    assert beside >= MIN_SHARE * alone, (before, after, beside, statuses)
