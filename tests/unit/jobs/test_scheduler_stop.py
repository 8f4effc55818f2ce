"""The scheduler stops when told, and gives its leases back on the way out.

It stops even when a loop's wake-up and the stop come in the same turn of the event loop.

On Python 3.11 `asyncio.wait_for` returns the awaited result and drops a cancellation that arrives in the turn its
awaited future completes, so a loop written `while True: await wait_for(event.wait(), t)` ran on after
`Scheduler.stop()` cancelled it, and the stop (so the server's SIGTERM) waited for it for good (a CI run killed
such a node after 30 s). The scheduler's loops wait with `asyncio.timeout` instead."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from batchserve.config import Settings
from batchserve.jobs import scheduler
from batchserve.jobs.job_state import JobState
from batchserve.jobs.metrics import JobMetrics
from batchserve.jobs.scheduler import Scheduler
from batchserve.jobs.store import Job, StoreDown


@dataclass
class IdleStore:
    """No unfinished job: the loops only wait."""

    async def active(self, models: list[str]) -> list[Job]:
        return []


class IdleDoor:
    max_batch_size = 10
    draining = False

    def models(self) -> list[str]:
        return ["m"]

    def healthy_workers(self) -> int:
        return 1


def test_the_loops_stop_when_their_wake_up_and_the_stop_come_together() -> None:
    async def main() -> None:
        s = Scheduler(IdleStore(), IdleDoor(), Settings(), JobMetrics.create(CollectorRegistry()))  # type: ignore[arg-type]
        await s.start()
        await asyncio.sleep(0.02)  # every loop is waiting now
        for _ in range(3):  # each round: both events fire, then the stop, in one turn
            s._wake.set()
            s._flush_now.set()
            async with asyncio.timeout(2.0):
                await s.stop()
            assert all(t.done() for t in s._tasks)
            await s.start()
            await asyncio.sleep(0.02)
        await s.stop()

    asyncio.run(main())


@dataclass
class RefusingStore:
    """A store whose first `refusals` releases are refused as an outage (`StoreDown`), as a store whose breaker
    opened when the stop's cancellations cut a connection; what it was asked to release."""

    refusals: int
    released: list[tuple[str, list[int]]] = field(default_factory=list)

    async def release(self, job_id: str, indexes: list[int]) -> None:
        if self.refusals > 0:
            self.refusals -= 1
            raise StoreDown("the job store is unreachable (test)")
        self.released.append((job_id, indexes))


def test_a_stopping_node_gives_its_leases_back_after_one_refusal(monkeypatch, caplog) -> None:
    """The leases of unrecorded items are released on stop, tried again once (the breaker's open time later) when
    the store refused, so another node takes the items at once; after a second refusal they are left to expire,
    and the log says so."""
    monkeypatch.setattr(scheduler, "STOP_RETRY_S", 0.01)
    job = JobState("batch_a", "acme", "m")
    job.held.update({3, 1, 2})
    once = RefusingStore(refusals=1)
    asyncio.run(scheduler.release_on_stop(once, job, 60.0))  # type: ignore[arg-type]
    assert once.released == [("batch_a", [1, 2, 3])]
    twice = RefusingStore(refusals=2)
    with caplog.at_level("WARNING", logger="batchserve.jobs"):
        asyncio.run(scheduler.release_on_stop(twice, job, 60.0))  # type: ignore[arg-type]
    assert twice.released == [] and "batch_a: leases not given back; they expire in 60s" in caplog.text
