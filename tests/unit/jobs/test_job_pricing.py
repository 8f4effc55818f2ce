"""Job lines priced by the inputs they hold, fed from the model's spare capacity (issue 33, item 4), in-process:
the real scheduler and the real line runner over a door that queues inputs as the batcher does and answers them
when the test says (no threads, no sleeps, no server). Before, a line counted as one item in flight whatever it
held: a refill put every input of 128 lines in the queue (issue 33: 409,570 items for minilm, and another
tenant's interactive requests got 503 "the queue ... is full")."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from dataclasses import dataclass, field

import orjson
import pytest
from prometheus_client import CollectorRegistry

from batchserve.config import Settings
from batchserve.core.fairqueue import Item, ItemResult
from batchserve.errors import ApiError
from batchserve.jobs.lines import LineRunner
from batchserve.jobs.metrics import JobMetrics
from batchserve.jobs.openai_batch import InputCheck
from batchserve.jobs.scheduler import Scheduler
from batchserve.jobs.store import Job

EMBEDDINGS = "/v1/embeddings"


@dataclass(frozen=True)
class Room:
    """What `InferenceService.job_room` says of a model (`refill.Room`)."""

    depth: int
    max_queue: int
    rows: int
    budget: float
    unit: float
    healthy: int


@dataclass
class QueueDoor:
    """The door as the scheduler and the line runner see it, over a queue kept like the batcher's: `depth`
    counts every queued input (`interactive` of them another tenant's), and `serve` takes queued inputs into a
    batch and answers them."""

    max_batch_size: int = 64
    max_queue: int = 10000
    interactive: int = 0
    budget: float = math.inf
    unit: float = 1.0
    cost: float = 1.0  # what each job input costs (the backend's cost_of)
    draining: bool = False
    queue: list[Item] = field(default_factory=list)
    peak: int = 0  # the deepest the queue got
    fail: set[str] = field(default_factory=set)  # inputs answered with a 500
    tokenized: set[str] = field(default_factory=set)  # texts the tokenizer stage was given (`pretokenize`)
    unready: list[str] = field(default_factory=list)  # texts submitted before they were given to it

    @property
    def depth(self) -> int:
        return self.interactive + len(self.queue)

    def healthy_workers(self) -> int:
        return 1

    def models(self) -> list[str]:
        return ["m"]

    def job_room(self, model: str) -> Room:
        return Room(self.depth, self.max_queue, self.max_batch_size, self.budget, self.unit, 1)

    async def pretokenize(self, model: str, texts: list[str], tenant: str = "") -> None:
        await asyncio.sleep(0)  # a trip to the stage's thread and back
        self.tokenized.update(texts)

    def submit_background(self, text: str, model: str, tenant: str, deadline_s: float, alone: bool = False) -> Item:
        if text not in self.tokenized:
            self.unready.append(text)
        item = Item(
            text,
            model,
            0,
            asyncio.get_running_loop().create_future(),
            0.0,
            deadline_s,
            tier=3,
            tenant=tenant,
            cost=self.cost,
        )
        self.queue.append(item)
        self.peak = max(self.peak, self.depth)
        return item

    def submit_group(self, texts: list[str], model: str, tenant: str, deadline_s: float) -> list[Item]:
        return [self.submit_background(t, model, tenant, deadline_s) for t in texts]

    def serve(self, n: int) -> int:
        """One batch: up to n queued inputs that were not withdrawn, each answered with [its length, 0]."""
        batch, self.queue = self.queue[:n], self.queue[n:]
        for item in batch:
            if item.future.done():
                continue
            if item.text in self.fail:
                item.future.set_exception(ApiError(500, "INFERENCE_FAILED", "it fails"))
            else:
                item.future.set_result(ItemResult([float(len(item.text)), 0.0], 0.0, 0.01, len(batch)))
        return len(batch)


@dataclass
class RowsStore:
    """The store as a refill uses it: each job's pending rows, claimed in order."""

    rows: dict[str, list[tuple[int, str]]]

    async def claim(self, job_id: str, n: int, lease_s: float, now: float) -> list[tuple[int, str]]:
        taken, self.rows[job_id] = self.rows[job_id][:n], self.rows[job_id][n:]
        return taken


def embeddings_line(i: int, inputs: int) -> str:
    return orjson.dumps(
        {"custom_id": f"l{i}", "body": {"model": "m", "input": [f"w{i}-{k}" for k in range(inputs)]}}
    ).decode()


def scheduler(door: QueueDoor, lines: list[str], settings: Settings | None = None) -> Scheduler:
    settings = settings or Settings()
    store = RowsStore({"j": list(enumerate(lines))})
    s = Scheduler(
        store,
        door,
        settings,
        JobMetrics.create(CollectorRegistry()),  # type: ignore[arg-type]
        LineRunner(door, settings, lambda model, texts: 0),
    )
    s.add(Job("j", "acme", "m", "in_progress", len(lines), 0, 0, 0, 0.0, None, None, openai={"endpoint": EMBEDDINGS}))
    return s


@pytest.fixture(autouse=True)
def inline_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A line's answer counts its tokens in a worker thread (`asyncio.to_thread`), whose end reaches the loop only
    when the thread has run: on a busy machine after more than `settle`'s turns, so how far a test got depended on
    the machine (CI once leased 8 lines where 7 was the most). Here the (trivial) count runs inline, and the turns
    below are all a line's answer needs."""

    async def inline(fn, /, *args, **kwargs):
        return fn(*args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", inline)


async def settle() -> None:
    for _ in range(5):  # done callbacks and the lines' answer tasks run on the next turns of the loop
        await asyncio.sleep(0)


def test_a_line_of_2048_inputs_takes_2048_places_and_never_more_than_the_spare_capacity() -> None:
    """Six lines of 2,048 inputs (issue 33's 6-line file): the queue holds at most the job's places, two full
    batches for the one worker (128 inputs), however many lines are read. Undone (a line priced as one item),
    the first refill queued all 12,288 inputs."""

    async def main() -> tuple[int, int, int]:
        door = QueueDoor()
        s = scheduler(door, [embeddings_line(i, 2048) for i in range(6)])
        await s._refill()
        first = len(door.queue)
        await s._refill()  # no input answered: nothing more is fed
        return first, len(door.queue), s.inflight

    first, again, inflight = asyncio.run(main())
    assert first == 2 * 64, first
    assert again == first and inflight == first


def test_the_job_goes_on_as_inputs_are_answered_and_each_line_gets_every_embedding() -> None:
    """Fed as the worker answers, a batch at a time, the queue never passes the job's places, and each line's
    answer holds its 2,048 embeddings in input order."""

    async def main() -> tuple[int, list[list[float]], int, int]:
        door = QueueDoor()
        s = scheduler(door, [embeddings_line(i, 2048) for i in range(3)])
        for _ in range(10_000):
            await s._refill()
            if not door.queue:
                break
            door.serve(64)
            await settle()
        for _ in range(5000):  # the last line's answer counts its tokens in a thread: wait for it
            if len(s.outcomes) == 3:
                break
            await asyncio.sleep(0.001)
        bodies = {o.index: orjson.loads(o.output)["body"] for o in s.outcomes}
        firsts = [[d["embedding"][0] for d in bodies[i]["data"][:3]] for i in sorted(bodies)]
        return door.peak, firsts, sum(len(b["data"]) for b in bodies.values()), s.feeder.ledger.total

    peak, firsts, embeddings, left = asyncio.run(main())
    assert peak <= 2 * 64, peak
    assert embeddings == 3 * 2048
    assert firsts[0] == [float(len("w0-0")), float(len("w0-1")), float(len("w0-2"))]
    assert left == 0  # every place given back


def test_job_inputs_leave_the_interactive_share_of_the_queue_alone() -> None:
    """Another tenant's 2,490 interactive inputs wait in a --max-queue 10000 queue: job inputs may bring it to a
    quarter of --max-queue (2,500), so 10 go in, and none while it is that deep. Undone (no bound by the
    queue), the job took its 128 places on top."""

    async def main() -> int:
        door = QueueDoor(interactive=2490)
        s = scheduler(door, [embeddings_line(i, 2048) for i in range(2)])
        await s._refill()
        return len(door.queue)

    assert asyncio.run(main()) == 10


def test_an_operator_set_jobs_max_inflight_still_leaves_three_quarters_of_the_queue() -> None:
    """--jobs-max-inflight 100000 counts inputs too, and is held to a quarter of --max-queue per model."""

    async def main() -> int:
        door = QueueDoor(max_queue=1000)
        s = scheduler(door, [embeddings_line(i, 2048) for i in range(2)], Settings(jobs_max_inflight=100_000))
        for _ in range(3):
            await s._refill()
        return door.peak

    assert asyncio.run(main()) == 250


def test_long_inputs_take_fewer_places_by_cost() -> None:
    """A model whose batches may cost 640 (tokens), with inputs of cost 40: a full batch holds 16 of them, so
    the job has 2 x 16 places, not 2 x 64. Undone (counted in inputs, not by cost), 128 went in."""

    async def main() -> int:
        door = QueueDoor(budget=640.0, unit=10.0, cost=40.0)
        s = scheduler(door, [embeddings_line(i, 2048) for i in range(2)])
        for _ in range(3):
            await s._refill()
        return len(door.queue)

    assert asyncio.run(main()) == 32


def test_a_failing_input_fails_its_line_withdraws_the_rest_and_frees_every_place() -> None:
    """The first input that fails fails the line: its queued inputs leave the queue, its places are freed, and
    nothing more of it is fed (it is retried later as a whole)."""

    async def main() -> tuple[int, int, list[str]]:
        door = QueueDoor(fail={"w0-3"})
        s = scheduler(door, [embeddings_line(0, 2048)], Settings(jobs_max_attempts=1))
        await s._refill()
        door.serve(64)
        await settle()
        await s._refill()
        queued = sum(not i.future.done() for i in door.queue)
        return queued, s.feeder.ledger.total, [o.status for o in s.outcomes]

    queued, held, statuses = asyncio.run(main())
    assert queued == 0 and held == 0
    assert statuses == ["failed"]


@pytest.mark.parametrize("inputs, limit, ok", [([3, 2], 5, True), ([3, 3], 5, False), ([1] * 5, 5, True)])
def test_jobs_max_items_counts_the_inputs_of_an_input_file(inputs: list[int], limit: int, ok: bool) -> None:
    """Two lines of 3 inputs are 6 inputs, over a limit of 5: 400 naming the line and the count. Undone (lines
    counted), the file was accepted, and one 'job' of 50,000 lines could hold ~100 M embeddings (issue 34)."""
    content = b"\n".join(
        orjson.dumps(
            {"custom_id": f"c{i}", "method": "POST", "url": EMBEDDINGS, "body": {"input": [f"t{k}" for k in range(n)]}}
        )
        for i, n in enumerate(inputs)
    )

    def check() -> InputCheck:
        parsed = InputCheck(EMBEDDINGS, limit, 1 << 20)
        parsed.feed(content)
        parsed.end()
        return parsed

    if ok:
        assert check().inputs == sum(inputs)
        return
    with pytest.raises(ApiError) as err:
        check()
    assert err.value.status == 400
    assert "line 2 brings them to 6" in err.value.message and "--jobs-max-items" in err.value.message


def test_a_tenant_that_comes_later_gets_room_on_the_model_the_first_fills() -> None:
    """acme's job holds the model's whole job room (2 batches for the one worker); globex's job, coming later,
    gets its own 2 batches at once: the model's room grows with the tenants that have work on it, as the places
    do (a batch takes job inputs of one tenant only). Undone (the room by workers alone), globex got nothing
    until acme's inputs were answered."""

    async def main() -> dict[str, int]:
        door = QueueDoor()
        store = RowsStore({"a": [(i, f"a{i}") for i in range(500)], "g": [(i, f"g{i}") for i in range(500)]})
        s = Scheduler(store, door, Settings(), JobMetrics.create(CollectorRegistry()))  # type: ignore[arg-type]
        s.add(Job("a", "acme", "m", "in_progress", 500, 0, 0, 0, 0.0, None, None))
        for _ in range(3):
            await s._refill()
        s.add(Job("g", "globex", "m", "in_progress", 500, 0, 0, 0, 0.0, None, None))
        for _ in range(3):
            await s._refill()
        return dict(Counter(i.tenant for i in door.queue))

    assert asyncio.run(main()) == {"acme": 128, "globex": 128}


def test_a_node_leases_the_lines_it_can_feed_soon_not_128_of_them() -> None:
    """Rows are claimed from the store (and leased: no other node may run them) by the inputs they hold: a few
    lines first, then as many as the inputs wanted need. Undone (128 rows a claim whatever they hold), this
    node leased all 20 lines (40,960 inputs) to feed 128 of them, and held them from every other node."""

    async def main() -> tuple[int, int]:
        door = QueueDoor()
        s = scheduler(door, [embeddings_line(i, 2048) for i in range(20)])
        for _ in range(3):
            await s._refill()
        leased = 20 - len(s.store.rows["j"])  # type: ignore[attr-defined]
        while door.queue:  # the first lines done: later claims are a line at a time
            door.serve(64)
            await settle()
            await s._refill()
            if len(s.outcomes) >= 5:
                break
        return leased, 20 - len(s.store.rows["j"])  # type: ignore[attr-defined]

    first, later = asyncio.run(main())
    assert first == 4, first
    assert later <= 7, later  # the 5 lines done, the one being fed, and at most one read ahead


@pytest.mark.parametrize("lines", [True, False])
def test_job_inputs_reach_the_door_tokenized_by_the_stage(lines: bool) -> None:
    """Issue 36: a job's inputs are given to the tokenizer stage (`Door.pretokenize`) when its rows are read,
    before any of them is fed, so the door costs each by a look-up and the event loop tokenizes none: an OpenAI
    batch's embeddings lines (every input of each line) and a native job's rows alike. Undone, every job input
    was tokenized on the loop by `cost_of` as it was fed."""

    async def main() -> tuple[set[str], list[str], int]:
        door = QueueDoor()
        if lines:
            s = scheduler(door, [embeddings_line(i, 40) for i in range(6)])
        else:
            store = RowsStore({"n": [(i, f"row {i}") for i in range(300)]})
            s = Scheduler(store, door, Settings(), JobMetrics.create(CollectorRegistry()))  # type: ignore[arg-type]
            s.add(Job("n", "acme", "m", "in_progress", 300, 0, 0, 0, 0.0, None, None))
        fed = 0
        for _ in range(200):
            await s._refill()
            fed += len(door.queue)
            if not door.queue:
                break
            door.serve(64)
            await settle()
        return door.tokenized, door.unready, fed

    tokenized, unready, fed = asyncio.run(main())
    assert fed >= (240 if lines else 300)
    assert unready == []
    assert len(tokenized) == (240 if lines else 300)
