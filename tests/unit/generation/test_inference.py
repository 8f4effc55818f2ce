"""`/v1/inference` on the generation engine's stepper (`generation/inference.py`), in process with an injected
clock and a fake stepper (no model, no server): admission by KV capacity (slots) and by the request's own
deadline, the response's timings and `batch_size`, batch-job items, and the door handing the model over."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from batchserve.config import Settings
from batchserve.core.work import Work
from batchserve.errors import ApiError, ClientGone
from batchserve.decoding.build import EngineConfig
from batchserve.decoding.engine import Engine
from batchserve.decoding.stepper import SamplingParams
from batchserve.generation.inference import StepperInference, stepper_models
from tests.unit.decoding.test_engine import FakeStepper
from tests.unit.decoding.test_units import CHARS, char_tokenizer
from tests.unit.fakes import Clock

EOS = CHARS.index("!")
MAX_NEW = 4  # an answer takes (4 + 2) steps once it joins


def work(model: str, arrived: float, timeout_s: float, tier: int = 1, gone: Any = None) -> Work:
    """A request of tenant "t" for `model`, due `timeout_s` after `arrived`."""
    return Work("req", arrived, tier, "t", model=model, gone=gone).due_in(timeout_s)


def make(clock: Clock, max_seqs: int = 2, step_s: float = 0.1) -> tuple[Engine, StepperInference]:
    cfg = EngineConfig(max_tokens=64, max_seqs=max_seqs, page_size=512, queue_timeout_s=1000)
    char = char_tokenizer()
    tokenizer = SimpleNamespace(
        backend_tokenizer=char, eos_token_id=EOS, decode=lambda ids, skip_special_tokens: char.decode(ids)
    )
    stepper = FakeStepper(blocks=max_seqs, max_seqs=max_seqs, page_size=512)
    stepper.step_s = step_s
    engine = Engine(cfg, tokenizer, stepper, CollectorRegistry(), max_position=4096, vocab_size=len(CHARS))
    stepper.start(None, engine._on_updates)
    encode = lambda texts: [[CHARS.index(c) for c in t] for t in texts]  # noqa: E731
    return engine, StepperInference(engine, MAX_NEW, clock=clock, encode=encode)


async def until(check: Any) -> None:
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("never happened")


def ask(h: StepperInference, clock: Clock, text: str, timeout_s: float = 10.0, tier: int = 1) -> asyncio.Task:
    return asyncio.ensure_future(h.infer(work("smollm2@v1", clock(), timeout_s, tier=tier), text))


def test_more_inputs_than_slots_wait_for_one_and_report_their_step(clock: Clock) -> None:
    async def main() -> None:
        engine, h = make(clock, max_seqs=2)
        a = ask(h, clock, "aa")
        await until(lambda: len(engine.running) == 1)
        b, c = ask(h, clock, "bb"), ask(h, clock, "cc")
        await until(lambda: len(engine.waiting) == 1)
        first, second = engine.stepper.added
        assert len(engine.running) == 2  # KV capacity (two slots) is the limit: the third waits
        clock.now += 0.3
        engine.stepper.emit(first, "hi!", finished=True)  # a's end frees its slot: c joins at once
        assert len(engine.running) == 2 and len(engine.stepper.added) == 3
        clock.now += 0.5
        engine.stepper.emit(second, "yo!", finished=True)
        engine.stepper.emit(engine.stepper.added[2], "abcd", finished=True)  # max_new_tokens reached
        ra, rb, rc = await asyncio.wait_for(asyncio.gather(a, b, c), 2)
        assert (ra.output, rb.output, rc.output) == ("hi!", "yo!", "abcd")
        assert (ra.batch_size, rb.batch_size, rc.batch_size) == (1, 2, 2)  # the rows of the step each joined
        assert ra.queue_s == rb.queue_s == 0 and rc.queue_s == pytest.approx(0.3)
        assert ra.compute_s == pytest.approx(0.3) and rc.compute_s == pytest.approx(0.5)

    asyncio.run(main())


def test_a_predicted_wait_past_the_deadline_is_refused_at_the_door_with_retry_after(clock: Clock) -> None:
    async def main() -> None:
        engine, h = make(clock, max_seqs=1, step_s=0.1)
        engine.submit([1], SamplingParams(max_tokens=100, temperature=0))  # holds the one slot ~10 s
        with pytest.raises(ApiError) as err:
            await asyncio.wait_for(ask(h, clock, "ab", timeout_s=5.0), 2)  # needs 0.6 s once started: may wait 4.4 s
        assert err.value.status == 503 and err.value.code == "SERVICE_OVERLOADED"
        assert err.value.retry_after_ms == pytest.approx(10_000 - 4_400, abs=1)
        assert not engine.waiting
        waits = ask(h, clock, "ab", timeout_s=20.0)  # 10 s of wait + 0.6 s fits 20 s: admitted, queued
        await until(lambda: len(engine.waiting) == 1)
        waits.cancel()

    asyncio.run(main())


def test_a_timeout_shorter_than_the_answer_itself_is_504_at_the_door(clock: Clock) -> None:
    async def main() -> None:
        engine, h = make(clock, step_s=0.1)
        with pytest.raises(ApiError) as err:
            await asyncio.wait_for(ask(h, clock, "ab", timeout_s=0.5), 2)  # (4 + 2) steps of 0.1 s cannot fit 0.5 s
        assert err.value.status == 504 and err.value.retry_after_ms is None
        assert engine.stepper.added == []

    asyncio.run(main())


def test_once_started_an_answer_is_given_even_past_the_deadline(clock: Clock) -> None:
    async def main() -> None:
        engine, h = make(clock, step_s=0.1)
        task = ask(h, clock, "ab", timeout_s=1.0)
        await until(lambda: engine.running)
        clock.now += 5.0  # the steps ran slower than predicted: still answered, never cut off with 504
        engine.stepper.emit(engine.stepper.added[0], "ok!", finished=True)
        result = await asyncio.wait_for(task, 2)
        assert result.output == "ok!" and result.compute_s == pytest.approx(5.0)

    asyncio.run(main())


def test_still_waiting_when_the_whole_deadline_passes_is_504(clock: Clock) -> None:
    async def main() -> None:
        engine, h = make(clock, max_seqs=1, step_s=0.01)
        engine.submit([1], SamplingParams(max_tokens=100, temperature=0))  # ~1 s of the slot
        engine._tick_task = asyncio.create_task(engine._tick())
        task = ask(h, clock, "ab", timeout_s=3.0)  # predicted to start within ~1 s: admitted
        await until(lambda: engine.waiting)
        clock.now += 3.1  # the slot never freed (the prediction was wrong): past the whole deadline
        with pytest.raises(ApiError) as err:
            await asyncio.wait_for(task, 2)
        assert err.value.status == 504 and not engine.waiting
        engine._tick_task.cancel()

    asyncio.run(main())


def test_a_caller_that_hangs_up_frees_its_slot(clock: Clock) -> None:
    async def main() -> None:
        engine, h = make(clock, max_seqs=1)
        gone = [False]
        task = asyncio.ensure_future(h.infer(work("m", clock(), 10.0, gone=lambda: gone[0]), "ab"))
        await until(lambda: engine.running)
        gone[0] = True
        with pytest.raises(ClientGone):
            await asyncio.wait_for(task, 2)
        assert engine.stepper.cancelled == engine.stepper.added and not engine.running

    asyncio.run(main())


def test_batch_job_items_wait_behind_interactive_ones_and_can_be_taken_back(clock: Clock) -> None:
    async def main() -> None:
        engine, h = make(clock, max_seqs=1)
        running = ask(h, clock, "ab")
        await until(lambda: engine.running)
        job = h.submit_background("cd", "m", "t", 600.0)
        await until(lambda: engine.waiting)
        late = ask(h, clock, "ef", tier=2)  # an interactive (free tier) arrival goes ahead of the job's item
        await until(lambda: len(engine.waiting) == 2)
        assert not job.dispatched
        engine.stepper.emit(engine.stepper.added[0], "x!", finished=True)
        await running
        assert not job.dispatched  # the interactive one joined first
        engine.stepper.emit(engine.stepper.added[1], "y!", finished=True)
        await late
        assert job.dispatched  # now the job's item runs
        engine.stepper.emit(engine.stepper.added[2], "z!", finished=True)
        result = await job.future
        assert result.output == "z!" and result.batch_size == 1
        taken_back = h.submit_background("gh", "m", "t", 600.0)  # the slot is free: it joins at once
        other = h.submit_background("ij", "m", "t", 600.0)
        await until(lambda: taken_back.dispatched and len(engine.waiting) == 1)
        taken_back.future.cancel()  # the scheduler takes an item back: its sequence leaves, the next joins
        await until(lambda: engine.stepper.cancelled == [engine.stepper.added[3]])
        await until(lambda: other.dispatched)
        other.future.cancel()
        await until(lambda: not engine.running and not engine.waiting)

    asyncio.run(main())


def test_the_door_hands_a_stepper_model_over_and_refuses_while_draining() -> None:
    from batchserve.runtime import Runtime

    class Recorder:
        def __init__(self) -> None:
            self.calls: list[tuple[str, ...]] = []

        async def infer_many(self, work: Work, texts: list[str]) -> list[Any]:
            self.calls.append(("infer", work.model, *texts))
            return [SimpleNamespace(output=t) for t in texts]

        def submit_background(self, text: str, model: str, tenant: str, deadline_s: float, alone: bool) -> Any:
            self.calls.append(("background", model, text))
            return "item"

        def submit_group(self, texts: list[str], model: str, tenant: str, deadline_s: float) -> list[Any]:
            self.calls.append(("group", model, *texts))
            return ["item"] * len(texts)

    async def main() -> None:
        rt = Runtime.create(Settings(backend="smollm2"))
        handler = Recorder()
        rt.service.serve_with("smollm2@v1", handler)  # type: ignore[arg-type]
        result = await rt.service.infer(work("smollm2@v1", 0.0, 5.0), "hi")
        assert result.output == "hi" and rt.service.inflight == 0
        assert rt.service.submit_background("a", "smollm2@v1", "t", 60.0) == "item"
        assert rt.service.submit_group(["b", "c"], "smollm2@v1", "t", 60.0) == ["item", "item"]
        assert handler.calls == [
            ("infer", "smollm2@v1", "hi"),
            ("background", "smollm2@v1", "a"),
            ("group", "smollm2@v1", "b", "c"),
        ]
        rt.batcher.start_drain()
        with pytest.raises(ApiError) as err:
            await rt.service.infer(work("smollm2@v1", 0.0, 5.0), "hi")
        assert err.value.code == "DRAINING" and len(handler.calls) == 3

    asyncio.run(main())


def test_the_stepper_path_is_the_default_for_smollm2_and_static_stays_selectable() -> None:
    assert stepper_models(Settings(backend="smollm2")) == ["smollm2@v1"]
    assert stepper_models(Settings(backend="smollm2", inference_path="static")) == []
    assert stepper_models(Settings(backend="sim")) == []
