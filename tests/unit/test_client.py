"""batchserve.client's retry policy as pure functions and client_cli's progress lines, in process; the clients against a
live server are tests/integration/test_client.py."""

from __future__ import annotations
from io import StringIO
import httpx
import pytest
from batchserve.client import Retry, next_wait_s, server_wait_s
from batchserve.client_cli import LineProgress, NoProgress, progress_for


# -- the policy ------------------------------------------------------------------------------------------------
def test_the_server_hint_is_honoured_with_a_little_jitter():
    policy = Retry(attempts=5, deadline_s=30, jitter=0.1)
    assert next_wait_s(policy, 1, 0.4, remaining_s=30, rand=lambda: 0.0) == 0.4
    assert next_wait_s(policy, 1, 0.4, remaining_s=30, rand=lambda: 1.0) == pytest.approx(0.44)


def test_without_a_hint_the_wait_doubles_up_to_its_cap():
    policy = Retry(attempts=10, backoff_s=0.1, max_wait_s=0.5)
    waits = [next_wait_s(policy, n, None, remaining_s=60, rand=lambda: 1.0) for n in range(1, 6)]
    assert waits == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])


def test_no_wait_past_the_deadline_or_the_last_attempt():
    policy = Retry(attempts=3, deadline_s=5)
    assert next_wait_s(policy, 1, 2.0, remaining_s=1.5, rand=lambda: 0.0) is None  # would end past the deadline
    assert next_wait_s(policy, 3, 0.1, remaining_s=5, rand=lambda: 0.0) is None  # tries used up
    assert next_wait_s(policy, 2, 0.1, remaining_s=5, rand=lambda: 0.0) == 0.1


def test_the_hint_comes_from_the_body_else_the_header():
    body = httpx.Response(
        503,
        json={"error": "SERVICE_OVERLOADED", "message": "m", "request_id": "r", "retry_after_ms": 250},
        headers={"Retry-After": "1"},
    )
    assert server_wait_s(body) == 0.25
    assert server_wait_s(httpx.Response(429, text="slow down", headers={"Retry-After": "3"})) == 3.0
    assert server_wait_s(httpx.Response(503, text="<html>bad gateway</html>")) is None


def test_progress_is_a_plain_line_without_tqdm_and_nothing_off_a_terminal():
    class Terminal(StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    line = progress_for(screen, use_tqdm=False)
    assert isinstance(line, LineProgress)
    line.update({"id": "batch_1", "status": "running", "total": 10, "completed": 3, "failed": 1, "cancelled": 0})
    line.close()
    assert screen.getvalue() == "\rbatch_1: running 4/10 (1 failed)\n"
    assert isinstance(progress_for(StringIO()), NoProgress)


# -- hostile or broken hints ------------------------------------------------------------------------------------
@pytest.mark.parametrize("hint", [0, -5, "0", float("nan"), None], ids=["zero", "negative", "string", "nan", "none"])
def test_a_zero_negative_or_garbage_hint_still_waits_a_doubling_floor(hint):
    """A hint of 0, negative, "0" or NaN spent all 8 tries in 40-90 ms: the floor (`min_wait_s`, doubled per
    try) holds whatever the server says."""
    body = {"error": "SERVICE_OVERLOADED", "message": "m", "request_id": "r"}
    if hint is not None:
        body["retry_after_ms"] = hint
    response = httpx.Response(
        503,
        content=__import__("json").dumps(body).encode(),
        headers={"Content-Type": "application/json", "Retry-After": "0"},
    )
    policy = Retry(attempts=8, deadline_s=600)
    waits = [next_wait_s(policy, n, server_wait_s(response), remaining_s=600, rand=lambda: 0.0) for n in range(1, 8)]
    assert waits == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2])


def test_a_huge_hint_gives_up_at_once_without_an_overflow():
    """retry_after_ms of 10**400 (valid JSON) raised OverflowError; now it is a wait past any deadline."""
    response = httpx.Response(
        503,
        content=b'{"error": "SERVICE_OVERLOADED", "message": "m", "retry_after_ms": 1' + b"0" * 400 + b"}",
        headers={"Content-Type": "application/json"},
    )
    assert server_wait_s(response) == float("inf")
    assert next_wait_s(Retry(), 1, server_wait_s(response), remaining_s=60) is None


def test_a_huge_error_message_is_cut_in_the_raised_error():
    from batchserve.client import MAX_MESSAGE_CHARS, Client, BatchserveError

    big = "x" * 5_000_000
    client = Client(retry=Retry(attempts=1))
    client.http = httpx.Client(
        base_url="http://test",
        transport=httpx.MockTransport(
            lambda request: httpx.Response(400, json={"error": "INVALID_REQUEST", "message": big, "request_id": "r"})
        ),
    )
    with client, pytest.raises(BatchserveError) as raised:
        client.infer("a")
    assert len(raised.value.message) < MAX_MESSAGE_CHARS + 100 and len(str(raised.value)) < MAX_MESSAGE_CHARS + 200
    assert "more characters" in raised.value.message


def test_a_zero_hint_spaces_the_client_s_retries():
    """End to end through the sync client: three retries of a 503 with retry_after_ms 0 take at least
    0.05 + 0.1 + 0.2 s."""
    from batchserve.client import Client, BatchserveError

    waits: list[float] = []
    client = Client(retry=Retry(attempts=4), on_retry=lambda attempt, wait, err: waits.append(wait))
    client.http = httpx.Client(
        base_url="http://test",
        transport=httpx.MockTransport(
            lambda request: httpx.Response(
                503, json={"error": "SERVICE_OVERLOADED", "message": "m", "retry_after_ms": 0}
            )
        ),
    )
    with client, pytest.raises(BatchserveError):
        client.infer("a")
    assert len(waits) == 3 and sum(waits) >= 0.35


def test_waiting_on_a_job_gives_up_at_its_timeout_naming_the_job_and_both_clients_read_vectors_in_input_order():
    import asyncio

    from batchserve.client import AsyncClient, Client

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/embeddings":  # out of order, as a server may send them
            return httpx.Response(
                200, json={"data": [{"index": 1, "embedding": [2.0]}, {"index": 0, "embedding": [1.0]}]}
            )
        return httpx.Response(200, json={"id": "batch_7", "status": "in_progress"})

    client = Client()
    client.http = httpx.Client(base_url="http://test", transport=httpx.MockTransport(answer))
    polls: list[str] = []
    with client, pytest.raises(TimeoutError, match="batch_7 still in_progress"):
        client.wait_job("batch_7", poll_s=0.01, timeout_s=0.05, on_progress=lambda job: polls.append(job["status"]))
    assert len(polls) >= 2
    with Client() as sync:
        sync.http = httpx.Client(base_url="http://test", transport=httpx.MockTransport(answer))
        assert sync.embed(["a", "b"], "m") == [[1.0], [2.0]]

    async def both() -> list[list[float]]:
        async with AsyncClient() as bs:
            bs.http = httpx.AsyncClient(base_url="http://test", transport=httpx.MockTransport(answer))
            with pytest.raises(TimeoutError, match="batch_7"):
                await bs.wait_job("batch_7", poll_s=0.01, timeout_s=0.05)
            return await bs.embed(["a", "b"], "m")

    assert asyncio.run(both()) == [[1.0], [2.0]]
