"""What `/v1/inference` answered on the stepper books (`generation/inference_records.py`), in process with an injected
clock and a fake stepper: the batch path's histograms (queue wait for interactive inputs only, the rows each
sequence joined, joining to last token) and its spans (the request's, a `queue` span linked to one span per
sequence with the stepper's attributes), and a refusal's outcome."""

from __future__ import annotations

import asyncio
import pytest

from batchserve.core.batch import BatchRun
from batchserve.errors import ApiError
from batchserve.generation.inference_records import StepperRecords
from batchserve.metrics import make_metrics
from tests.unit.fakes import Clock
from tests.unit.generation.test_inference import ask, make, until

MODEL = "smollm2@v1"


class Tracer:
    """Keeps what the records asked of tracing."""

    def __init__(self) -> None:
        self.batches: list[dict] = []
        self.answers: list[tuple[float, object, str]] = []

    def admitted(self, model: str, tier: str) -> object:
        return f"request-{tier}"

    def answered(self, model: str, arrived: float, queue_s: float, batch: object, outcome: str) -> None:
        self.answers.append((queue_s, batch, outcome))

    def batch(self, run: BatchRun) -> object:
        self.batches.append(
            {
                "size": run.size,
                "worker": run.worker,
                "cause": run.cause,
                "s": run.ended - run.started,
                "requests": list(run.requests),
                "failed": run.failed,
                **(run.attributes or {}),
            }
        )
        return f"span-{run.ended - run.started:.1f}"  # named by its sequence's compute time: unique in a test


def test_answers_feed_the_histograms_and_spans_a_batch_would(clock: Clock) -> None:
    metrics, tracer = make_metrics(), Tracer()

    async def main() -> None:
        engine, h = make(clock, max_seqs=2)
        h.records = StepperRecords(metrics, tracer)
        a = ask(h, clock, "aa")
        await until(lambda: len(engine.running) == 1)
        b, c = ask(h, clock, "bb"), ask(h, clock, "cc")
        await until(lambda: len(engine.waiting) == 1)
        first, second = engine.stepper.added
        clock.now += 0.3
        engine.stepper.emit(first, "hi!", finished=True)  # c joins a's slot after 0.3 s in the queue
        clock.now += 0.5
        engine.stepper.emit(second, "yo!", finished=True)
        engine.stepper.emit(engine.stepper.added[2], "abcd", finished=True)
        await asyncio.wait_for(asyncio.gather(a, b, c), 2)
        job = h.submit_background("dd", MODEL, "t", 100.0)  # a batch-job item: rows and compute, no queue wait
        await until(lambda: len(engine.stepper.added) == 4)
        clock.now += 0.2
        engine.stepper.emit(engine.stepper.added[3], "ok!", finished=True)
        await asyncio.wait_for(job.future, 2)

    asyncio.run(main())
    queue = metrics.queue_wait.labels(MODEL)
    assert sum(queue.counts) == 3 and queue.sum == pytest.approx(0.3)
    rows = metrics.batch_size.labels(MODEL)
    assert sum(rows.counts) == 4 and rows.sum == 1 + 2 + 2 + 1
    compute = metrics.batch_compute.labels(MODEL)
    assert sum(compute.counts) == 4 and compute.sum == pytest.approx(0.3 + 0.8 + 0.5 + 0.2)
    # A span is made as its sequence's answer is read, in whatever order the loop reads them: each is found by
    # its compute time (a 0.3 s, b 0.8 s, c 0.5 s, the job item 0.2 s).
    spans = {f"{s['s']:.1f}": s for s in tracer.batches}
    assert {
        t: (s["size"], s["worker"], s["cause"], s["batchserve.path"], s["batchserve.stepper.rows"])
        for t, s in spans.items()
    } == {
        "0.3": (1, "stepper", "joined", "stepper", 1),
        "0.8": (2, "stepper", "joined", "stepper", 2),
        "0.5": (2, "stepper", "joined", "stepper", 2),
        "0.2": (1, "stepper", "joined", "stepper", 1),
    }
    assert {t: s["gen_ai.usage.output_tokens"] for t, s in spans.items()} == {"0.3": 3, "0.8": 3, "0.5": 4, "0.2": 3}
    assert {t: s["requests"] for t, s in spans.items()} == {
        "0.3": ["request-paid"],  # linked to their requests
        "0.8": ["request-paid"],
        "0.5": ["request-paid"],
        "0.2": [None],  # a job item has no request span
    }
    # Each answered input's queue span links to its own sequence's span: a and b waited 0, c 0.3 s.
    assert sorted((round(q, 6), span, outcome) for q, span, outcome in tracer.answers) == [
        (0.0, "span-0.3", "ok"),
        (0.0, "span-0.8", "ok"),
        (0.3, "span-0.5", "ok"),
    ]


def test_a_refusal_sets_the_outcome_and_observes_nothing(clock: Clock) -> None:
    metrics, tracer = make_metrics(), Tracer()

    async def main() -> None:
        engine, h = make(clock, max_seqs=1)
        h.records = StepperRecords(metrics, tracer)
        with pytest.raises(ApiError):
            await asyncio.wait_for(ask(h, clock, "ab", timeout_s=0.1), 2)  # shorter than the answer itself

    asyncio.run(main())
    assert tracer.answers == [(0.0, None, "DEADLINE_EXCEEDED")] and tracer.batches == []
    assert sum(metrics.queue_wait.labels(MODEL).counts) == sum(metrics.batch_size.labels(MODEL).counts) == 0
