"""The one request path (`http/endpoint.py`) in process: a declared endpoint (dialect, parse, handle, render)
driven as uvicorn drives an ASGI app, with a real Guard, Tenancy and metrics. What the skeleton owns is checked
here once for every route: the caller refused before its body is read, tokens taken by what the body holds, the
body bounded, every exit counted (an answer, a refusal, a caller gone, an unexpected failure), errors in the
endpoint's dialect, and the streamed answer."""

from __future__ import annotations

import ipaddress

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from batchserve import errors
from batchserve.config import Settings
from batchserve.core.tiers import BATCH
from batchserve.core.work import Work
from batchserve.errors import ClientGone
from batchserve.http.dialects import KSERVE, NATIVE, OPENAI, Dialect
from batchserve.http.endpoint import Answer, Call, Endpoint, Stream
from batchserve.http.guards import Guard, Tenancy, digest
from batchserve.metrics import make_metrics

KEY = "bs_unit-key"


class Cycle:
    """uvicorn's request cycle as an endpoint sees it: the body once, the `disconnected` flag, what was sent."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.read = False
        self.disconnected = False
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.answer = b""
        self.chunks: list[bytes] = []

    async def receive(self) -> dict:
        if not self.read:
            self.read = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = {k.lower(): v for k, v in message["headers"]}
        else:
            self.answer += message.get("body", b"")
            self.chunks.append(message.get("body", b""))


def served(burst: float = 100.0) -> SimpleNamespace:
    tenancy = Tenancy.from_settings(
        Settings(keys=[{"tenant": "t", "tier": "paid", "sha256": digest(KEY), "rate": 0.001, "burst": burst}])
    )
    rt = SimpleNamespace(settings=Settings(max_body_bytes=64), guard=Guard(tenancy, make_metrics(), slo_s=10.0))
    return rt


def parse(rt: Any, call: Call, body: bytes) -> list[str]:
    data = orjson.loads(body) if body else None
    if not isinstance(data, list) or not data:
        raise errors.invalid("the body must be a non-empty list")
    call.work.model = "m@v1"
    call.work.inputs = len(data)
    return data


async def handle(rt: Any, call: Call, texts: list[str]) -> list[str]:
    if "gone" in texts:
        raise ClientGone()
    if "crash" in texts:
        raise ZeroDivisionError("a bug")
    if "overloaded" in texts:
        raise errors.overloaded("busy", 1200)
    call.work.cost = float(len(texts))
    return [t.upper() for t in texts]


def render(rt: Any, call: Call, texts: list[str], out: list[str]) -> Answer:
    return Answer(orjson.dumps(out), headers=((b"x-answer", b"yes"),))


def endpoint(dialect: Dialect = NATIVE, **options: Any) -> Endpoint:
    return Endpoint(dialect, parse, handle, render, **options)


def run(
    ep: Endpoint, rt: SimpleNamespace, body: bytes, key: str | None = KEY, extra: tuple[tuple[bytes, bytes], ...] = ()
) -> Cycle:
    cycle = Cycle(body)
    headers = [(b"content-type", b"application/json"), (b"x-request-id", b"unit-1"), *extra]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/unit",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "app": SimpleNamespace(state=SimpleNamespace(rt=rt)),
    }
    asyncio.run(ep(scope, cycle.receive, cycle.send))
    return cycle


def sample(rt: SimpleNamespace, name: str, **labels: str) -> float:
    return rt.guard.metrics.registry.get_sample_value(name, labels) or 0.0


def booked(rt: SimpleNamespace, model: str, outcome: str) -> float:
    return sample(rt, "batchserve_slo_requests_total", model=model, tier="paid", outcome=outcome)


def test_an_answer_goes_out_whole_with_its_headers_and_is_booked() -> None:
    rt = served()
    cycle = run(endpoint(), rt, b'["a", "b"]')
    assert cycle.status == 200 and orjson.loads(cycle.answer) == ["A", "B"]
    assert cycle.headers[b"x-request-id"] == b"unit-1" and cycle.headers[b"x-answer"] == b"yes"
    assert cycle.headers[b"content-length"] == b"%d" % len(cycle.answer)
    assert b"x-ratelimit-remaining" in cycle.headers  # the rate-limit headers ride on every answer
    assert booked(rt, "m@v1", "met") == 1 and rt.guard.answered == 1
    assert sample(rt, "batchserve_cost_served_total", model="m@v1", tier="paid") == 2


@pytest.mark.parametrize("dialect", [NATIVE, OPENAI, KSERVE], ids=lambda d: d.name)
def test_a_wrong_key_is_refused_before_the_body_is_read(dialect: Dialect) -> None:
    rt = served()
    cycle = run(endpoint(dialect), rt, b'["a"]', key="bs_wrong")
    assert cycle.status == 401 and not cycle.read
    assert cycle.headers[b"www-authenticate"] == b"Bearer" and cycle.headers[b"x-request-id"] == b"unit-1"
    data = orjson.loads(cycle.answer)
    if dialect is NATIVE:
        assert data["error"] == "UNAUTHORIZED" and data["request_id"] == "unit-1"
    elif dialect is OPENAI:
        assert data["error"]["type"] == "authentication_error" and data["error"]["code"] == "unauthorized"
    else:
        assert set(data) == {"error"} and isinstance(data["error"], str)
    assert sample(rt, "batchserve_requests_total", model="unknown", status="401") == 1


def test_tokens_known_from_the_body_are_taken_after_it_and_an_empty_bucket_is_refused_before_it() -> None:
    rt = served(burst=3)
    by_body = endpoint(tokens=len)
    assert run(by_body, rt, b'["a", "b"]').status == 200  # 2 of 3 tokens
    refused = run(by_body, rt, b'["a", "b"]')  # 1 left, 2 asked: refused once the body says 2
    assert refused.status == 429 and refused.read and b"retry-after" in refused.headers
    assert run(by_body, rt, b'["a"]').status == 200  # the last token
    empty = run(by_body, rt, b'["a"]')
    assert empty.status == 429 and not empty.read  # an empty bucket: before the body
    assert booked(rt, "m@v1", "refused") == 1 and booked(rt, "unknown", "refused") == 1


def test_a_body_over_the_limit_is_a_413_and_an_invalid_one_a_400_both_counted() -> None:
    rt = served()
    big = run(endpoint(), rt, orjson.dumps(["x" * 100]))
    assert big.status == 413 and orjson.loads(big.answer)["error"] == "PAYLOAD_TOO_LARGE"
    bad = run(endpoint(OPENAI), rt, b"{}")
    assert bad.status == 400 and orjson.loads(bad.answer)["error"]["type"] == "invalid_request_error"
    assert sample(rt, "batchserve_requests_total", model="unknown", status="413") == 1
    assert sample(rt, "batchserve_requests_total", model="unknown", status="400") == 1
    assert rt.guard.answered == 2


def test_a_door_refusal_is_rendered_in_the_dialect_and_booked_to_the_model() -> None:
    rt = served()
    cycle = run(endpoint(KSERVE), rt, b'["overloaded"]')
    assert cycle.status == 503 and orjson.loads(cycle.answer) == {"error": "busy"}
    assert cycle.headers[b"retry-after"] == b"2" and cycle.headers[b"x-request-id"] == b"unit-1"
    assert booked(rt, "m@v1", "refused") == 1


def test_an_unexpected_failure_is_a_500_in_the_dialect_logged_and_counted(caplog) -> None:
    rt = served()
    cycle = run(endpoint(OPENAI), rt, b'["crash"]')
    assert cycle.status == 500
    inner = orjson.loads(cycle.answer)["error"]
    assert inner["type"] == "server_error" and inner["code"] == "internal_error" and "a bug" not in inner["message"]
    assert "ZeroDivisionError" in caplog.text
    assert sample(rt, "batchserve_requests_total", model="m@v1", status="500") == 1
    assert booked(rt, "m@v1", "failed") == 1


def test_a_caller_gone_gets_nothing_and_is_counted_as_a_499() -> None:
    rt = served()
    cycle = run(endpoint(), rt, b'["gone"]')
    assert cycle.status == 0 and cycle.answer == b""
    assert sample(rt, "batchserve_requests_total", model="m@v1", status="499") == 1
    assert booked(rt, "m@v1", "met") == 0 and booked(rt, "m@v1", "refused") == 0


def test_a_stream_is_written_as_it_comes_and_closed_once() -> None:
    rt = served()
    closed: list[str] = []

    async def chunks() -> AsyncIterator[bytes]:
        for part in (b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"):
            yield part

    def stream(rt: Any, call: Call, texts: list[str], out: list[str]) -> Stream:
        call.booked = True  # a stream books its own outcome when it ends
        return Stream(chunks(), closed.append)

    cycle = run(Endpoint(OPENAI, parse, handle, stream), rt, b'["a"]')
    assert cycle.status == 200 and cycle.headers[b"content-type"] == b"text/event-stream"
    assert [c for c in cycle.chunks if c] == [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
    assert closed == ["200"] and booked(rt, "m@v1", "met") == 0  # booked by the wing, not twice


GATEWAY = ((b"x-llm-d-inference-fairness-id", b"team-7"), (b"x-llm-d-inference-objective", b"flex"))


@pytest.mark.parametrize("trusted", [True, False])
def test_a_gateways_fairness_id_and_objective_are_believed_from_its_address_only(trusted: bool) -> None:
    seen: list[Work] = []

    async def spy(rt: Any, call: Call, texts: list[str]) -> list[str]:
        seen.append(call.work)
        return texts

    rt = served()
    rt.guard.gateways = (ipaddress.ip_network("127.0.0.0/8" if trusted else "10.0.0.0/8"),)
    cycle = run(Endpoint(NATIVE, parse, spy, render), rt, b'["a"]', extra=GATEWAY)
    assert cycle.status == 200
    if trusted:
        assert (seen[0].tenant, seen[0].tier) == ("gateway:team-7", BATCH.rank)
        assert cycle.headers[b"x-service-tier"] == b"batch"
    else:  # anyone else could name another's lane or a higher tier
        assert (seen[0].tenant, seen[0].tier) == ("t", 1) and b"x-service-tier" not in cycle.headers


class ChunkedReceive:
    """An ASGI server other than uvicorn (no `disconnected` flag on `receive`), sending the body in two messages:
    the door's disconnect watch must not start reading `receive` before the skeleton has read the whole body."""

    def __init__(self, parts: list[bytes]) -> None:
        self.parts = parts

    async def __call__(self) -> dict:
        await asyncio.sleep(0)  # each message a loop turn apart, as a socket's reads are
        if self.parts:
            body = self.parts.pop(0)
            return {"type": "http.request", "body": body, "more_body": bool(self.parts)}
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}


def test_the_disconnect_watch_starts_after_the_body_is_read_whole() -> None:
    rt = served()
    cycle = Cycle(b"")
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/unit",
        "headers": [(b"content-type", b"application/json"), (b"authorization", f"Bearer {KEY}".encode())],
        "client": ("127.0.0.1", 1),
        "app": SimpleNamespace(state=SimpleNamespace(rt=rt)),
    }

    async def main() -> None:
        await asyncio.wait_for(endpoint()(scope, ChunkedReceive([b'["a", ', b'"b"]']), cycle.send), 5)

    asyncio.run(main())
    assert cycle.status == 200 and orjson.loads(cycle.answer) == ["A", "B"]
