"""The job store contract (`batchserve/jobs/store.py`), run against both stores: SQLite (a real file) and
PostgreSQL (a real server, `tests/pg_server.py`). Where the contract is about many nodes — two store instances
on one database, as two nodes have — the PostgreSQL runs use two instances; SQLite allows one process per file,
so there the "other node" is the same instance (its leases must still hold against itself).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Awaitable, Callable

import orjson
import psycopg
import pytest

from batchserve.jobs.pg_store import PostgresStore
from batchserve.jobs.sqlite_store import SQLiteStore
from batchserve.jobs.store import IdempotencyConflict, JobStore, NewJob, Outcome, UnstorableInput, row_cost, whole_bytes


@dataclass
class Stores:
    """Opens store instances on one fresh database; `writes` reads the result-write count of each item."""

    kind: str
    location: str
    opened: list[JobStore] = field(default_factory=list)

    async def open(self) -> JobStore:
        if self.kind == "sqlite":
            if not self.opened:  # one process per file: a second "node" is the same instance
                self.opened.append(await SQLiteStore.open(self.location))
            return self.opened[0]
        store = await PostgresStore.open(self.location)
        self.opened.append(store)
        return store

    async def two(self) -> tuple[JobStore, JobStore]:
        a = await self.open()
        return a, await self.open()

    async def close(self) -> None:
        for store in self.opened:
            await store.close()
        self.opened.clear()

    def rows(self, job_id: str) -> list[tuple]:
        """(idx, status, output, writes) of every item, in index order, read from the database itself."""
        query = "SELECT idx, status, output, writes FROM {t} WHERE job_id = {p} ORDER BY idx"
        if self.kind == "sqlite":
            conn = sqlite3.connect(self.location)
            try:
                return conn.execute(query.format(t="items", p="?"), (job_id,)).fetchall()
            finally:
                conn.close()
        with psycopg.connect(self.location) as conn:
            return conn.execute(query.format(t="batchserve_items", p="%s"), (job_id,)).fetchall()


@pytest.fixture(params=["sqlite", "postgres"])
def stores(request, tmp_path):
    if request.param == "sqlite":
        return Stores("sqlite", str(tmp_path / "jobs.db"))
    return Stores("postgres", request.getfixturevalue("pg_server").fresh_url())


def run(stores: Stores, scenario: Callable[[], Awaitable[None]]) -> None:
    async def main() -> None:
        try:
            await scenario()
        finally:
            await stores.close()

    asyncio.run(main())


def new_job(
    n: int = 10,
    tenant: str = "acme",
    key: str | None = None,
    inputs: list[str] | None = None,
    job_id: str | None = None,
    model: str = "sim@v1",
) -> NewJob:
    inputs = inputs if inputs is not None else [f"in-{i}" for i in range(n)]
    return NewJob(
        job_id or f"batch_{time.monotonic_ns()}",
        tenant,
        model,
        inputs,
        {"b": 1, "a": [2]},
        key,
        "hash-of-" + ",".join(inputs),
        time.time(),
    )


def done(job_id: str, index: int, output: str = "") -> Outcome:
    return Outcome(job_id, index, "completed", output=output or f"out-{index}")


def indexes(claimed: list[tuple[int, str]]) -> list[int]:
    return [i for i, _ in claimed]


LONG = 60.0  # a lease that does not run out during a test


def test_create_is_whole_and_an_idempotent_repeat_returns_the_first_job(stores):
    async def scenario() -> None:
        store = await stores.open()
        job, created = await store.create(new_job(5, key="k1", job_id="batch_one"))
        assert created and (job.status, job.total, job.pending, job.metadata) == ("queued", 5, 5, {"b": 1, "a": [2]})
        again, created_again = await store.create(new_job(5, key="k1", job_id="batch_two"))
        assert not created_again and again.id == "batch_one"
        with pytest.raises(IdempotencyConflict):
            await store.create(new_job(6, key="k1", job_id="batch_three"))
        other, created_other = await store.create(new_job(5, tenant="globex", key="k1", job_id="batch_four"))
        assert created_other and other.id == "batch_four"  # keys are per tenant
        unkeyed = [await store.create(new_job(2)) for _ in range(2)]
        assert all(created for _, created in unkeyed)  # no key: never a repeat
        assert [r[:2] for r in stores.rows("batch_one")] == [(i, "pending") for i in range(5)]
        assert stores.rows("batch_two") == [] and stores.rows("batch_three") == []

    run(stores, scenario)


def test_an_idempotency_key_holds_across_nodes_submitting_at_once(stores):
    if stores.kind == "sqlite":
        pytest.skip("one process per SQLite file: there is no second node")

    async def scenario() -> None:
        a, b = await stores.two()
        results = await asyncio.gather(
            *(s.create(new_job(50, key="same", job_id=f"batch_{n}")) for n, s in enumerate([a, b, a, b]))
        )
        assert sum(created for _, created in results) == 1
        assert len({job.id for job, _ in results}) == 1
        with pytest.raises(IdempotencyConflict):
            await b.create(new_job(51, key="same"))
        assert len(await a.list_jobs("acme", 10, None)) == 1

    run(stores, scenario)


def test_claim_skips_items_leased_to_another_node_and_marks_the_job_running(stores):
    async def scenario() -> None:
        a, b = await stores.two()
        job, _ = await a.create(new_job(8))
        assert indexes(await a.claim(job.id, 3, LONG, time.time())) == [0, 1, 2]
        running = await a.get("acme", job.id)
        assert running is not None and running.status == "running" and running.started_at is not None
        assert indexes(await b.claim(job.id, 3, LONG, time.time())) == [3, 4, 5]
        assert indexes(await a.claim(job.id, 10, LONG, time.time())) == [6, 7]
        assert await b.claim(job.id, 10, LONG, time.time()) == []  # everything is leased

    run(stores, scenario)


def test_concurrent_claims_never_hand_out_an_item_twice(stores):
    async def scenario() -> None:
        a, b = await stores.two()
        job, _ = await a.create(new_job(400))
        claims = await asyncio.gather(*(s.claim(job.id, 30, LONG, time.time()) for s in [a, b] * 10))
        got = [i for claim in claims for i in indexes(claim)]
        assert sorted(got) == list(range(400)) and len(got) == len(set(got))

    run(stores, scenario)


def test_an_expired_lease_is_claimed_again_and_a_renewed_one_is_not(stores):
    async def scenario() -> None:
        a, b = await stores.two()
        job, _ = await a.create(new_job(4))
        assert indexes(await a.claim(job.id, 2, 0.3, time.time())) == [0, 1]  # the node that will "die"
        assert indexes(await a.claim(job.id, 2, 0.3, time.time())) == [2, 3]  # the node that lives
        await asyncio.sleep(0.15)
        assert await a.renew(job.id, [2, 3], 0.6) == 2
        assert await b.claim(job.id, 10, LONG, time.time()) == []
        await asyncio.sleep(0.3)  # 0 and 1 are past their lease; 2 and 3 were renewed
        assert indexes(await b.claim(job.id, 10, LONG, time.time())) == [0, 1]
        if stores.kind == "postgres":
            assert await a.renew(job.id, [0, 1], LONG) == 0  # they are b's now

    run(stores, scenario)


def test_a_released_lease_is_claimable_at_once(stores):
    async def scenario() -> None:
        a, b = await stores.two()
        job, _ = await a.create(new_job(3))
        assert indexes(await a.claim(job.id, 3, LONG, time.time())) == [0, 1, 2]
        await a.release(job.id, [1, 2])
        assert indexes(await b.claim(job.id, 3, LONG, time.time())) == [1, 2]

    run(stores, scenario)


def test_each_result_is_recorded_exactly_once_and_results_stay_in_input_order(stores):
    async def scenario() -> None:
        a, b = await stores.two()
        job, _ = await a.create(new_job(6))
        await a.claim(job.id, 6, LONG, time.time())
        # Out of order, and items 1 and 4 run twice (by two nodes: a lease ran out under a slow one).
        await asyncio.gather(
            a.record([done(job.id, 4), done(job.id, 1, "first")], time.time()),
            b.record([done(job.id, 1, "second"), done(job.id, 4)], time.time()),
        )
        progress = await b.record(
            [
                done(job.id, 4, "late"),
                done(job.id, 5),
                done(job.id, 0),
                Outcome(job.id, 3, "failed", error="INFERENCE_FAILED", message="poison"),
            ],
            time.time(),
        )
        assert [(p.status, p.counts["completed"], p.counts["failed"], p.counts["pending"]) for p in progress] == [
            ("running", 4, 1, 1)
        ]
        final = await a.record([done(job.id, 2), done(job.id, 0, "again")], time.time())
        assert [(p.status, p.counts["completed"], p.counts["pending"]) for p in final] == [("completed", 5, 0)]
        lines = await a.results(job.id, -1, 100)
        assert [line.index for line in lines] == list(range(6))
        assert [line.output for line in lines] == ["out-0", lines[1].output, "out-2", None, "out-4", "out-5"]
        assert lines[1].output in ("first", "second") and lines[3].error == "INFERENCE_FAILED"
        assert [r[3] for r in stores.rows(job.id)] == [1] * 6  # one result write per item, from the database
        page = await a.results(job.id, 2, 2)
        assert [line.index for line in page] == [3, 4]
        finished = await a.get("acme", job.id)
        assert finished is not None and finished.status == "completed" and finished.finished_at is not None

    run(stores, scenario)


def test_cancel_freezes_the_job_and_a_late_result_is_not_recorded(stores):
    async def scenario() -> None:
        a, b = await stores.two()
        job, _ = await a.create(new_job(5))
        await a.claim(job.id, 2, LONG, time.time())
        await a.record([done(job.id, 0)], time.time())
        cancelled = await b.cancel("acme", job.id, time.time())
        assert cancelled is not None and (cancelled.status, cancelled.completed, cancelled.cancelled) == (
            "cancelled",
            1,
            4,
        )
        await a.record([done(job.id, 1)], time.time())  # was running when the cancel came
        after = await a.get("acme", job.id)
        assert after is not None and (after.status, after.completed, after.cancelled) == ("cancelled", 1, 4)
        assert await a.claim(job.id, 5, LONG, time.time()) == []
        assert [r[1] for r in stores.rows(job.id)] == ["completed"] + ["cancelled"] * 4
        assert (await b.cancel("acme", job.id, time.time())).cancelled == 4  # cancelling again changes nothing
        assert await a.active(["sim@v1"]) == []

    run(stores, scenario)


def test_reads_are_scoped_by_tenant(stores):
    async def scenario() -> None:
        store = await stores.open()
        mine, _ = await store.create(new_job(2, tenant="acme"))
        theirs, _ = await store.create(new_job(2, tenant="globex"))
        assert await store.get("globex", mine.id) is None
        assert await store.cancel("globex", mine.id, time.time()) is None
        assert (await store.get("acme", mine.id)).status == "queued"  # the foreign cancel did nothing
        assert [j.id for j in await store.list_jobs("acme", 10, None)] == [mine.id]
        assert [j.id for j in await store.list_jobs("globex", 10, None)] == [theirs.id]

    run(stores, scenario)


def test_list_pages_newest_first_and_active_lists_unfinished_jobs_of_served_models(stores):
    async def scenario() -> None:
        store = await stores.open()
        ids = [(await store.create(new_job(1, job_id=f"batch_{i}")))[0].id for i in range(5)]
        other, _ = await store.create(new_job(1, job_id="batch_other_model", model="big@v2"))
        page = await store.list_jobs("acme", 2, None)
        assert [j.id for j in page] == [other.id, ids[4]]
        assert [j.id for j in await store.list_jobs("acme", 3, ids[4])] == [ids[3], ids[2], ids[1]]
        await store.claim(ids[0], 1, LONG, time.time())
        await store.record([done(ids[0], 0)], time.time())
        assert [j.id for j in await store.active(["sim@v1"])] == ids[1:]  # oldest first, finished ones gone
        assert [j.id for j in await store.active(["big@v2"])] == [other.id]

    run(stores, scenario)


def test_postgres_refuses_an_input_with_a_nul_and_stores_outputs_with_one(stores):
    if stores.kind == "sqlite":
        pytest.skip("SQLite text holds NUL characters")

    async def scenario() -> None:
        store = await stores.open()
        with pytest.raises(UnstorableInput, match=r'"inputs"\[1\]'):
            await store.create(new_job(inputs=["ok", "bad\x00input"]))
        assert await store.list_jobs("acme", 10, None) == []  # refused whole
        job, _ = await store.create(new_job(1))
        await store.record([done(job.id, 0, "out\x00put")], time.time())  # a model's output: kept, not lost
        assert (await store.results(job.id, -1, 1))[0].output == "out\ufffdput"

    run(stores, scenario)


def test_an_unreachable_postgres_is_a_clear_store_error(tmp_path: Path):
    from batchserve.jobs.store import StoreUnavailable

    async def scenario() -> None:
        with pytest.raises(StoreUnavailable):
            await PostgresStore.open(f"postgresql://nobody@/none?host={tmp_path}&port=1&connect_timeout=1")

    asyncio.run(scenario())


# -- the store's circuit breaker (issue 28, item 5), with an injected clock --------------------------------------
def test_the_breaker_refuses_while_open_lets_one_probe_through_and_closes_on_its_success():
    from batchserve.jobs.breaker import CircuitBreaker
    from batchserve.jobs.store import StoreDown

    now = [0.0]
    b = CircuitBreaker(open_s=1.0, clock=lambda: now[0])
    assert b.before() is False and b.closed  # closed: every call goes through, none is a probe
    b.failure("connection refused")
    with pytest.raises(StoreDown, match="connection refused"):
        b.before()
    now[0] = 1.0
    assert b.before() is True  # the probe
    with pytest.raises(StoreDown):  # the others are still refused while it runs
        b.before()
    b.failure("still refused")
    now[0] = 1.5
    with pytest.raises(StoreDown, match="still refused"):
        b.before()
    now[0] = 2.0
    assert b.before() is True
    b.success()
    assert b.closed and b.before() is False


# -- a black-holed PostgreSQL (issue 34, item 4): every call bounded on the client -------------------------------
def test_a_call_caught_mid_statement_by_a_stopped_server_fails_at_its_bound_and_the_next_at_once():
    """The server's processes are SIGSTOPped while a call's statement runs (pg_sleep): the server never answers
    and never refuses, and its statement_timeout never fires. The call fails with StoreDown at the client-side
    bound (CALL_BOUND_S), not after the outage; the next call is refused by the breaker at once; a call that
    moves many rows or bytes is given more (`bound_for`); and after SIGCONT the store is used again within seconds.
    (Before: the first call waited for as long as the server stayed stopped.)"""
    from batchserve.jobs.pg_calls import BODY_BYTES_PER_S, CALL_BOUND_S, CUT_GRACE_S, ROWS_PER_S, bound_for
    from batchserve.jobs.store import StoreDown
    from tests.pg_server import PgServer

    assert bound_for() == CALL_BOUND_S and bound_for(2 * BODY_BYTES_PER_S, 3 * ROWS_PER_S) == CALL_BOUND_S + 5
    pg = PgServer.start()
    frozen: list[int] = []

    async def scenario() -> None:
        nonlocal frozen
        store = await PostgresStore.open(pg.fresh_url())
        try:
            job, _ = await store.create(new_job(3))

            async def slow(conn: psycopg.AsyncConnection) -> None:
                await conn.execute("SELECT pg_sleep(0.5)")

            began = time.monotonic()
            call = asyncio.ensure_future(store.calls.tx(slow))
            await asyncio.sleep(0.2)  # the statement is running on the server
            frozen = pg.freeze()
            with pytest.raises(StoreDown, match=f"no answer within {CALL_BOUND_S:g} s"):
                await asyncio.wait_for(call, 10)  # (a TimeoutError, not StoreDown, when unbounded)
            took = time.monotonic() - began
            assert took < CALL_BOUND_S + CUT_GRACE_S + 2.0, took  # the bound, not the outage
            began = time.monotonic()
            with pytest.raises(StoreDown):
                await store.get(job.tenant, job.id)
            assert time.monotonic() - began < 0.1  # refused by the breaker: no wait at all
            pg.thaw(frozen)
            frozen = []
            give_up = time.monotonic() + 15
            while True:
                try:
                    assert (await store.get(job.tenant, job.id)).id == job.id
                    break
                except StoreDown:
                    assert time.monotonic() < give_up, "the store was not used again after SIGCONT"
                    await asyncio.sleep(0.1)
        finally:
            if frozen:
                pg.thaw(frozen)
            await store.close()

    try:
        asyncio.run(scenario())
    finally:
        pg.stop()


def test_results_come_in_pages_bounded_in_bytes_and_a_huge_output_a_piece_at_a_time(stores):
    """Pages are chosen by the rows' stored sizes, whatever the inputs' sizes: small inputs with outputs of
    100 kB to 1.5 MB (a held output is read back byte-exact in pieces, multi-byte characters cut anywhere), and
    an input over the page's share (its custom_id read by the store)."""
    limit = 1 << 20
    whole = whole_bytes(limit)
    sizes = [10, 100_000, 700_000, 20, 1_500_000, 300_000, 100_000, 100_000, 100_000, 5]
    outputs = [orjson.dumps("é" * (size // 2) + "x" * (size % 2)).decode() for size in sizes]
    lines = [orjson.dumps({"custom_id": f"c{i}", "body": {}}).decode() for i in range(len(sizes))]
    lines[3] = orjson.dumps({"custom_id": "big-input", "body": {"input": "w" * (whole + 1)}}).decode()

    async def scenario() -> None:
        store = await stores.open()
        job, _ = await store.create(new_job(inputs=lines))
        await store.record([done(job.id, i, out) for i, out in enumerate(outputs)], time.time())
        got: list = []
        after = -1
        while page := await store.results(job.id, after, 100, with_input=True, max_bytes=limit):
            inputs = [whole if r.custom_id is not None else len((r.input or "").encode()) for r in page]
            held = sum(row_cost(r.output_bytes, n, r.message, limit) for r, n in zip(page, inputs))
            assert len(page) == 1 or held <= limit, [r.index for r in page]
            for r in page:
                assert len((r.output or "").encode()) <= whole and len((r.input or "").encode()) <= whole
            got += page
            after = page[-1].index
        assert [r.index for r in got] == list(range(len(sizes)))
        assert len(await store.results(job.id, -1, 100, True, limit)) < len(sizes)  # the first page is not all
        for r, out in zip(got, outputs):
            assert r.output_bytes == len(out.encode()) and r.held == (len(out.encode()) > whole)
            if r.held:
                pieces, start = [], 0
                while piece := await store.output_piece(job.id, r.index, start, 256 << 10):
                    assert len(piece) <= 256 << 10
                    pieces.append(piece)
                    start += len(piece)
                assert b"".join(pieces) == out.encode() and len(pieces) > 1
            else:
                assert r.output == out
        assert (got[3].input, got[3].custom_id) == (None, "big-input")
        assert [r.custom_id for r in got if r.index != 3] == [None] * (len(sizes) - 1)
        assert await store.output_piece(job.id, 99, 0, 10) is None  # no such item

    run(stores, scenario)
