"""When a request waiting behind the work ahead would be answered: the door's prediction (`admission.Admission`).

Predicted by the cost of the work ahead. For a request of n inputs of tier t and tenant u:

    ahead  = items it would wait behind (every higher tier, and its tenant's fair share of its own tier by cost:
             `Batcher.ahead_of`, so a tenant over its share waits behind more and is refused first)
    F      = inputs in a full batch of the model (`BatchBudget.full_n`: the batch size, or what its budget holds)
    the first of its inputs is answered at  until_free + (ahead // F) x S(full) / healthy + S(its batch)
    the last                              at  until_free + (ahead // F) x S(full) / healthy
                                              + (k - 1) x S(one of its batches) / healthy + S(its last batch)
                                          with k its own batches: as many of its inputs as the budget holds each,

where S is the learned batch time at a batch's cost (`core/batch.BatchTimes`; its own batches cost rows x its
longest input). That is for a model of one queue; a model of length classes has its classes' turns replayed instead
(`class_turns.drain`), every class's batches read at the padded cost of a row (`BatchBudget.row_cost`).
Pure arithmetic over the batcher's queues and learned times: no clock, no state of its own.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

from batchserve.core.batch import rows_in
from batchserve.core.batcher import Batcher
from batchserve.core.class_turns import ClassQueue, Own, WaitPrediction, drain


def predicted_latency_s(
    until_free_s: float, ahead: int, max_batch_size: int, batch_s: float, healthy: int, own_batch_s: float | None = None
) -> float:
    """When a new item would be answered: the first free worker, the full batches ahead of it (`batch_s`
    each) shared by the healthy workers, then its own batch (`own_batch_s`, by default a full one)."""
    own = batch_s if own_batch_s is None else own_batch_s
    return until_free_s + (ahead // max_batch_size) * batch_s / max(1, healthy) + own


def predict(
    batcher: Batcher,
    model: str,
    until_free_s: float,
    healthy: int,
    ahead: int,
    costs: Sequence[float],
    bucket: int | None = None,
    rates: Mapping[int, float] | None = None,
) -> WaitPrediction:
    """The batches ahead (full ones of the model's mean input) and the request's own (rows of its longest
    input, as many as the budget holds), each at its cost (module docstring). With `bucket` (the request's length
    class) and other classes busy, their turns are replayed, `rates` being the inputs per second joining each."""
    times = batcher.batch_s
    limit, budget = batcher.costs.limit(model), batcher.costs.budget(model)
    unit = batcher.costs.unit.get(model, 1.0)
    # Its own batches: inputs of like length (the backend groups them, `bucket_of`), padded to its longest.
    own_unit = max(costs, default=1.0)
    share = max(1, healthy)
    if bucket is not None and _other_class_busy(batcher, model, bucket, rates):
        return _by_turns(batcher, model, until_free_s, share, ahead, costs, bucket, rates or {}, limit, budget)
    # One queue (the sim, a plugin without bucket_of, or a costed model whose other classes are quiet): FIFO
    # batches, the formula above; a class's batches at the padded cost of a row, as in the replay.
    if bucket is not None:
        # A row ahead costs its queue's mean input (the model's when it is empty), never below its padded `row`.
        row, own_q = batcher.costs.row_cost.get((model, bucket), 0.0), batcher.queues.get((model, bucket))
        unit = max(own_q.mean_cost() if own_q is not None and len(own_q) else unit, row)
        own_unit = max(own_unit, row)
        full_n = rows_in(limit, budget, unit)
        full_s = times.at(model, batcher.costs.estimate_cost(model, full_n, unit))
    else:
        full_n, full_s = batcher.costs.full_n(model), times[model]
    per_batch = rows_in(limit, budget, own_unit)
    # A batch's cost is rows x cost within the budget (`BatchBudget.estimate_cost`), written out: runs per request.
    cap = math.inf if budget == math.inf else max(1.0, budget)
    base = until_free_s + (ahead // full_n) * full_s / share
    rem = ahead % full_n
    if rem + 1 > per_batch:  # the partial batch ahead leaves without it
        base += times.at(model, min(rem * unit, cap)) / share
        rem = 0
    first = base + times.at(model, min((rem + 1) * own_unit, cap))
    if len(costs) <= 1:  # one input (nearly every request): the last is the first (the formula gives the same)
        return WaitPrediction(first, first, base)
    total = rem + len(costs)
    k = -(-total // per_batch)
    last_rows = total - (k - 1) * per_batch
    last = (
        base
        + (k - 1) * times.at(model, min(per_batch * own_unit, cap)) / share
        + times.at(model, min(last_rows * own_unit, cap))
    )
    return WaitPrediction(first, max(first, last), base)


def _other_class_busy(batcher: Batcher, model: str, bucket: int, rates: Mapping[int, float] | None) -> bool:
    """Whether another length class of the model has items queued or inputs joining (then the turns are
    replayed)."""
    for (m, b), q in batcher.queues.items():
        if m == model and b != bucket and (len(q) or (rates and rates.get(b))):
            return True
    return False


def _by_turns(
    batcher: Batcher,
    model: str,
    until_free_s: float,
    share: int,
    ahead: int,
    costs: Sequence[float],
    bucket: int,
    rates: Mapping[int, float],
    limit: int,
    budget: float,
) -> WaitPrediction:
    """`predict` for a model of length classes: their queues as the request sees them (its tier's share of
    each, `ahead` of the model's depth), replayed turn by turn; a batch holds `rows_in(limit, budget, cost)`."""
    per = functools.partial(rows_in, limit, budget)
    depth = batcher.depth.get(model, 0)
    part = min(1.0, ahead / depth) if depth else 0.0  # of the queued items, the share ahead by tier
    served, unit, padded = batcher.bucket_served_at, batcher.costs.unit.get(model, 1.0), batcher.costs.row_cost
    others: list[ClassQueue] = []
    own_q = None
    for (m, b), q in batcher.queues.items():
        if m != model:
            continue
        if b == bucket:
            own_q = q
            continue
        rate = rates.get(b, 0.0)
        if len(q) or rate > 0:
            # A row of its batches costs what the batch's longest input does (padding), not its mean input.
            cost = max(q.mean_cost() if len(q) else unit, padded.get((m, b), 0.0))
            others.append(ClassQueue(float(math.ceil(len(q) * part)), cost, per(cost), rate, served.get((m, b), 0.0)))
    row = padded.get((model, bucket), 0.0)
    own_unit = max(max(costs, default=1.0), row)
    queued = len(own_q) if own_q is not None else 0
    ahead_unit = max(own_q.mean_cost() if own_q is not None and queued else own_unit, row)
    own = Own(
        math.ceil(queued * part),
        ahead_unit,
        per(ahead_unit),
        max(1, len(costs)),
        own_unit,
        per(own_unit),
        rates.get(bucket, 0.0),
        served.get((model, bucket), 0.0),
    )
    times, cap = batcher.batch_s, max(1.0, budget)  # a batch's cost: rows x cost, within the budget
    return drain(
        batcher.clock(), until_free_s, share, own, others, lambda rows, cost: times.at(model, min(rows * cost, cap))
    )
