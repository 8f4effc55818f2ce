"""The scheduler stops when told, even when a loop's wake-up and the stop come in the same turn of the event loop.

On Python 3.11 `asyncio.wait_for` returns the awaited result and drops a cancellation that arrives in the turn its
awaited future completes, so a loop written `while True: await wait_for(event.wait(), t)` ran on after
`Scheduler.stop()` cancelled it, and the stop (so the server's SIGTERM) waited for it for good (a CI run killed
such a node after 30 s). The scheduler's loops wait with `asyncio.timeout` instead."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from batchserve.config import Settings
from batchserve.jobs.metrics import JobMetrics
from batchserve.jobs.scheduler import Scheduler
from batchserve.jobs.store import Job


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
