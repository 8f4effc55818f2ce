"""The inference service: the one door to the batcher (in the spirit of TEI's `Infer`).

Every piece of work that rides a batch enters here: `infer` for a waiting caller, `submit_background` for batch-job
items that fill the places interactive work leaves, and `check_open` for the generation routes, whose admission is
the KV cache but which must refuse in the same words while the server drains or has no worker. The service owns
admission state, builds each `Item`, arms its deadline and counts what is in flight; nothing else calls
`Batcher.submit`. A model registered with `serve_with` is handed to its own `InferenceHandler`: same door.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable
from collections.abc import Callable, Mapping, Sequence

from batchserve import errors
from batchserve.errors import ApiError, ClientGone
from batchserve.core.batcher import Batcher
from batchserve.core.admission import Admission, Ticket, WorkerCapacity
from batchserve.core.work import DeadlineWatch, Work
from batchserve.core.fairqueue import Item, ItemResult
from batchserve.core.handler import InferenceHandler
from batchserve.core.quarantine import Quarantine
from batchserve.core.ledger import Record, RequestLog, CostAccount
from batchserve.core.tiers import BATCH, NAMES as TIER_NAMES
from batchserve.core.tokenize_stage import Pretokenizer, Tokenize, TokenizeStage


log = logging.getLogger("batchserve")

PRETOKENIZE_CHUNK = 256  # job inputs per tokenizer-stage call (`pretokenize`): interactive texts wait one chunk at most


class Bucketer(Protocol):
    """What the door needs of a backend: which inputs may share a batch, and what each costs to run."""

    def bucket_of(self, text: str) -> int: ...
    def cost_of(self, text: str) -> float: ...


@runtime_checkable
class BatchCoster(Protocol):
    """A backend whose batch cost is its own formula (the sum of tokens, quadratic attention, ...) rather than
    rows x the longest row: `cost_of_batch(texts)`. Its inputs are costed alone by it too."""

    def cost_of_batch(self, texts: list[str]) -> float: ...


def batch_cost_of(backend: object) -> Callable[[list[str]], float] | None:
    """The backend's `cost_of_batch`, or None when it declares none (the padded formula applies)."""
    return backend.cost_of_batch if isinstance(backend, BatchCoster) else None


@runtime_checkable
class TokenCounter(Protocol):
    """A backend that counts its inputs' tokens (from their kept encodings) for an answer's usage."""

    def count_tokens(self, texts: list[str]) -> list[int] | None: ...


def tokens_in(backend: object, texts: list[str]) -> int:
    """The texts' tokens by the backend, for an answer's usage: 0 when it cannot count them or fails to (usage is
    not worth failing an answer over)."""
    if not isinstance(backend, TokenCounter):
        return 0
    try:
        return sum(backend.count_tokens(texts) or ())
    except Exception:
        log.warning("count_tokens failed", exc_info=True)
        return 0


class ItemTracer(Protocol):
    """What the door asks of tracing (`batchserve.tracing.Tracing`, present only when it is on)."""

    def admitted(self, model: str, tier: str) -> object: ...

    def answered(self, model: str, arrived: float, queue_s: float, batch: object, outcome: str) -> None: ...


@dataclass(frozen=True, slots=True)
class JobRoom:
    """What the job scheduler reads of one model's queue and batches to price job inputs by cost and feed them
    from spare capacity only (`jobs/refill.py`)."""

    depth: int  # inputs queued for the model now, every tier
    max_queue: int  # --max-queue: past it the door refuses interactive callers with 503
    rows: int  # the most inputs in one batch of the model
    budget: float  # the most one batch may cost (math.inf: no cost budget)
    unit: float  # the mean cost of an input, as the batcher learns it
    healthy: int  # healthy workers


class InferenceService:
    def __init__(
        self,
        batcher: Batcher,
        admission: Admission,
        backends: Mapping[str, Bucketer],
        requests: RequestLog,
        clock: Callable[[], float] = time.monotonic,
        quarantine: Quarantine | None = None,
    ) -> None:
        self.batcher = batcher
        self.admission = admission
        self.requests = requests  # recent requests' status, for GET /v1/requests/{id}
        self.backends = backends  # model id -> backend; filled as the runtime loads them
        self.clock = clock
        self.deadlines = DeadlineWatch(clock)
        # Inputs that failed alone lately (the worker pool fills it): answered 500 here, never queued again.
        self.quarantine = quarantine if quarantine is not None else Quarantine(clock=clock)
        self.inflight = 0  # callers admitted and not yet answered (inference and generation)
        self.tracing: ItemTracer | None = None  # set when OpenTelemetry is on: spans per request and queue wait
        # Per model: the backend's cost_of_batch or None, looked up once (the protocol check is not free).
        self._batch_costs: dict[str, Callable[[list[str]], float] | None] = {}
        # Models another handler answers instead of the batcher (`serve_with`): the door hands their work over.
        self.handlers: dict[str, InferenceHandler] = {}
        # Per model: the backend's `tokenize` (run on the tokenizer stage before costing) or None, looked up once.
        self.tokenizing = TokenizeStage()
        self._tokenizers: dict[str, Tokenize | None] = {}

    # -- state the routes and the job scheduler read --------------------------------------------------------
    @property
    def draining(self) -> bool:
        return self.batcher.draining

    @property
    def max_batch_size(self) -> int:
        return self.batcher.max_batch_size

    @property
    def cost_account(self) -> CostAccount:
        """Cost answered per (model, tier, tenant) (core/ledger.py): the ledger's and schedulers' source."""
        return self.batcher.account

    def attach(self, capacity: WorkerCapacity) -> None:
        """The workers have started: admission can see them from now on."""
        self.admission.capacity = capacity

    def healthy_workers(self) -> int:
        capacity = self.admission.capacity
        return capacity.healthy_count() if capacity is not None else 0

    def models(self) -> list[str]:
        return list(self.backends)

    def job_room(self, model: str) -> JobRoom | None:
        """The model's queue and batches as the job scheduler prices job inputs (None for a model whose inputs
        another handler answers: it admits its own work)."""
        if model in self.handlers or model not in self.backends:
            return None
        b = self.batcher
        return JobRoom(
            b.depth.get(model, 0),
            self.admission.max_queue,
            b.costs.limit(model),
            b.costs.budget(model),
            b.costs.unit.get(model, 1.0),
            self.healthy_workers(),
        )

    def check_open(self, needs_workers: bool = True) -> None:
        """503 DRAINING (or, for work on the batch workers, NO_HEALTHY_WORKER) when nothing can be admitted now."""
        if needs_workers:
            self.admission.check_open()
        elif self.batcher.draining:
            raise errors.draining()

    def hold(self) -> None:
        """A caller served outside the batcher (a generation request) is in flight: the drain waits for it."""
        self.inflight += 1

    def release(self) -> None:
        self.inflight -= 1

    def serve_with(self, model: str, handler: InferenceHandler) -> None:
        """From now on `model`'s inputs (requests and batch-job items) are answered by `handler`."""
        self.handlers[model] = handler

    def _batch_cost(self, model: str, backend: object) -> Callable[[list[str]], float] | None:
        """The model's batch-level cost function (None: rows x the longest row), found once per model."""
        if model not in self._batch_costs:
            self._batch_costs[model] = batch_cost_of(backend)
        return self._batch_costs[model]

    def _tokenizer(self, model: str, backend: object) -> Tokenize | None:
        if model not in self._tokenizers:
            self._tokenizers[model] = backend.tokenize if isinstance(backend, Pretokenizer) else None
        return self._tokenizers[model]

    async def _tokenize(self, tokenize: Tokenize, texts: list[str], model: str, tier: int, tenant: str) -> None:
        """The inputs' tokens made on the tokenizer stage; the time they took is charged to the tenant in the model's
        fair queue, in cost units (a full batch's cost per second of its time), admitted or not."""
        seconds = await self.tokenizing.run(tokenize, texts, tenant)
        shares = self.batcher.shares.get(model)
        if seconds > 0 and shares is not None:
            costs = self.batcher.costs
            full = costs.estimate_cost(model, costs.full_n(model))
            shares.charge_work(tier, tenant, seconds * full / max(1e-6, self.batcher.batch_s.at(model, full)))

    def _check_quarantine(self, model: str, text: str) -> None:
        why = self.quarantine.reason(model, text) if self.quarantine.entries else None  # none quarantined: no call
        if why is not None:
            raise self._quarantined(why)

    def _quarantined(self, why: str) -> ApiError:
        return errors.inference_failed(
            f"{why} (this input failed alone lately and is quarantined for up to "
            f"{self.quarantine.ttl_s:.0f} s: not run again)"
        )

    def _admit(self, work: Work, costs: Sequence[float], bucket: int) -> Ticket:
        """The door for `infer` and `infer_many` alike: books the request's cost on `work`, raises the 503 / 413 that
        fits, or returns its ticket (`bucket`: its first input's length class)."""
        work.cost = sum(costs) if len(costs) > 1 else costs[0]
        return self.admission.admit_ticket(
            work.model, work.tier, work.tenant, work.deadline - self.clock(), costs, bucket, work.timeout_s
        )

    def _answered(self, record: Record, work: Work, ticket: Ticket, first: ItemResult, last: ItemResult) -> None:
        """A request has all its answers (its first and last input's), for `infer` and `infer_many` alike: the door
        learns its own error from when its first batch started."""
        arrived = work.arrived
        if ticket.wait_s is not None:  # what `Admission.observed` learns from; None for most requests
            self.admission.observed(work.model, ticket, arrived + first.queue_s)
        record.completed((self.clock() - arrived) * 1000, last.queue_s * 1000, last.compute_s * 1000, last.batch_size)

    # -- the door -----------------------------------------------------------------------------------------
    async def infer(self, work: Work, text: str) -> ItemResult:
        """Admit one input, queue it, and wait for its answer; raises the ApiError that fits (503 at the door,
        504 at the deadline, 500 when it failed alone), or ClientGone when `work.gone` says the caller left.
        An admitted request is recorded under (`work.record_owner`, `work.request_id`).

        `infer_many` for one input, written out: its lists and gather cost ~3 µs a request on this hot path
        (bench/hotpath.py). Both pass the same door (`_admit`) and book the same answer (`_answered`): what
        admission decides or learns per request goes there, never into one path only."""
        model = work.model
        if self.tracing is not None or model in self.handlers:  # spans, or a model answered elsewhere
            return (await self.infer_many(work, [text]))[0]
        backend = self.backends.get(model)
        if backend is None:  # still loading behind the open port (/readyz 503 "warming up")
            raise errors.warming_up()
        why = self.quarantine.reason(model, text) if self.quarantine.entries else None  # `_check_quarantine`, inline
        if why is not None:
            raise self._quarantined(why)
        tokenize = self._tokenizers[model] if model in self._tokenizers else self._tokenizer(model, backend)
        if tokenize is not None:  # its tokens made on the stage's thread: costing below is a look-up
            await self._tokenize(tokenize, [text], model, work.tier, work.tenant)
        batch_cost = self._batch_costs[model] if model in self._batch_costs else self._batch_cost(model, backend)
        cost = float(backend.cost_of(text)) if batch_cost is None else float(batch_cost([text]))
        bucket = backend.bucket_of(text)
        ticket = self._admit(work, (cost,), bucket)
        record = self.requests.add(work.record_owner, work.request_id, model)
        future = asyncio.get_running_loop().create_future()
        item = Item.of(work, text, bucket, future, record, cost, ticket.probe, batch_cost)
        self.batcher.costs.note_cost(model, cost)
        self.batcher.submit(item)
        self.deadlines.watch(work.timeout_s, work.deadline, future)
        self.inflight += 1
        try:
            result: ItemResult = await future
        except (ApiError, ClientGone) as err:
            record.status, record.error = "failed", err.code
            raise
        finally:
            self.inflight -= 1
            if not future.done():
                future.cancel()
        self._answered(record, work, ticket, result, result)
        return result

    async def infer_counted(self, work: Work, texts: list[str]) -> tuple[list[ItemResult], int]:
        """`infer_many`, and the inputs' tokens for the answer's usage (`tokens_in`, from the kept encodings)."""
        results = await self.infer_many(work, texts)
        return results, tokens_in(self.backends.get(work.model), texts)

    async def infer_many(self, work: Work, texts: list[str]) -> list[ItemResult]:
        """`infer` for a request of several inputs: one admission decision for all, then each input as its own item,
        so they share batches with other callers' inputs. The first failure fails the request and withdraws the
        others (a cancelled item never takes a place in a batch)."""
        model = work.model
        work.inputs = len(texts)
        handler = self.handlers.get(model)
        if handler is not None:
            return await self._elsewhere(handler, work, texts)
        tracing = self.tracing
        trace = tracing.admitted(model, TIER_NAMES[work.tier]) if tracing is not None else None
        try:
            costs, buckets, batch_cost, ticket = await self._priced(work, texts)
        except ApiError as err:
            if tracing is not None:
                tracing.answered(model, work.arrived, 0.0, None, err.code)
            raise
        record = self.requests.add(work.record_owner, work.request_id, model)
        loop = asyncio.get_running_loop()
        items = []
        for text, cost, bucket in zip(texts, costs, buckets):
            item = Item.of(work, text, bucket, loop.create_future(), record, cost, ticket.probe, batch_cost, trace)
            self.batcher.costs.note_cost(model, cost)
            self.batcher.submit(item)
            self.deadlines.watch(work.timeout_s, item.deadline, item.future)
            items.append(item)
        self.inflight += 1
        try:
            if len(items) == 1:
                results: list[ItemResult] = [await items[0].future]
            else:
                results = list(await asyncio.gather(*(item.future for item in items)))
        except (ApiError, ClientGone) as err:
            record.status, record.error = "failed", err.code
            if tracing is not None and isinstance(err, ApiError):
                tracing.answered(
                    model, work.arrived, 0.0, next((i.batch_trace for i in items if i.batch_trace), None), err.code
                )
            raise
        finally:
            self.inflight -= 1
            for item in items:
                if not item.future.done():
                    item.future.cancel()
        self._answered(record, work, ticket, results[0], results[-1])
        if tracing is not None:  # a queue-wait span per input, each linked to the batch that carried it
            for item, result in zip(items, results):
                tracing.answered(model, work.arrived, result.queue_s, item.batch_trace, "ok")
        return results

    async def _priced(
        self, work: Work, texts: list[str]
    ) -> tuple[list[float], list[int], Callable[[list[str]], float] | None, Ticket]:
        """`infer_many`'s inputs checked (the model loaded, none quarantined), tokenized on the stage, priced
        (each input's cost and length class, and the backend's own batch cost if it declares one) and admitted."""
        model = work.model
        backend = self.backends.get(model)
        if backend is None:  # still loading behind the open port (/readyz 503 "warming up")
            raise errors.warming_up()
        for text in texts:
            self._check_quarantine(model, text)
        tokenize = self._tokenizer(model, backend)
        if tokenize is not None:  # its tokens made on the stage's thread: costing below is a look-up
            await self._tokenize(tokenize, texts, model, work.tier, work.tenant)
        batch_cost = self._batch_cost(model, backend)
        costs = (
            [float(backend.cost_of(text)) for text in texts]
            if batch_cost is None
            else [float(batch_cost([text])) for text in texts]
        )
        buckets = [backend.bucket_of(text) for text in texts]
        return costs, buckets, batch_cost, self._admit(work, costs, buckets[0])

    async def _elsewhere(self, handler: InferenceHandler, work: Work, texts: list[str]) -> list[ItemResult]:
        """A request for a model another handler answers: refused while draining, counted in flight (the
        drain waits for it), then the handler's own admission and answer."""
        if self.batcher.draining:
            raise errors.draining()
        self.inflight += 1
        try:
            return await handler.infer_many(work, texts)
        finally:
            self.inflight -= 1

    async def pretokenize(self, model: str, texts: list[str], tenant: str = "") -> None:
        """Batch-job inputs, read ahead of their feeding: their tokens made on the tokenizer stage's thread, so
        `submit_background` costs them by a look-up and the event loop tokenizes none. In chunks, so interactive
        texts queued meanwhile go next rather than after the whole read. A no-op without a backend `tokenize`."""
        backend = self.backends.get(model)
        if backend is None or model in self.handlers:
            return
        tokenize = self._tokenizer(model, backend)
        if tokenize is None:
            return
        for start in range(0, len(texts), PRETOKENIZE_CHUNK):  # in the job's tenant's lane
            await self._tokenize(tokenize, texts[start : start + PRETOKENIZE_CHUNK], model, BATCH.rank, tenant)

    def submit_background(self, text: str, model: str, tenant: str, deadline_s: float, alone: bool = False) -> Item:
        """Queue a batch-job item at the lowest tier, past the latency admission (it only takes places interactive
        work leaves; the job scheduler bounds how many wait). Its future carries an `ItemResult` or the error, its
        `dispatched` says whether a batch took it. `alone`: in a batch of its own (after a hang)."""
        handler = self.handlers.get(model)
        if handler is not None:
            return handler.submit_background(text, model, tenant, deadline_s, alone)
        if alone:
            return self.submit_group([text], model, tenant, deadline_s)[0]
        item = self._background_item(text, model, tenant, deadline_s)
        if not item.future.done():
            self.batcher.submit(item)
        return item

    def submit_group(self, texts: list[str], model: str, tenant: str, deadline_s: float) -> list[Item]:
        """Batch-job items of one job, run as one batch of their own in the background share: the job's inputs
        fail often, and in a shared batch each failure costs the batch-mates re-runs."""
        handler = self.handlers.get(model)
        if handler is not None:
            return handler.submit_group(texts, model, tenant, deadline_s)
        items = [self._background_item(text, model, tenant, deadline_s) for text in texts]
        queued = [item for item in items if not item.future.done()]
        if queued:
            self.batcher.submit_group(queued)
        return items

    def _background_item(self, text: str, model: str, tenant: str, deadline_s: float) -> Item:
        now = self.clock()
        backend = self.backends[model]
        batch_cost = self._batch_cost(model, backend)
        refused: ApiError | None = None
        try:
            cost = float(backend.cost_of(text)) if batch_cost is None else float(batch_cost([text]))
            bucket = backend.bucket_of(text)
        except ApiError as err:  # an input the backend refuses to cost (one too long to cut safely): answered below
            cost, bucket, refused = 1.0, 0, err
        item = Item(
            text,
            model,
            bucket,
            asyncio.get_running_loop().create_future(),
            now,
            now + deadline_s,
            None,
            BATCH.rank,
            tenant,
            cost=cost,
            batch_cost=batch_cost,
        )
        try:
            if refused is not None:
                raise refused
            self._check_quarantine(model, text)
        except ApiError as err:  # answered at once: the scheduler's callback records it failed
            item.future.set_exception(err)
        return item
