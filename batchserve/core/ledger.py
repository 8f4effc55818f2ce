"""The books of what was answered: the SLO ledger (what the server promised each answer and whether it kept it,
docs/contract.md#observability), the account of cost served, and the recent requests' records.

Every answer of a model route (/v1/inference, /v1/embeddings, KServe v2 infer, /v1/chat/completions,
/v1/completions) is one of five outcomes:

- `met`: 2xx within the SLO (`--slo-ms`; on the generation routes the time to the first token is held to it,
  since the whole answer's time grows with the tokens the caller asked for);
- `slow`: 2xx past the SLO (a 2xx is within its deadline, or it would have been a 504);
- `refused`: 429 or 503: turned away at the door (rate limit, queue full, predicted wait, draining, no worker);
- `expired`: 504: the deadline passed after admission (or could never be met);
- `failed`: any other 5xx.

Other 4xx (a bad body, an unknown model or key, a body too large) are the caller's mistakes, not a promise the
server made, and a caller who hangs up before its answer (499) reads no answer: neither is an outcome.

This module is the policy only: the classification and the per-tenant usage window of `GET /v1/usage`
(`UsageBook`). The Prometheus counters, per model and tier and never per tenant, are `batchserve/metrics.py`'s;
`http/guards.py` feeds both from the one place every answer passes.
"""

from __future__ import annotations

import math
import time
from collections import deque, OrderedDict
from dataclasses import dataclass, field
from collections.abc import Callable, Iterable
from batchserve.core.tiers import TIERS
import msgspec

OUTCOMES = ("met", "slow", "refused", "expired", "failed")
MET, SLOW, REFUSED, EXPIRED, FAILED = range(5)
ADMITTED = (MET, SLOW, EXPIRED, FAILED)  # what SLO attainment divides by: the requests the server took on

BUCKET_S = 5.0  # resolution of the usage window: a window is rounded out to whole buckets
MAX_WINDOW_S = 3600.0  # the longest window /v1/usage answers for (the buckets kept per tenant)
DEFAULT_WINDOW_S = 300.0
LATENCIES = 2048  # per tenant, and per tenant and model: the latest served answers' latencies kept for p50 / p95


def served_outcome(latency_s: float, slo_s: float) -> int:
    """MET or SLOW for a 2xx answer that took `latency_s`."""
    return MET if latency_s <= slo_s else SLOW


_ERROR_OUTCOMES = {429: REFUSED, 503: REFUSED, 504: EXPIRED}  # any other 5xx: FAILED


def error_outcome(status: int) -> int | None:
    """The outcome of an error answer, or None when it is no SLO outcome (a 4xx other than 429: the caller's)."""
    return _ERROR_OUTCOMES.get(status, FAILED if status >= 500 else None)


# A bucket: [bucket index, requests x 5 outcomes, inputs x 5 outcomes, cost served]
_REQ, _INP, _COST = 1, 1 + len(OUTCOMES), 1 + 2 * len(OUTCOMES)


def _new_bucket(index: int) -> list[float]:
    row = [0.0] * (_COST + 1)
    row[0] = index
    return row


@dataclass(slots=True)
class TenantBook:
    """One tenant's counts per time bucket (`buckets`, the newest `row` until `row_end`), what older buckets
    held (`evicted`: since start = evicted + buckets), and its served answers' latest latencies, of all its
    models (`latencies`) and of each (`by_model`)."""

    tier: str
    buckets: deque[list[float]] = field(default_factory=deque)
    row: list[float] = field(default_factory=lambda: _new_bucket(-1))  # the newest bucket (a dummy at first)
    row_end: float = -math.inf  # when `row` is over
    evicted: list[float] = field(default_factory=lambda: _new_bucket(-1))
    latencies: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=LATENCIES))
    by_model: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)

    def roll(self, now: float) -> list[float]:
        """A new bucket for `now`, the ones past MAX_WINDOW_S folded into `evicted`."""
        index = int(now // BUCKET_S)
        self.row = row = _new_bucket(index)
        self.row_end = (index + 1) * BUCKET_S
        buckets = self.buckets
        buckets.append(row)
        oldest = index - int(MAX_WINDOW_S // BUCKET_S)
        while buckets[0][0] < oldest:
            self.evicted = _summed([self.evicted, buckets.popleft()])
        return row


def _summed(rows: Iterable[list[float]]) -> list[float]:
    """The rows' counts added up, in a new bucket."""
    total = _new_bucket(-1)
    for row in rows:
        for i in range(1, len(row)):
            total[i] += row[i]
    return total


def _percentile(ordered: list[float], q: float) -> float:
    """Nearest rank: the smallest value with at least q of the values at or below it."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _latency(samples: deque[tuple[float, float]], since: float) -> dict[str, object]:
    """count / p50 / p95 (ms) of the samples at or after `since`."""
    served = sorted(lat for at, lat in samples if at >= since)
    if not served:
        return {"count": 0, "p50": None, "p95": None}
    p50, p95 = _percentile(served, 0.5), _percentile(served, 0.95)
    return {"count": len(served), "p50": round(p50 * 1000, 1), "p95": round(p95 * 1000, 1)}


def _counts(row: list[float]) -> dict[str, object]:
    return {
        "requests": {o: int(row[_REQ + i]) for i, o in enumerate(OUTCOMES)},
        "inputs": {o: int(row[_INP + i]) for i, o in enumerate(OUTCOMES)},
        "cost_served": row[_COST],
    }


@dataclass
class UsageBook:
    """Per tenant (a configured one, or all anonymous callers as one): requests and inputs by outcome, cost served,
    latencies of all its models and of each apart (a p95 over a fast embedder and a slow LM describes neither).
    Written by the event loop only (no lock); bounded by the tenants configured and MAX_WINDOW_S / BUCKET_S."""

    clock: Callable[[], float] = time.monotonic
    tenants: dict[str, TenantBook] = field(default_factory=dict)

    def record(
        self, tenant: str, tier: str, outcome: int, inputs: int, cost: float, latency_s: float, model: str
    ) -> None:
        """One answer of `tenant` by `model`: `cost` counts when it was served (met or slow), `latency_s` then
        too. On every answer of a model route: one row of counts touched, a bucket rolled every BUCKET_S at most."""
        now = self.clock()
        usage = self.tenants.get(tenant)
        if usage is None:
            usage = self.tenants[tenant] = TenantBook(tier)
        usage.tier = tier
        row = usage.row if now < usage.row_end else usage.roll(now)
        row[_REQ + outcome] += 1
        row[_INP + outcome] += inputs
        if outcome <= SLOW:
            row[_COST] += cost
            sample = (now, latency_s)
            usage.latencies.append(sample)
            kept = usage.by_model.get(model)
            if kept is None:
                kept = usage.by_model[model] = deque(maxlen=LATENCIES)
            kept.append(sample)

    def report(self, tenant: str, window_s: float = DEFAULT_WINDOW_S) -> dict[str, object]:
        """`tenant`'s figures over the last `window_s` (rounded out to whole buckets) and since start."""
        usage = self.tenants.get(tenant) or TenantBook("")
        now = self.clock()
        first = int((now - window_s) // BUCKET_S)
        window = _summed(row for row in usage.buckets if row[0] >= first)
        since = now - window_s
        by_model = {m: _latency(kept, since) for m, kept in sorted(usage.by_model.items())}
        latency = {
            **_latency(usage.latencies, since),
            "sample_max": LATENCIES,
            "by_model": {m: figures for m, figures in by_model.items() if figures["count"]},
        }
        return {
            "tenant": tenant,
            "tier": usage.tier or None,
            "window_s": window_s,
            **_counts(window),
            "latency_ms": latency,
            "since_start": _counts(_summed([usage.evicted, *usage.buckets])),
        }

    def reports(self, window_s: float = DEFAULT_WINDOW_S) -> list[dict[str, object]]:
        """Every tenant's figures (an admin's view), by tenant name."""
        return [self.report(t, window_s) for t in sorted(self.tenants)]


# -- the account of cost served, per (model, tier, tenant) ----------------------------------------------------
# Cost is what the backend says an input costs (`cost_of`, e.g. tokens; 1 for a plugin that declares none), the
# figure the fair queue shares by and admission predicts with. Workers (`GpuPool`) add every input answered with an
# output, once however many times its batch was re-run; failed, expired and refused inputs cost nothing. Totals since
# the process started (each process its own with `--processes N`): a reader takes differences over its window.
@dataclass(slots=True)
class ServedCost:
    """What one (model, tier, tenant) was served: inputs answered and their summed cost."""

    inputs: int = 0
    cost: float = 0.0


@dataclass
class CostAccount:
    """Cost served per (model, tier rank, tenant), totals since start. Cheap to add to (a dict update per
    input), read by copying (`snapshot`) or summing (`by_tier`, `of_tenant`)."""

    served: dict[tuple[str, int, str], ServedCost] = field(default_factory=dict)

    def add(self, model: str, tier: int, tenant: str, cost: float, inputs: int = 1) -> None:
        """`inputs` inputs of this model, tier and tenant were answered, costing `cost` in all."""
        key = (model, tier, tenant)
        got = self.served.get(key)
        if got is None:
            got = self.served[key] = ServedCost()
        got.inputs += inputs
        got.cost += cost

    def row(self, model: str, tier: int, tenant: str) -> ServedCost:
        """The running totals of (model, tier, tenant), created at zero: one look-up for a batch's answers."""
        key = (model, tier, tenant)
        got = self.served.get(key)
        if got is None:
            got = self.served[key] = ServedCost()
        return got

    def snapshot(self) -> dict[tuple[str, int, str], ServedCost]:
        """A copy of every total, for a reader that compares two moments."""
        return {key: ServedCost(s.inputs, s.cost) for key, s in self.served.items()}

    def by_tier(self, model: str | None = None) -> list[ServedCost]:
        """Per tier rank, every tenant summed (what /metrics may show); `model`: only that model's."""
        out = [ServedCost() for _ in TIERS]
        for (m, tier, _), s in self.served.items():
            if model is None or m == model:
                out[tier].inputs += s.inputs
                out[tier].cost += s.cost
        return out

    def of_tenant(self, tenant: str) -> dict[tuple[str, int], ServedCost]:
        """One tenant's totals per (model, tier rank): what its /v1/usage shows."""
        return {(m, tier): ServedCost(s.inputs, s.cost) for (m, tier, t), s in self.served.items() if t == tenant}

    def tenants(self) -> set[str]:
        return {t for _, _, t in self.served}


# -- recent requests --------------------------------------------------------------------
# Recent requests for `GET /v1/requests/{id}`, stored under (owner, id): the tenant that made the request (for
# anonymous callers, their address), so another tenant neither reads it nor overwrites it by reusing `X-Request-ID`.
# In memory and per process: behind a load balancer a lookup must reach the node that served the request.
class Record(msgspec.Struct, gc=False):
    """A request's status as `GET /v1/requests/{id}` shows it. A Struct: one per request, built in C and not
    tracked by the collector (strings and numbers only)."""

    request_id: str
    model: str
    owner: str = ""  # the tenant (or anonymous@address) that made the request; not shown
    status: str = "queued"  # queued | processing | completed | failed
    created_at: float = 0.0  # wall clock, seconds since the epoch
    latency_ms: float | None = None
    queue_ms: float | None = None
    compute_ms: float | None = None
    batch_size: int | None = None
    error: str | None = None

    def completed(self, latency_ms: float, queue_ms: float, compute_ms: float, batch_size: int) -> None:
        """Kept as measured, rounded when read (`public`): every answer comes here, few are ever read, and
        `round(x, 1)` costs ~0.5 µs each."""
        self.status = "completed"
        self.latency_ms, self.queue_ms, self.compute_ms = latency_ms, queue_ms, compute_ms
        self.batch_size = batch_size

    def public(self) -> dict:
        out = msgspec.structs.asdict(self)
        del out["owner"]
        for name in ("latency_ms", "queue_ms", "compute_ms"):
            if out[name] is not None:
                out[name] = round(out[name], 1)
        return out


class RequestLog:
    """At most `capacity` records in all, kept per owner. When full, the owner holding the most records loses
    its oldest one: a tenant that floods the history evicts its own records, never another's that holds fewer.
    The flooder is almost always the one adding, so the common eviction is O(1); otherwise a scan finds it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._by_owner: dict[str, OrderedDict[str, Record]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, owner: str, request_id: str, model: str) -> Record:
        rec = Record(request_id, model, owner, "queued", time.time())  # positional: ~0.4 µs less per request
        mine = self._by_owner.get(owner)
        if mine is None:
            mine = self._by_owner[owner] = OrderedDict()
        if mine.pop(request_id, None) is not None:  # a reused id is the owner's newest request: the youngest
            self._count -= 1
        mine[request_id] = rec
        self._count += 1
        if self._count > self.capacity:  # full (the steady state): one goes for each added
            if len(mine) * len(self._by_owner) < self._count:  # the adder holds less than its share: the largest
                owner, mine = max(self._by_owner.items(), key=lambda kv: len(kv[1]))
            mine.popitem(last=False)  # loses its oldest
            self._count -= 1
            if not mine:
                del self._by_owner[owner]
        return rec

    def get(self, owner: str, request_id: str) -> Record | None:
        mine = self._by_owner.get(owner)
        return mine.get(request_id) if mine is not None else None
