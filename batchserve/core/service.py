"""The inference service: the one door to the batcher (in the spirit of TEI's `Infer`).

Every piece of work that rides a batch enters here: `infer` for a caller waiting on the answer (the
inference route, and the embeddings route), `submit_background` for batch-job items that fill the places
interactive work leaves, and `check_open` for the generation routes, whose own admission is the KV cache but
which must refuse in the same words while the server drains or has no worker. The service owns admission
state, builds each `Item`, arms its deadline and counts what is in flight; nothing else calls
`Batcher.submit`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Mapping, Protocol

from batchserve import errors
from batchserve.errors import ApiError, ClientGone
from batchserve.batcher import Batcher
from batchserve.core.admission import Admission, Capacity
from batchserve.core.deadlines import DeadlineWatch
from batchserve.core.fairqueue import Item, ItemResult
from batchserve.core.requests_log import RequestLog
from batchserve.core.tiers import BATCH


class Bucketer(Protocol):
    """What the door needs of a backend: which inputs may share a batch, and what each costs to run."""

    def bucket_of(self, text: str) -> int: ...
    def cost_of(self, text: str) -> float: ...


class InferenceService:
    def __init__(self, batcher: Batcher, admission: Admission, backends: Mapping[str, Bucketer],
                 requests: RequestLog, clock: Callable[[], float] = time.monotonic) -> None:
        self.batcher = batcher
        self.admission = admission
        self.requests = requests  # recent requests' status, for GET /v1/requests/{id}
        self.backends = backends  # model id -> backend; filled as the runtime loads them
        self.clock = clock
        self.deadlines = DeadlineWatch(clock)
        self.inflight = 0  # callers admitted and not yet answered (inference and generation)

    # -- state the routes and the job scheduler read --------------------------------------------------------
    @property
    def draining(self) -> bool:
        return self.batcher.draining

    @property
    def max_batch_size(self) -> int:
        return self.batcher.max_batch_size

    def attach(self, capacity: Capacity) -> None:
        """The workers have started: admission can see them from now on."""
        self.admission.capacity = capacity

    def healthy_workers(self) -> int:
        capacity = self.admission.capacity
        return capacity.healthy_count() if capacity is not None else 0

    def models(self) -> list[str]:
        return list(self.backends)

    def check_open(self, needs_workers: bool = True) -> None:
        """503 DRAINING (or, for work that runs on the batch workers, NO_HEALTHY_WORKER) when nothing can be
        admitted now."""
        if needs_workers:
            self.admission.check_open()
        elif self.batcher.draining:
            raise errors.draining()

    def hold(self) -> None:
        """A caller served outside the batcher (a generation request) is in flight: the drain waits for it."""
        self.inflight += 1

    def release(self) -> None:
        self.inflight -= 1

    # -- the door -----------------------------------------------------------------------------------------
    async def infer(self, text: str, model: str, tier: int, tenant: str, timeout_s: float, arrived: float,
                    request_id: str, gone: Callable[[], bool] | None = None, owner: str = "") -> ItemResult:
        """Admit one input, queue it, and wait for its answer; raises the ApiError that fits (503 at the door,
        504 at the deadline, 500 when it failed alone), or ClientGone when `gone` says the caller left.
        An admitted request is recorded under (`owner` or `tenant`, `request_id`) with its status as it moves."""
        return (await self.infer_many([text], model, tier, tenant, timeout_s, arrived, request_id, gone, owner))[0]

    async def infer_many(self, texts: list[str], model: str, tier: int, tenant: str, timeout_s: float,
                         arrived: float, request_id: str, gone: Callable[[], bool] | None = None,
                         owner: str = "") -> list[ItemResult]:
        """`infer` for a request of several inputs: one admission decision for all of them, predicted as the
        batches they will make (so a request of 2,048 inputs is served when they fit its timeout), then each
        input as its own item, so they share batches with other callers' inputs. The first failure fails the
        request and withdraws the others (a cancelled item never takes a place in a batch)."""
        backend = self.backends[model]
        costs = [float(backend.cost_of(text)) for text in texts]
        probe = self.admission.admit(model, tier, tenant, timeout_s - (self.clock() - arrived), costs)
        record = self.requests.add(owner or tenant, request_id, model)
        loop = asyncio.get_running_loop()
        deadline = arrived + timeout_s
        items = []
        for text, cost in zip(texts, costs):
            item = Item(text, model, backend.bucket_of(text), loop.create_future(), arrived, deadline, record, tier,
                        tenant, gone=gone, cost=cost, probe=probe)
            self.batcher.note_cost(model, cost)
            self.batcher.submit(item)
            self.deadlines.watch(timeout_s, item.deadline, item.future)
            items.append(item)
        self.inflight += 1
        try:
            if len(items) == 1:
                results: list[ItemResult] = [await items[0].future]
            else:
                results = list(await asyncio.gather(*(item.future for item in items)))
        except ApiError as err:
            record.status, record.error = "failed", err.code
            raise
        except ClientGone:
            record.status, record.error = "failed", "CLIENT_DISCONNECTED"
            raise
        finally:
            self.inflight -= 1
            for item in items:
                if not item.future.done():
                    item.future.cancel()
        last = results[-1]
        record.completed((self.clock() - arrived) * 1000, last.queue_s * 1000, last.compute_s * 1000,
                         last.batch_size)
        return results

    def submit_background(self, text: str, model: str, tenant: str, deadline_s: float,
                          alone: bool = False) -> Item:
        """Queue a batch-job item at the lowest tier, past the latency admission (it only takes places
        interactive work leaves, and the job scheduler bounds how many wait); its future carries an
        `ItemResult` or the error, its `dispatched` says whether a batch has taken it yet. `alone`: the item
        runs in a batch of its own once no interactive item waits (the job's items keep failing)."""
        now = self.clock()
        backend = self.backends[model]
        item = Item(text, model, backend.bucket_of(text), asyncio.get_running_loop().create_future(),
                    now, now + deadline_s, None, BATCH.rank, tenant, cost=float(backend.cost_of(text)))
        if alone:
            self.batcher.submit_alone(item)
        else:
            self.batcher.submit(item)
        return item
