"""The two scheduler rules that keep one tenant's failing job from dragging another's (issue 28 item 3), each
checked alone, in-process: a job whose failures cost re-runs is isolated, and no tenant holds another's share
of the job places. The live test (tests/integration/core/test_failing_inputs.py) sees the share's loss in
the clean job's time, but not isolation's (there the share and the background share of re-runs bound the
failing job either way), so each rule has a test here that fails when it alone is undone."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from batchserve.config import Settings
from batchserve.core.fairqueue import Item
from batchserve.jobs.metrics import JobMetrics
from batchserve.jobs.job_state import FAILING_WINDOW, JobState
from batchserve.jobs.scheduler import Scheduler
from batchserve.jobs.store import Job


@dataclass
class HeldDoor:
    """A door whose items never finish: every place a job takes stays held, as in a slow re-run."""

    max_batch_size: int = 20
    draining: bool = False
    submitted: dict[str, int] = field(default_factory=dict)  # tenant -> items submitted

    def healthy_workers(self) -> int:
        return 1

    def models(self) -> list[str]:
        return ["m"]

    def job_room(self, model: str) -> None:
        return None  # no bound by model here: the shares alone are under test

    def _item(self, text: str, model: str, tenant: str, deadline_s: float) -> Item:
        self.submitted[tenant] = self.submitted.get(tenant, 0) + 1
        return Item(text, model, 0, asyncio.get_running_loop().create_future(), 0.0, deadline_s, tier=3, tenant=tenant)

    def submit_background(self, text: str, model: str, tenant: str, deadline_s: float, alone: bool = False) -> Item:
        return self._item(text, model, tenant, deadline_s)

    def submit_group(self, texts: list[str], model: str, tenant: str, deadline_s: float) -> list[Item]:
        return [self._item(t, model, tenant, deadline_s) for t in texts]

    async def pretokenize(self, model: str, texts: list[str], tenant: str = "") -> None:
        return None


@dataclass
class RowsStore:
    """Just the claim a refill makes: each job's pending rows, handed out in order."""

    rows: dict[str, list[tuple[int, str]]]

    async def claim(self, job_id: str, n: int, lease_s: float, now: float) -> list[tuple[int, str]]:
        taken, self.rows[job_id] = self.rows[job_id][:n], self.rows[job_id][n:]
        return taken


def _job(job_id: str, tenant: str, total: int) -> Job:
    return Job(job_id, tenant, "m", "in_progress", total, 0, 0, 0, 0.0, None, None)


def test_a_tenant_that_comes_later_gets_its_share_while_the_first_holds_every_place() -> None:
    """acme's job came first and took every job place; its items are held (slow re-runs of a failing job).
    globex's job then gets its share at once: ceil(2 batches per tenant x 2 tenants / 2) = 40 places, past the
    40 acme holds. With one pool of places for all tenants (the share undone) globex got none until acme's
    re-runs ended."""

    async def main() -> tuple[dict[str, int], int]:
        door = HeldDoor()
        store = RowsStore({"a": [(i, f"a-{i}") for i in range(500)], "g": [(i, f"g-{i}") for i in range(400)]})
        s = Scheduler(store, door, Settings(), JobMetrics.create(CollectorRegistry()))  # type: ignore[arg-type]
        s.add(_job("a", "acme", 500))
        await s._refill()
        held = door.submitted.get("acme", 0)
        s.add(_job("g", "globex", 400))
        await s._refill()
        return dict(door.submitted), held

    submitted, acme_alone = asyncio.run(main())
    assert acme_alone == 40  # the automatic places: one batch running and one waiting, per worker
    assert submitted.get("globex", 0) == 40, submitted
    assert submitted["acme"] == 40, submitted  # acme already holds its share: nothing more for it


def test_a_job_whose_failures_cost_re_runs_is_isolated_in_groups_sized_to_its_rate() -> None:
    """Two failures found by failing batches among a job's recent outcomes isolate it; failures the backend
    named (not costly) do not. Undone (a threshold no job reaches), a 10 %-failing job kept riding shared
    batches."""
    job = JobState("j", "acme", "m")
    job.recent.extend([False] * 18 + [True])
    assert job.group_size(20) == 0  # one costly failure: could be chance
    job.recent.append(True)
    assert job.group_size(20) == 5  # 2 in 20: groups of 1 / (2 x 10 %)
    job.recent.extend([True] * 8 + [False] * (FAILING_WINDOW - 8))  # the window moves on: 8 in 64
    assert job.group_size(20) == 4
    named = JobState("k", "acme", "m")
    named.recent.extend([False] * 20)  # named failures are recorded as not costly
    assert named.group_size(20) == 0
