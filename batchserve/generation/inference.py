"""`/v1/inference` for a generative model on the generation engine's slot stepper (`--inference-path stepper`).

Why: on the static batch path (`backends/static_decode.py`) a batch runs to its longest answer and a new input
waits for the whole batch ahead (a third of the `/v1/completions` throughput on an H200). Here each input joins the
running continuous batch as one sequence and leaves at its end-of-sequence token.

The answer is the static path's, token for token (`smollm2.prompt_ids`, greedy, the same cut and decode).
`queue_ms` is arrival to joining the stepper, `compute_ms` joining to the last token, `batch_size` the sequences
in the step it joined (itself included).

Admission is the engine's with this request's own deadline: the predicted wait may be at most `timeout_ms` less
the (max_new_tokens + 2) steps the answer takes; longer is refused with 503 and `retry_after_ms`, and a timeout
shorter than the generation itself with 504 at once. A started sequence runs to its end
(docs/contract.md#deadlines-and-timeouts); only one still waiting when the whole deadline has passed gets 504.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from functools import partial
from collections.abc import Callable

from batchserve.config import Settings
from batchserve.core.fairqueue import Item, ItemResult
from batchserve.core.ledger import RequestLog
from batchserve.core.service import InferenceService
from batchserve.core.tiers import BATCH
from batchserve.core.work import Work
from batchserve import errors
from batchserve.errors import ApiError, ClientGone
from batchserve.decoding.build import enabled
from batchserve.decoding.engine import Engine
from batchserve.decoding.sequence import EngineSequence
from batchserve.decoding.stepper import SamplingParams
from batchserve.generation.inference_records import StepperRecords

log = logging.getLogger("batchserve.generation")

RUN_SLACK_STEPS = 2  # steps beyond max_new_tokens an answer is expected to take: the prefill and the join delay
GONE_POLL_S = 0.1  # how often the callers of running sequences are asked whether they hung up


def stepper_models(settings: Settings) -> list[str]:
    """The model ids whose `/v1/inference` the generation engine answers (the smollm2 models, the engine's own);
    the runtime builds only their backends' shells (`backends/loading.py`)."""
    if settings.inference_path != "stepper" or not enabled(settings):
        return []
    return [spec.id for spec in settings.models if spec.generates]


@dataclass
class Joined:
    """When a sequence joined the stepper, how many shared that step, and its span once traced."""

    at: float = 0.0
    rows: int = 0
    span: object = None


class StepperInference:
    """An `InferenceHandler` (core/handler.py) whose inputs run as sequences of the generation engine."""

    def __init__(
        self,
        engine: Engine,
        max_new_tokens: int,
        requests: RequestLog | None = None,
        clock: Callable[[], float] = time.monotonic,
        encode: Callable[[list[str]], list[list[int]]] | None = None,
        records: StepperRecords | None = None,
    ) -> None:
        """`encode` (default: `smollm2.prompt_ids` with the engine's tokenizer) shapes inputs into prompts;
        `records`: the metrics and spans each answer feeds (`inference_records.py`)."""
        self.engine = engine
        self.params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
        self.requests = requests
        self.clock = clock
        self.records = records if records is not None else StepperRecords()
        if encode is None:
            from batchserve.backends.smollm2 import prompt_ids

            encode = partial(prompt_ids, engine.tokenizer)
        self._encode = encode
        self._watched: dict[EngineSequence, Callable[[], bool]] = {}  # running for a caller that may hang up
        self._watcher: asyncio.Task | None = None

    # -- admission ---------------------------------------------------------------------------------------------
    def run_s(self) -> float:
        """How long an answer takes once it has joined: its new tokens at the engine's measured step time."""
        return (self.params.max_tokens + RUN_SLACK_STEPS) * self.engine.step_s

    async def prompts(self, texts: list[str]) -> list[list[int]]:
        """The inputs as the batch backend shapes them, tokenized off the event loop (on the engine's pool)."""
        for text in texts:  # a bound from characters first: a huge input is refused before any tokenizer runs
            self.engine.check_prompt_chars(len(text), self.params.max_tokens)
        return await self.engine.off_loop(self._encode, texts)

    def _submit(
        self,
        ids: list[int],
        model: str,
        tier: int,
        arrived: float,
        left_s: float,
        tenant: str = "",
        item: Item | None = None,
    ) -> tuple[EngineSequence, Joined]:
        """Admit one prompt with `left_s` of its deadline left, or raise the 503 / 504 that fits; a batch-job
        `item` is marked dispatched when it joins (and never gets the early 504: its window is long)."""
        run_s = self.run_s()
        joined = Joined()
        if item is None and run_s >= left_s:
            raise errors.deadline_exceeded(
                f"timeout_ms leaves {left_s * 1000:.0f} ms, less than the {run_s * 1000:.0f} ms an answer of up to "
                f"{self.params.max_tokens} tokens takes here: it cannot be met"
            )

        def started(seq: EngineSequence) -> None:
            joined.at, joined.rows = seq.started, len(self.engine.running)
            if item is not None:
                item.dispatched = seq.started
            self.records.joined(model, tier, joined.at - arrived, joined.rows)

        seq = self.engine.submit(
            ids,
            self.params,
            tier=tier,
            streamed=False,
            max_wait_s=max(0.0, left_s - run_s),
            start_by_s=left_s,
            keep_tokens=True,
            on_start=started,
            tenant=tenant,
        )
        return seq, joined

    async def _answer(
        self, seq: EngineSequence, joined: Joined, arrived: float, model: str, trace: object = None
    ) -> ItemResult:
        """Wait for the sequence's end and make the batch path's answer of it, recorded in `records`."""
        delta = await seq.deltas.get()
        end = max(seq.last_token, joined.at)  # its last token, as the engine saw it arrive
        tokens = len(seq.token_ids or [])
        if delta.error is not None:
            if joined.at:  # it ran: its span says how it ended
                joined.span = self.records.ended(model, joined.at, end, joined.rows, tokens, trace, str(delta.error))
            raise delta.error
        if delta.finish_reason == "cancelled":
            raise ClientGone()
        text = self.engine.tokenizer.decode(seq.token_ids or [], skip_special_tokens=True).strip()
        joined.span = self.records.ended(model, joined.at, end, joined.rows, tokens, trace)
        return ItemResult(text, max(0.0, joined.at - arrived), end - joined.at, joined.rows)

    # -- InferenceHandler ------------------------------------------------------------------------------------
    async def infer(self, work: Work, text: str) -> ItemResult:
        return (await self.infer_many(work, [text]))[0]

    async def infer_many(self, work: Work, texts: list[str]) -> list[ItemResult]:
        """Every input as a sequence of its own, admitted together (one refused: the others are withdrawn)."""
        model, tier, tenant, arrived, deadline = work.model, work.tier, work.tenant, work.arrived, work.deadline
        work.inputs = len(texts)
        trace = self.records.admitted(model, tier)
        seqs: list[tuple[EngineSequence, Joined]] = []
        try:
            prompts = await self.prompts(texts)
            # prompt tokens plus the most it decodes: the batch path's `cost_of` of the same input
            work.cost = float(sum(len(ids) + self.params.max_tokens for ids in prompts))
            for ids in prompts:
                seqs.append(self._submit(ids, model, tier, arrived, deadline - self.clock(), tenant))
        except ApiError as err:
            for seq, _ in seqs:
                self.engine.cancel(seq, "withdrawn")
            self.records.answered(model, arrived, 0.0, None, err.code)
            raise
        record = self.requests.add(work.record_owner, work.request_id, model) if self.requests is not None else None
        if work.gone is not None:  # polled by one task while anything is watched
            self._watched.update((seq, work.gone) for seq, _ in seqs)
            if self._watcher is None or self._watcher.done():
                self._watcher = asyncio.get_running_loop().create_task(self._watch_loop())
        try:
            results = list(
                await asyncio.gather(*(self._answer(seq, joined, arrived, model, trace) for seq, joined in seqs))
            )
        except (ApiError, ClientGone) as err:
            if record is not None:
                record.status, record.error = "failed", err.code
            if isinstance(err, ApiError):
                self.records.answered(model, arrived, 0.0, next((j.span for _, j in seqs if j.span), None), err.code)
            raise
        finally:
            for seq, _ in seqs:
                self._watched.pop(seq, None)
                if not seq.finished:
                    self.engine.cancel(seq, "withdrawn")
        for (_, joined), result in zip(seqs, results):  # a `queue` span per input, linked to its sequence's
            self.records.answered(model, arrived, result.queue_s, joined.span)
        if record is not None:
            last = results[-1]
            record.completed(
                (self.clock() - arrived) * 1000, last.queue_s * 1000, last.compute_s * 1000, last.batch_size
            )
        return results

    def submit_background(self, text: str, model: str, tenant: str, deadline_s: float, alone: bool = False) -> Item:
        """A batch-job input as a batch-tier sequence; `dispatched` is set when it joins the stepper, cancelling its
        future withdraws it. `alone` changes nothing: a sequence never shares a failure."""
        loop = asyncio.get_running_loop()
        now = self.clock()
        item = Item(text, model, 0, loop.create_future(), now, now + deadline_s, None, BATCH.rank, tenant)
        task = loop.create_task(self._background(item))
        item.future.add_done_callback(lambda fut: task.cancel() if fut.cancelled() else None)
        return item

    def submit_group(self, texts: list[str], model: str, tenant: str, deadline_s: float) -> list[Item]:
        return [self.submit_background(text, model, tenant, deadline_s) for text in texts]

    async def _background(self, item: Item) -> None:
        seq: EngineSequence | None = None
        try:
            ids = (await self.prompts([item.text]))[0]
            left_s = item.deadline - self.clock()
            seq, joined = self._submit(ids, item.model, item.tier, item.arrived, left_s, item.tenant, item)
            result = await self._answer(seq, joined, item.arrived, item.model)
            if not item.future.done():
                item.future.set_result(result)
        except asyncio.CancelledError:  # the scheduler took the item back
            pass
        except Exception as exc:  # noqa: BLE001 - the scheduler's callback records or retries it
            if not item.future.done():
                item.future.set_exception(exc)
        finally:
            if seq is not None and not seq.finished:
                self.engine.cancel(seq, "batch_cancelled")

    # -- callers that hang up --------------------------------------------------------------------------------
    async def _watch_loop(self) -> None:
        """Every GONE_POLL_S, cancel the sequences whose caller has left; ends when nothing is watched."""
        while self._watched:
            await asyncio.sleep(GONE_POLL_S)
            for seq, gone in list(self._watched.items()):
                if not seq.finished and gone():
                    self._watched.pop(seq, None)
                    self.engine.cancel(seq, "client_disconnect")


def serve_on_stepper(
    door: InferenceService, engine: Engine, settings: Settings, records: StepperRecords | None = None
) -> StepperInference | None:
    """Hand the stepper models' `/v1/inference` (and batch-job items) to the engine, through the door; their
    answers feed `records` (the batch path's histograms and spans)."""
    models = stepper_models(settings)
    if not models:
        return None
    handler = StepperInference(engine, settings.max_new_tokens, door.requests, records=records)
    for model in models:
        door.serve_with(model, handler)
    log.info("/v1/inference of %s on the generation engine's stepper (--inference-path stepper)", ", ".join(models))
    return handler
