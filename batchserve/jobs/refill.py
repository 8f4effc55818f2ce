"""The job scheduler's refill policy: what a piece of job work costs, and how much of it may be put in the batcher
now.

Job work is priced by the inputs it holds, not by rows: a native job item is one input, an OpenAI batch line as many
as it holds (`lines.line_inputs`), so a few lines of 2,048 inputs cannot fill a model's queue. Every count here is in
inputs, and the scheduler feeds while all three bounds have room (`Budget.can`):
- the places (`places`), shared so no tenant holds more than its share while others wait (`shares`);
- the model's spare capacity by cost (`model_spare`), so a model of long inputs takes fewer;
- the model's queue: job inputs never bring it (every tier) past `BATCH_QUEUE_SHARE` of `--max-queue`, so
  interactive callers always keep the rest.

A line is fed an input at a time, so it cannot push past these bounds either. Everything here is arithmetic over
numbers the door reads (`Room`): the unit tests drive it without a batcher or a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Callable

from batchserve.core.service import JobRoom as Room  # what the door says of one model's queue and batches

# Job inputs are bounded far lower by the spare capacity; this holds when an operator sets --jobs-max-inflight high.
BATCH_QUEUE_SHARE = 0.25


def places(configured: int, max_batch_size: int, healthy: int, tenants: int = 1) -> int:
    """Job inputs queued or running at once, all tenants together: the operator's `--jobs-max-inflight`, or
    one batch running and one waiting per worker, grown to two batches per tenant with work (a batch takes job
    inputs of one tenant only, `FairQueue.pop(stick=...)`)."""
    if configured > 0:
        return configured
    auto = 2 * max_batch_size * healthy
    return max(auto, 2 * max_batch_size * tenants) if auto > 0 else 0


def shares(total: int, held: dict[str, int], tenants: list[str]) -> dict[str, int]:
    """Inputs each tenant may add now: its share of `total` less what it holds. Each may fill its share whatever
    the others hold (places taken before it came, or held in slow re-runs, must not keep it waiting), so the places
    held may pass `total` by what others hold beyond their shares, never more."""
    cap = -(-total // max(1, len(tenants)))
    return {t: max(0, cap - held.get(t, 0)) for t in tenants}


def batch_rows(room: Room, job_unit: float) -> int:
    """Inputs of the job's mean cost in one full batch of the model: its batch size, or what its cost budget
    holds of inputs costing the more of the batcher's mean input and the job's."""
    if room.budget == math.inf:
        return room.rows
    mean = max(room.unit, job_unit, 1e-9)
    return max(1, min(room.rows, int(room.budget // mean)))


def model_cap(room: Room, job_unit: float, configured: int = 0, tenants: int = 1) -> int:
    """The most job inputs of one model queued or running at once: the operator's --jobs-max-inflight, or two full
    batches (`batch_rows`) per healthy worker or per tenant, as in `places`; never more than `BATCH_QUEUE_SHARE` of
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
    """What one refill may still feed: places left (`free`), per tenant (`allowed`; None for the isolated jobs'
    budget), and each model's room, read afresh each time (`room_of`; None where the door does not queue the model)."""

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
