"""The generation routes' part of the SLO ledger (issue 33), in process: `serving.generate` on a real Engine
whose stepper answers each prompt with a few tokens on the loop (no model), through Starlette and httpx's ASGI
transport. Each answer is booked once, by its time to the first token, with cost = prompt + completion tokens;
a 504 after waiting for a slot is `expired`; a 400 is no outcome."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette

from batchserve.config import Settings
from batchserve.core.refusals import RefusalThrottle
from batchserve.generation import routes
from batchserve.decoding.build import EngineConfig
from batchserve.decoding.engine import Engine
from batchserve.decoding.stepper import SamplingParams, KvCapacity, TokenUpdate
from batchserve.http.guards import Guard, Tenancy
from batchserve.metrics import make_metrics
from bench.engine_loop import FeedStepper
from tests.unit.decoding.test_units import CHARS, char_tokenizer

HOLD = 9  # a prompt starting with this token id is never answered: it holds its slot


class AnsweringStepper(FeedStepper):
    """Answers each added prompt with "abc" after `delay_s`, on the loop, as a stepper delivers its steps."""

    def __init__(self, delay_s: float = 0.0, step_s: float = 0.01) -> None:
        super().__init__(KvCapacity(blocks=4, page_size=16, max_seqs=1, max_sequence_tokens=64), step_s=step_s)
        self.delay_s = delay_s

    def add(
        self, seq_id: str, prompt_ids: list[int], params: SamplingParams, background: bool = False, tenant: str = ""
    ) -> None:
        if prompt_ids[0] != HOLD:
            update = TokenUpdate(seq_id, [CHARS.index(c) for c in "abc"], True)
            asyncio.get_running_loop().call_later(self.delay_s, self.deliver, [update])


class Door:
    """What the route asks of the inference service: open, and the in-flight count."""

    def check_open(self, needs_workers: bool = True) -> None:
        pass

    def hold(self) -> None:
        pass

    def release(self) -> None:
        pass


def served(delay_s: float = 0.0, slo_s: float = 10.0, step_s: float = 0.01) -> tuple[Starlette, Guard, Engine]:
    cfg = EngineConfig(max_tokens=16, max_seqs=1, page_size=16, queue_timeout_s=0.2)
    tokenizer = SimpleNamespace(backend_tokenizer=char_tokenizer(), eos_token_id=len(CHARS) + 5)
    stepper = AnsweringStepper(delay_s, step_s)
    engine = Engine(cfg, tokenizer, stepper, CollectorRegistry(), max_position=64, vocab_size=len(CHARS))
    stepper.start(None, engine._on_updates)
    guard = Guard(Tenancy(), make_metrics(), slo_s=slo_s)
    app = Starlette(routes=routes.ROUTES)
    app.state.rt = SimpleNamespace(
        settings=Settings(),
        guard=guard,
        service=Door(),
        generation=engine,
        startup_error="",
        refusals=RefusalThrottle(0.0),
    )
    return app, guard, engine


async def post(app: Starlette, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        return await client.post("/v1/completions", json=body)


def booked(guard: Guard, engine: Engine, outcome: str) -> float:
    labels = {"model": engine.cfg.model_id, "tier": "paid", "outcome": outcome}
    return guard.metrics.registry.get_sample_value("batchserve_slo_requests_total", labels) or 0


def test_an_answer_is_booked_once_with_its_tokens():
    app, guard, engine = served()

    async def main() -> httpx.Response:
        return await post(app, {"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0})

    r = asyncio.run(main())
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["total_tokens"] == 6  # 3 prompt + 3 completion
    assert booked(guard, engine, "met") == 1 and booked(guard, engine, "slow") == 0
    mine = guard.usage.report("anonymous")
    assert mine["cost_served"] == 6 and mine["inputs"]["met"] == 1 and mine["latency_ms"]["count"] == 1
    assert (
        guard.metrics.registry.get_sample_value(
            "batchserve_cost_served_total", {"model": engine.cfg.model_id, "tier": "paid"}
        )
        == 6
    )


def test_a_first_token_past_the_slo_is_slow():
    app, guard, engine = served(delay_s=0.05, slo_s=0.01)

    async def main() -> httpx.Response:
        return await post(app, {"prompt": [1, 2, 3], "max_tokens": 8, "stream": True})

    r = asyncio.run(main())
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert booked(guard, engine, "slow") == 1 and booked(guard, engine, "met") == 0
    assert guard.usage.report("anonymous")["latency_ms"]["p50"] >= 50


def test_waiting_past_the_queue_timeout_is_expired_and_a_bad_body_no_outcome():
    app, guard, engine = served()

    async def main() -> tuple[httpx.Response, httpx.Response]:
        engine._tick_task = asyncio.ensure_future(engine._tick())  # the engine's expiry of waiting sequences
        holder = asyncio.ensure_future(post(app, {"prompt": [HOLD, 1], "max_tokens": 8}))  # the only slot
        await asyncio.sleep(0.05)
        behind = await post(app, {"prompt": [1, 2], "max_tokens": 8})  # waits 0.2 s for it: 504
        bad = await post(app, {"prompt": [1, 2], "max_tokens": 0})
        holder.cancel()
        engine._tick_task.cancel()
        return behind, bad

    behind, bad = asyncio.run(main())
    assert behind.status_code == 504, behind.text
    assert bad.status_code == 400
    assert booked(guard, engine, "expired") == 1
    assert sum(guard.usage.report("anonymous")["requests"].values()) == 1  # the 504; the 400 is not an outcome


def test_refused_at_the_engine_door_is_refused():
    app, guard, engine = served(step_s=1.0)  # the holder's 16 tokens free the slot in ~16 s: past the 0.2 s timeout

    async def main() -> httpx.Response:
        holder = asyncio.ensure_future(post(app, {"prompt": [HOLD, 1], "max_tokens": 16}))
        await asyncio.sleep(0.05)
        refused = await post(app, {"prompt": [1, 2], "max_tokens": 8})
        holder.cancel()
        return refused

    r = asyncio.run(main())
    assert r.status_code == 503, r.text
    assert booked(guard, engine, "refused") == 1
    assert guard.usage.report("anonymous")["requests"]["refused"] == 1
