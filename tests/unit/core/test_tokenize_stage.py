"""The tokenizer stage (issue 36, core/tokenize_stage.py): inputs are tokenized on its worker thread, never on
the event loop; texts that arrive while it works go together in its next call; a failing tokenizer fails no
caller; and the door (core/service.py) runs the stage before it costs an input, so costing is a look-up."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from batchserve.config import Settings
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
