"""The one request value (core/work.py): the door fills in what it priced, the batcher's items copy what their
loop reads from it, and the HTTP skeleton books an answer from it alone."""

from __future__ import annotations

import asyncio
import time

import pytest

from batchserve.config import Settings
from batchserve.core.fairqueue import Item
from batchserve.core.work import Work
from batchserve.runtime import Runtime


class Priced:
    """A backend whose inputs cost their words: the door's price is checkable."""

    def cost_of(self, text: str) -> float:
        return float(len(text.split()))

    def bucket_of(self, text: str) -> int:
        return 0


@pytest.mark.parametrize("many", [False, True])
def test_the_door_books_inputs_and_cost_on_the_request(many: bool) -> None:
    async def main() -> Work:
        rt = Runtime.create(Settings())
        rt.service.backends["sim@v1"] = Priced()  # type: ignore[assignment]
        texts = ["one two", "three four five"] if many else ["one two three four"]
        work = Work("req", time.monotonic(), 1, "t", model="sim@v1").due_in(5.0)
        call = rt.service.infer_many(work, texts) if many else rt.service.infer(work, texts[0])
        task = asyncio.ensure_future(call)
        for _ in range(200):  # admitted once its record exists
            if rt.requests.get("t", "req") is not None:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        return work

    work = asyncio.run(main())
    assert (work.inputs, work.cost) == ((2, 5.0) if many else (1, 4.0))


def test_an_item_copies_what_the_loop_reads_from_its_request() -> None:
    async def main() -> None:
        gone = lambda: False  # noqa: E731
        work = Work("r", 10.0, 0, "acme", model="m@v1", gone=gone).due_in(2.5)
        item = Item.of(work, "x", 3, asyncio.get_running_loop().create_future(), None, 7.0, True, None)
        assert (item.model, item.arrived, item.deadline, item.tier, item.tenant, item.gone) == (
            "m@v1",
            10.0,
            12.5,
            0,
            "acme",
            gone,
        )
        assert (item.text, item.bucket, item.cost, item.probe, item.attempts, item.dispatched) == (
            "x",
            3,
            7.0,
            True,
            0,
            0.0,
        )

    asyncio.run(main())


def test_a_request_is_kept_under_its_owner_else_its_tenant() -> None:
    assert Work("r", 0.0, tenant="acme").record_owner == "acme"
    assert Work("r", 0.0, tenant="anonymous", owner="anonymous@1.2.3.4").record_owner == "anonymous@1.2.3.4"
    assert Work("r", 3.0).due_in(1.5).timeout_s == 1.5
