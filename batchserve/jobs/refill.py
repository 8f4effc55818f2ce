"""The job scheduler's refill policy in one place: what a piece of job work costs, and how much of it may be
put in the batcher now (issue 33, item 4).

Job work is priced by the inputs it holds: a native job item is one input, an OpenAI batch line as many as it
holds (an `/v1/embeddings` line with a list of 2,048 inputs is 2,048: `lines.line_inputs`). Every count below is
in inputs. Before (issue 33), a line counted as one item in flight whatever it held, so 128 places held
128 lines of 2,048 inputs: minilm's queue reached 409,570 items and another tenant's interactive requests got
"the queue ... is full".

Three bounds, each in inputs, and the scheduler feeds while all three have room (`Budget.can`):
- the places: `--jobs-max-inflight` job inputs queued or running at once (0 = 2 x max_batch_size x healthy
  workers; with several tenants 2 batches per tenant), shared between tenants (`shares`: no tenant holds more
  than its share while others wait);
- the model's spare capacity, measured by cost (`model_spare`): two full batches per healthy worker, a full
  batch being as many inputs of the job's mean cost as the model's cost budget holds (`--max-batch-tokens`,
  or the budget the batcher lowered to fit the latency objective), so a model of long inputs takes fewer;
- the model's queue: job inputs never bring a model's queue (every tier) past `BATCH_QUEUE_SHARE` of
  `--max-queue`, so interactive callers always keep the rest of it.

A line is fed an input at a time (the scheduler stops when a bound is reached and goes on when inputs are
answered), so a line of 2,048 inputs cannot push the queue past these bounds either. Everything here is
arithmetic over numbers the door reads (`Room`): the unit tests drive it without a batcher or a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol
from collections.abc import Callable

# The most of a model's `--max-queue` that job inputs may fill (every tier's queued items counted): the rest
# is the interactive callers'. Job inputs are bounded far lower by the spare capacity anyway; this bound holds
# when an operator sets --jobs-max-inflight high.
BATCH_QUEUE_SHARE = 0.25


class Room(Protocol):
    """What the door says of one model's queue and batches (`core.service.InferenceService.job_room`)."""

    @property
    def depth(self) -> int: ...  # inputs queued for the model now, every tier
    @property
    def max_queue(self) -> int: ...  # --max-queue
    @property
    def rows(self) -> int: ...  # the most inputs in one batch of the model
    @property
    def budget(self) -> float: ...  # the most one batch may cost (math.inf: no cost budget)
    @property
    def unit(self) -> float: ...  # the batcher's mean cost of an input of the model
    @property
    def healthy(self) -> int: ...  # healthy workers


def places(configured: int, max_batch_size: int, healthy: int, tenants: int = 1) -> int:
    """Job inputs queued or running at once, all tenants together: the operator's `--jobs-max-inflight`, or
    one batch running and one waiting per worker, grown to two batches per tenant with work (a batch takes job
    inputs of one tenant only, `FairQueue.pop(stick=...)`)."""
    if configured > 0:
        return configured
    auto = 2 * max_batch_size * healthy
    return max(auto, 2 * max_batch_size * tenants) if auto > 0 else 0


def shares(total: int, held: dict[str, int], tenants: list[str]) -> dict[str, int]:
    """Inputs each tenant may add now: its share of `total` less what it holds. No tenant holds more than its
    share while others wait, and each may fill its share whatever the others hold now (places taken before it
    came, and held in slow re-runs, must not keep it waiting), so the places held pass `total` for a while by
    what others hold beyond their shares, never more."""
    if not tenants:
        return {}
    cap = -(-total // len(tenants))
    return {t: max(0, cap - held.get(t, 0)) for t in tenants}


def batch_rows(room: Room, job_unit: float) -> int:
    """Inputs of the job's mean cost in one full batch of the model: its batch size, or what its cost budget
    holds of inputs costing the more of the batcher's mean input and the job's."""
    if room.budget == math.inf:
        return room.rows
    mean = max(room.unit, job_unit, 1e-9)
    return max(1, min(room.rows, int(room.budget // mean)))


def model_cap(room: Room, job_unit: float, configured: int = 0, tenants: int = 1) -> int:
    """The most job inputs of one model queued or running at once: two full batches (by cost, `batch_rows`)
    per healthy worker, grown to two per tenant with work on the model as `places` grows (a batch takes job
    inputs of one tenant only), or the operator's --jobs-max-inflight; never more than `BATCH_QUEUE_SHARE` of
    the model's --max-queue. 0 with no healthy worker."""
    if room.healthy <= 0:
        return 0
    cap = configured if configured > 0 else 2 * batch_rows(room, job_unit) * max(room.healthy, tenants)
    return min(cap, max(1, int(room.max_queue * BATCH_QUEUE_SHARE)))


def model_spare(room: Room, job_unit: float, held: int, configured: int = 0, tenants: int = 1) -> int:
    """Job inputs of this model that may be added now: what its cap leaves beside the `held` job inputs in
    flight, and what its queue's share leaves beside every input queued now (interactive ones included)."""
    by_cost = model_cap(room, job_unit, configured, tenants) - held
    by_queue = max(1, int(room.max_queue * BATCH_QUEUE_SHARE)) - room.depth
    return max(0, min(by_cost, by_queue))


@dataclass
class Budget:
    """What one refill may still feed: places left (`free`) and per tenant (`allowed`; None: no shares, the
    isolated jobs' own budget), both taken from as inputs are fed; and each model's room, read afresh each time
    (`room_of`: `model_spare` over the live queue and the inputs in flight; None for a model the door does not
    queue, the generation engine, which admits its own work)."""

    free: int
    room_of: Callable[[str], int | None]
    allowed: dict[str, int] | None = None

    def can(self, tenant: str, model: str) -> int:
        n = self.free
        if self.allowed is not None:
            n = min(n, self.allowed.get(tenant, 0))
        room = self.room_of(model)
        if room is not None:
            n = min(n, room)
        return max(0, n)

    def take(self, tenant: str, n: int) -> None:
        self.free -= n
        if self.allowed is not None:
            self.allowed[tenant] = self.allowed.get(tenant, 0) - n


@dataclass
class Ledger:
    """Job inputs in the batcher or on a worker: on the shared path (by tenant, for the shares), in isolated
    jobs' batches, and by model (both paths, for the model's room)."""

    shared: int = 0
    isolated: int = 0
    tenants: dict[str, int] = field(default_factory=dict)
    models: dict[str, int] = field(default_factory=dict)

    def add(self, tenant: str, model: str, n: int, shared: bool) -> None:
        if shared:
            self.shared += n
            _move(self.tenants, tenant, n)
        else:
            self.isolated += n
        _move(self.models, model, n)

    def isolate(self, tenant: str, n: int) -> None:
        """`n` inputs on the shared path are counted with the isolated ones from now on (their job was isolated)."""
        self.shared -= n
        self.isolated += n
        _move(self.tenants, tenant, -n)

    @property
    def total(self) -> int:
        return self.shared + self.isolated


def _move(counts: dict[str, int], key: str, n: int) -> None:
    left = counts.get(key, 0) + n
    if left:
        counts[key] = left
    else:
        counts.pop(key, None)


UNIT_ALPHA = 0.05  # weight of the newest job input in a model's mean job-input cost


def mean_cost(before: float | None, cost: float) -> float:
    """The mean cost of a model's job inputs, an exponentially weighted average (the first input sets it)."""
    return cost if before is None else before + UNIT_ALPHA * (cost - before)
