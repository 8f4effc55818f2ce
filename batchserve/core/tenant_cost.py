"""The account of cost served, per (model, tier, tenant): one notion of what work costs, counted where it is
answered (issue 33, item 1).

Cost is what the backend says an input costs (`cost_of`: minilm's tokens; 1 for a plugin that declares none),
the same figure the fair queue shares by and admission predicts with. The batcher's workers add every input
answered with an output (`GpuPool`), once, however many times its batch was re-run; failed, expired and
refused inputs cost nothing here. Readers: the ledger (per-tier aggregates for /metrics, where no tenant id may
appear: docs/contract.md#observability; a tenant's own at /v1/usage), the job scheduler (a tenant's share by cost), the
generation engine (which adds its own answers to the same account). Totals since the process started, so a
reader takes differences over its window; with `--processes N` each process keeps its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchserve.core.tiers import TIERS


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
        """The running totals of (model, tier, tenant), created at zero: for a writer that adds many inputs of
        one key in a row (a batch's answers) with one look-up, as `add` would one by one."""
        key = (model, tier, tenant)
        got = self.served.get(key)
        if got is None:
            got = self.served[key] = ServedCost()
        return got

    def snapshot(self) -> dict[tuple[str, int, str], ServedCost]:
        """A copy of every total, for a reader that compares two moments."""
        return {key: ServedCost(s.inputs, s.cost) for key, s in self.served.items()}

    def by_tier(self, model: str | None = None) -> list[ServedCost]:
        """Per tier rank (the `tiers.TIERS` order), every tenant summed: what /metrics may show. `model`: only
        that model's."""
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
