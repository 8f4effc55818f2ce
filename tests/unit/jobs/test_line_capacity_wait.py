"""A generation line of an OpenAI batch refused for capacity waits for capacity, with backoff, until the batch's
completion window closes (issue 33: 84 of 100 lines were recorded failed SERVICE_OVERLOADED after the
scheduler's ~5 quick retries within ~30 s). In-process, with an injected clock and sleep and the engine's
answer played by a fake `complete`. Fails without the wait: the first 503 reached the scheduler."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from batchserve import errors
from batchserve.config import Settings
from batchserve.errors import ApiError
from batchserve.jobs import lines
from batchserve.jobs.lines import CAPACITY_BACKOFF_CAP_S, LineRunner, window_end
from tests.unit.fakes import Clock

LINE = orjson.dumps(
    {
        "custom_id": "1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    }
).decode()


class Engine:
    cfg = type("Cfg", (), {"model_id": "SmolLM2-135M-Instruct"})()


def runner(clock: Clock, slept: list[float]) -> LineRunner:
    async def sleep(s: float) -> None:
        slept.append(s)
        clock.t += s

    return LineRunner(
        door=None,
        settings=Settings(),
        count_tokens=lambda m, t: 0,  # type: ignore[arg-type]
        engine=Engine(),
        clock=clock,
        sleep=sleep,
    )  # type: ignore[arg-type]


def refusing(times: int, calls: list[dict[str, Any]]) -> Any:
    async def complete(
        settings: Any,
        engine: Any,
        body: bytes,
        chat: bool,
        tier: int,
        tenant: str = "",
        max_wait_s: float | None = None,
    ) -> bytes:
        calls.append({"tenant": tenant, "max_wait_s": max_wait_s, "tier": tier})
        if len(calls) <= times:
            raise errors.overloaded(
                "predicted wait for KV-cache capacity 42.6 s would pass the 30.0 s limit", retry_after_ms=12_600
            )
        return b'{"ok": true}'

    return complete


def test_a_line_refused_for_capacity_waits_with_backoff_and_completes(monkeypatch: Any) -> None:
    clock, slept, calls = Clock(1_000.0), [], []
    monkeypatch.setattr(lines, "complete", refusing(12, calls))

    async def main() -> Any:
        r = runner(clock, slept)
        run = r.start(
            "/v1/chat/completions",
            LINE,
            "m",
            "acme",
            600.0,
            expires_at=window_end(clock.t, {"completion_window": "24h"}),
        )
        run.feed(alone=False)  # the scheduler's feed starts it on the engine
        return await run.future

    result = asyncio.run(main())
    assert result.status_code == 200 and len(calls) == 13  # 12 refusals, then answered: never failed
    assert all(c["tenant"] == "acme" and c["tier"] == 3 for c in calls)  # in its tenant's batch lane
    assert calls[0]["max_wait_s"] == pytest.approx(24 * 3600)  # it may wait in the engine's queue for its window
    assert slept[0] >= 12.6 * 0.99  # at least the engine's Retry-After
    assert all(s <= CAPACITY_BACKOFF_CAP_S for s in slept) and sum(slept) > 60  # backoff, far past ~30 s


def test_past_its_window_the_refusal_goes_to_the_scheduler(monkeypatch: Any) -> None:
    clock, slept, calls = Clock(1_000.0), [], []
    monkeypatch.setattr(lines, "complete", refusing(1_000, calls))

    async def main() -> Any:
        run = runner(clock, slept).start("/v1/chat/completions", LINE, "m", "acme", 600.0, expires_at=clock.t + 100)
        run.feed(alone=False)  # the scheduler's feed starts it on the engine
        return await run.future

    with pytest.raises(ApiError) as err:
        asyncio.run(main())
    assert err.value.code == "SERVICE_OVERLOADED" and clock.t == pytest.approx(1_100, abs=1)
    assert sum(slept) <= 100 + 1e-9  # never sleeps past the window


def test_other_errors_are_not_waited_on(monkeypatch: Any) -> None:
    clock, slept = Clock(1_000.0), []

    async def complete(*args: Any, **kw: Any) -> bytes:
        raise errors.draining()

    monkeypatch.setattr(lines, "complete", complete)

    async def main() -> Any:
        run = runner(clock, slept).start("/v1/chat/completions", LINE, "m", "acme", 600.0, expires_at=clock.t + 3600)
        run.feed(alone=False)
        return await run.future

    with pytest.raises(ApiError):
        asyncio.run(main())
    assert slept == []


def test_the_window_is_the_batchs() -> None:
    assert window_end(1_000.0, {"completion_window": "24h"}) == 1_000.0 + 86_400
    assert window_end(1_000.0, None) is None
