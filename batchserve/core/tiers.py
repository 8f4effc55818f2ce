"""The priority tiers, in one table every module reads (docs/contract.md#tiers-and-tenants).

A tier is a caller's class of service: a higher tier is taken first into a batch (`head_start`: the waiting a
lower tier needs before it overtakes, in the model's SLOs), is shed last under pressure (`shed`: a factor of
`slo x slack`), and gets a larger default rate limit per key (`rate`, `burst`). Adding a tier is one line here.

Head starts count in the model's SLO, not in seconds: a model's queue waits scale with its SLO (admission lets
them reach `slo x slack x shed`), so a fixed lead would be most of the wait on a fast model and next to nothing on a
slow one. A `paid` input overtakes once it has waited one SLO, about when admission's bound says it would start to
miss. Batch-job work keeps a fixed 30 s: it fills spare capacity whatever the model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Tier:
    name: str
    rank: int  # 0 = highest priority; items, lanes and counters are indexed by it
    rate: float  # default requests per second per key
    burst: float  # default bucket size per key
    shed: float  # under pressure, refuse past slo x slack x this
    head_start: float  # waiting an item of this tier needs to overtake a fresh item of rank 0, in SLOs
    interactive: bool = True  # False for work that only fills spare places (batch jobs)
    fixed_s: float | None = None  # a head start in seconds instead, whatever the SLO (the batch tier)


TIERS: tuple[Tier, ...] = (
    Tier("enterprise", 0, rate=1000.0, burst=2000.0, shed=1.2, head_start=0.0),
    Tier("paid", 1, rate=100.0, burst=200.0, shed=1.0, head_start=1.0),
    Tier("free", 2, rate=10.0, burst=20.0, shed=0.8, head_start=2.5),
    Tier("batch", 3, rate=10.0, burst=20.0, shed=0.8, head_start=0.0, interactive=False, fixed_s=30.0),
)

NAMES: tuple[str, ...] = tuple(t.name for t in TIERS)
BY_NAME: dict[str, Tier] = {t.name: t for t in TIERS}
CALLER_NAMES: tuple[str, ...] = tuple(t.name for t in TIERS if t.interactive)  # tiers an API key may have
BATCH: Tier = BY_NAME["batch"]


def aging_for(slo_s: float) -> tuple[float, ...]:
    """Each tier's head start in seconds on a model of this SLO, by rank (the fair queue's hot loop reads it)."""
    return tuple(t.head_start * slo_s if t.fixed_s is None else t.fixed_s for t in TIERS)


AGING_S: tuple[float, ...] = aging_for(0.2)  # a queue's until its model's SLO is known (the default SLO's)
SHED: tuple[float, ...] = tuple(t.shed for t in TIERS)


def by_name(name: str) -> Tier:
    tier = BY_NAME.get(name)
    if tier is None:
        raise ValueError(f"unknown tier {name!r} (tiers: {', '.join(NAMES)})")
    return tier


# OpenAI's `service_tier` values, beside the tier names, as a request may ask for its priority: "auto" and
# "default" its key's tier, "priority" the best its key allows, "flex" the batch tier (spare capacity only).
SERVICE_TIERS: tuple[str, ...] = ("auto", "default", "priority", "flex")
ASKABLE: tuple[str, ...] = (*SERVICE_TIERS, *NAMES)


def asked(value: str | int, tier: int, best: int) -> int | None:
    """The rank a request runs at when it asks for `value` (a tier name, a `service_tier`, or Triton's priority
    level: 0 the default, 1 the highest, each next one a tier lower), for a caller of `tier` whose key allows up to
    `best`: a request may ask for less than its key's tier, and for more only up to `best` (capped there). None
    when `value` names nothing."""
    if isinstance(value, int):
        if value < 0:
            return None
        return tier if value == 0 else max(min(value - 1, BATCH.rank), best)
    if value in ("auto", "default"):
        return tier
    if value == "priority":
        return best
    if value == "flex":
        return BATCH.rank
    found = BY_NAME.get(value)
    return None if found is None else max(found.rank, best)
