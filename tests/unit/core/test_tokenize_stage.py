"""The tokenizer stage (issue 36, core/tokenize_stage.py): inputs are tokenized on its worker thread, never on
the event loop; texts that arrive while it works go together in its next call; a failing tokenizer fails no
caller; and the door (core/service.py) runs the stage before it costs an input, so costing is a look-up."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from batchserve.config import Settings
from batchserve.core.fairqueue import Shares
from batchserve.core.tokenize_stage import TokenizeStage
from batchserve.core.work import Work
from batchserve.runtime import Runtime


def test_callers_arriving_while_it_works_share_the_next_call() -> None:
    calls: list[tuple[list[str], str]] = []
    release = threading.Event()

    def tokenize(texts: list[str]) -> None:
        calls.append((list(texts), threading.current_thread().name))
        if len(calls) == 1:
            release.wait(5)

    async def main() -> None:
        stage = TokenizeStage()
        first = asyncio.create_task(stage.run(tokenize, ["a"]))
        await asyncio.sleep(0.05)  # the worker holds "a"
        later = [asyncio.create_task(stage.run(tokenize, [t])) for t in ("b", "c", "d")]
        await asyncio.sleep(0.05)
        release.set()
        await asyncio.wait_for(asyncio.gather(first, *later), 5)
        assert stage.calls == 2 and stage.requests == 4
        stage.close()

    asyncio.run(main())
    assert [texts for texts, _ in calls] == [["a"], ["b", "c", "d"]]
    assert all(name.startswith("tokenize") for _, name in calls)  # never the loop's thread


def test_a_failing_tokenizer_fails_no_caller() -> None:
    def broken(texts: list[str]) -> None:
        raise RuntimeError("no tokenizer today")

    async def main() -> None:
        stage = TokenizeStage()
        await asyncio.wait_for(stage.run(broken, ["a"]), 5)
        stage.close()

    asyncio.run(main())


class Tokenized:
    """A backend with a tokenizer stage: `cost_of` on the loop must find every text tokenized already."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}
        self.threads: set[str] = set()
        self.costed: list[bool] = []  # per cost_of call: was the text tokenized before?

    def tokenize(self, texts: list[str]) -> None:
        self.threads.add(threading.current_thread().name)
        self.tokens.update({t: len(t.split()) for t in texts})

    def cost_of(self, text: str) -> float:
        self.costed.append(text in self.tokens)
        return float(self.tokens.get(text, 1))

    def bucket_of(self, text: str) -> int:
        return 0


@pytest.mark.parametrize("many", [False, True])
def test_the_door_tokenizes_on_the_stage_before_costing(many: bool) -> None:
    backend = Tokenized()

    async def main() -> None:
        rt = Runtime.create(Settings())
        rt.service.backends["sim@v1"] = backend  # type: ignore[index]
        texts = ["one two", "three four five"] if many else ["one two"]
        work = Work("req", time.monotonic(), 1, "t", model="sim@v1").due_in(5.0)
        call = rt.service.infer_many(work, texts) if many else rt.service.infer(work, texts[0])
        task = asyncio.ensure_future(call)
        for _ in range(200):
            if len(backend.costed) >= len(texts):
                break
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        rt.service.tokenizing.close()

    asyncio.run(main())
    assert backend.costed and all(backend.costed)
    assert backend.threads and all(name.startswith("tokenize") for name in backend.threads)


def test_job_inputs_are_tokenized_on_the_stage_before_the_door_costs_them() -> None:
    """Batch-job inputs (issue 36): the job scheduler hands a read's texts to `pretokenize`, which runs the
    backend's tokenizer on the stage's thread in chunks (an interactive caller's texts wait one chunk at most);
    `submit_background` then costs each by a look-up. Undone, `cost_of` found none of them tokenized."""
    from batchserve.core.service import PRETOKENIZE_CHUNK

    backend = Tokenized()
    texts = [f"job input {i}" for i in range(2 * PRETOKENIZE_CHUNK + 10)]

    async def main() -> int:
        rt = Runtime.create(Settings())
        rt.service.backends["sim@v1"] = backend  # type: ignore[index]
        await asyncio.wait_for(rt.service.pretokenize("sim@v1", texts), 10)
        items = [rt.service.submit_background(t, "sim@v1", "acme", 60.0) for t in texts[:5]]
        for item in items:
            item.future.cancel()
        calls = rt.service.tokenizing.calls
        rt.service.tokenizing.close()
        return calls

    calls = asyncio.run(main())
    assert calls == 3  # 522 texts in chunks of 256
    assert len(backend.costed) == 5 and all(backend.costed)
    assert backend.threads and all(name.startswith("tokenize") for name in backend.threads)


# -- fair order between tenants (Lanes: pure policy) -----------------------------------------------------------


def _request(tenant: str, texts: list[str], tokenize=None) -> object:
    from collections import deque

    from batchserve.core.tokenize_stage import Request

    loop = asyncio.new_event_loop()
    try:
        done = loop.create_future()
    finally:
        loop.close()
    return Request(tokenize or _noop, tenant, deque(texts), done)


def _noop(texts: list[str]) -> None:
    return None


def _taken(chunks: list) -> list[tuple[str, list[str]]]:
    return [(request.tenant, texts) for request, texts in chunks]


def test_a_tenant_of_long_inputs_waits_its_turn_behind_another_tenants_short_ones() -> None:
    """Tenant "big" queued ten requests of 16,000 characters first; "small" comes after with short ones. Each call
    takes at most `call_chars` (a long text alone), and the least charged tenant goes first: "small"'s request
    is in the very next call, not after the 160,000 characters queued before it."""
    from batchserve.core.tokenize_stage import Lanes

    lanes = Lanes(call_chars=4096)
    for i in range(10):
        lanes.add(_request("big", [f"{i}" * 16000]))
    first = _taken(lanes.take())
    assert first == [("big", ["0" * 16000])]  # a call's first text may be any length
    lanes.add(_request("small", ["hello there"]))
    lanes.add(_request("small", ["a second one"]))
    assert _taken(lanes.take()) == [("small", ["hello there"]), ("small", ["a second one"])]
    assert _taken(lanes.take()) == [("big", ["1" * 16000])]
    assert lanes.charged["big"] == 32000 and lanes.charged["small"] >= 0


def test_calls_take_by_least_charged_characters_and_split_a_request_across_calls() -> None:
    from batchserve.core.tokenize_stage import Lanes

    lanes = Lanes(call_chars=10)
    lanes.add(_request("a", ["aaaa", "aaaa", "aaaa", "aaaa"]))
    lanes.add(_request("b", ["bb", "bb", "bb"]))
    # a: 8 characters (2 texts) fill the room before a third; b joined at the same floor, so it is listed after a.
    assert _taken(lanes.take()) == [("a", ["aaaa", "aaaa"]), ("b", ["bb"])]
    # b (2) is charged less than a (8): b's texts first, then a's while there is room.
    assert _taken(lanes.take()) == [("b", ["bb", "bb"]), ("a", ["aaaa"])]
    assert _taken(lanes.take()) == [("a", ["aaaa"])]
    assert not lanes and lanes.take() == []


def test_a_tenant_that_comes_back_is_lifted_no_credit_for_idle_time() -> None:
    """Tenant "a" was served 100,000 characters alone; "b", idle all along, joins: it is lifted to within one call
    of "a" rather than starting at 0 (it would then take the next 100,000 characters' worth of calls alone)."""
    from batchserve.core.tokenize_stage import Lanes

    lanes = Lanes(call_chars=1000)
    for _ in range(100):
        lanes.add(_request("a", ["x" * 1000]))
        lanes.take()
    lanes.add(_request("a", ["x" * 1000] * 3))
    lanes.add(_request("b", ["y" * 1000] * 3))
    order = [lanes.take()[0][0].tenant for _ in range(6)]
    assert order == ["b", "a", "b", "a", "b", "a"]
    assert lanes.charged["b"] >= 99_000


def test_requests_for_another_tokenizer_wait_for_the_next_call() -> None:
    from batchserve.core.tokenize_stage import Lanes

    def other(texts: list[str]) -> None:
        return None

    lanes = Lanes(call_chars=100)
    lanes.add(_request("a", ["one"]))
    lanes.add(_request("b", ["two"], other))
    assert _taken(lanes.take()) == [("a", ["one"])]
    assert _taken(lanes.take()) == [("b", ["two"])]


def test_the_stage_returns_each_request_its_share_of_the_call_time_by_characters() -> None:
    """With an injected clock every call takes 1.0 s: two requests sharing one call get 0.8 and 0.2 by their
    characters (what the door charges to each tenant's counter in the fair queue)."""
    ticks = iter(range(100))
    release = threading.Event()
    calls: list[list[str]] = []

    def tokenize(texts: list[str]) -> None:
        calls.append(texts)
        if len(calls) == 1:
            release.wait(5)

    async def main() -> list[float]:
        stage = TokenizeStage(call_chars=1000, clock=lambda: float(next(ticks)))
        first = asyncio.create_task(stage.run(tokenize, ["warm"], "c"))
        await asyncio.sleep(0.05)
        a = asyncio.create_task(stage.run(tokenize, ["x" * 80], "a"))
        b = asyncio.create_task(stage.run(tokenize, ["y" * 20], "b"))
        await asyncio.sleep(0.05)
        release.set()
        got = await asyncio.wait_for(asyncio.gather(first, a, b), 5)
        stage.close()
        return list(got)

    seconds = asyncio.run(main())
    assert calls == [["warm"], ["x" * 80, "y" * 20]]
    assert seconds == pytest.approx([1.0, 0.8, 0.2])


def test_a_refused_tenants_tokenizing_is_charged_to_its_fair_queue_counter() -> None:
    """The door charges the stage's time to the tenant's counter in the model's fair queue before admission
    decides, so a tenant whose requests are all refused still falls behind in the queue's order."""
    from batchserve import errors

    class Refusing(Tokenized):
        def cost_of(self, text: str) -> float:
            raise errors.payload_too_large("too long")

    backend = Refusing()

    async def main() -> float:
        rt = Runtime.create(Settings())
        rt.service.backends["sim@v1"] = backend  # type: ignore[index]
        rt.batcher.shares.setdefault("sim@v1", Shares())
        with pytest.raises(errors.ApiError):
            await rt.service.infer(Work("r1", time.monotonic(), 1, "greedy", model="sim@v1").due_in(5.0), "w " * 5000)
        rt.service.tokenizing.close()
        return rt.batcher.shares["sim@v1"].counter.get((1, "greedy"), 0.0)

    assert asyncio.run(main()) > 0
