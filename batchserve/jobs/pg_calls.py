"""How the PostgreSQL job store's calls reach the database: pooled, bounded on the client, behind a breaker.

Every call (pool wait, connect, every statement, the commit) runs as a task bounded on the client (`bound_for`);
past the bound, the socket of the connection it holds is shut down, so the call fails at once instead of waiting for
a server that may never answer (a stopped or black-holed server refuses nothing: `statement_timeout` never fires,
and TCP keepalives never fire on a unix socket or while the peer's kernel still acknowledges). A failure that says
the database is unreachable, the bound passing among them, opens a circuit breaker (`breaker.py`) that refuses every
call at once (503) while one probe per second tries a fresh connection. When the probe gets through, a fresh pool
replaces the old one (whose connections are dead and whose reconnection backoff can grow to minutes), so the store
is back about a second after the database. The outage is logged once as it begins and once as it ends; the calls it
fails raise `StoreDown`, which callers answer (503) or retry without a log line each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg
from psycopg import AsyncConnection, errors
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from batchserve.jobs.breaker import CircuitBreaker
from batchserve.jobs.files import FileLimitReached
from batchserve.jobs.store import IdempotencyConflict, StoreDown, StoreUnavailable

T = TypeVar("T")
log = logging.getLogger("batchserve")
# The pool would warn every second or two for as long as an outage lasts; the store's own two lines say it once.
logging.getLogger("psycopg.pool").setLevel(logging.ERROR)

POOL_MAX = 4  # connections per node: the feeder, the writer, the lease keeper and the API rarely all at once
OPEN_TIMEOUT_S = 10  # the first pool's connections at start-up
CONNECT_TIMEOUT_S = 2  # libpq's connect_timeout (its least): an unreachable host fails in 2 s, not the OS's minutes
STATEMENT_TIMEOUT_MS = 5000  # the server's own bound on a statement (a 50,000-item COPY takes well under a second)
CALL_BOUND_S = 2.0  # the longest a store call touching a few rows takes on the client, pool wait included
BODY_BYTES_PER_S = 20 << 20  # a call that moves many bytes gets 1 s more per 20 MiB of them (`bound_for`)
ROWS_PER_S = 10_000  # and 1 s more per 10,000 rows: a 50,000-item COPY takes ~2 s loaded, and is no outage
# A read of unknown size (a file, a page of results, claimed inputs) is bounded as one of the default --files-max-bytes.
READ_BYTES = 60 << 20
CUT_GRACE_S = 0.5  # after its socket is shut down, how long a call is given to fail before it is left behind
KEEPALIVES = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 3}
TX_ATTEMPTS = 3  # a deadlock or serialization failure is retried this many times before the caller sees it


def with_timeouts(url: str) -> str:
    """The connection string with short connect and statement timeouts and keepalives (its own options kept)."""
    options = conninfo_to_dict(url).get("options") or ""
    return make_conninfo(
        url,
        connect_timeout=CONNECT_TIMEOUT_S,
        options=f"{options} -c statement_timeout={STATEMENT_TIMEOUT_MS}".strip(),
        **KEEPALIVES,
    )


def bound_for(nbytes: int = 0, rows: int = 0) -> float:
    """`CALL_BOUND_S`, more for a call moving `nbytes` in `rows` rows, so a healthy large call is not an outage."""
    return CALL_BOUND_S + nbytes / BODY_BYTES_PER_S + rows / ROWS_PER_S


def cut(conn: AsyncConnection) -> None:
    """Shut the connection's socket down under whatever is waiting on it: the wait sees end-of-file and fails
    at once (psycopg's own cancellation would ask the server, which does not answer, for up to 10 s more)."""
    try:
        sock = socket.socket(fileno=os.dup(conn.pgconn.socket))
    except (OSError, psycopg.Error):  # already closed
        return
    with sock, contextlib.suppress(OSError):  # closes the duplicate only: psycopg closes the connection's own
        sock.shutdown(socket.SHUT_RDWR)


class NoAnswer(Exception):
    """A bounded call passed its bound (`within`)."""


_LEFT_BEHIND: set[asyncio.Future] = set()  # calls still ending after their bound passed and their socket was cut


async def within(bound_s: float, run: Callable[[list[AsyncConnection]], Awaitable[T]]) -> T:
    """`run(held)` as a task given `bound_s`; `run` keeps the connection it uses in `held`. Past the bound, that
    connection is cut or, while it holds none (pool wait or connect: nothing waits on the server), the task is
    cancelled; `NoAnswer` is raised either way, and a call not ended `CUT_GRACE_S` later is left behind. The
    caller's own cancellation cuts and cancels the same way."""
    held: list[AsyncConnection] = []
    task = asyncio.ensure_future(run(held))
    try:
        done, _ = await asyncio.wait({task}, timeout=bound_s)
    except asyncio.CancelledError:
        for conn in held:
            cut(conn)
        task.cancel()
        raise
    if done:
        return task.result()
    for conn in held:
        cut(conn)
    if not held:
        task.cancel()
    await asyncio.wait({task}, timeout=CUT_GRACE_S)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its error is seen, never "unretrieved"
    if not task.done():
        task.cancel()
        _LEFT_BEHIND.add(task)
        task.add_done_callback(_LEFT_BEHIND.discard)
    raise NoAnswer(f"no answer within {bound_s:g} s")


class PgCalls:
    """The store's way to the database: a pool, a breaker, and `tx`, the one way a call runs."""

    def __init__(self, url: str) -> None:
        self.conninfo = with_timeouts(url)
        self.breaker = CircuitBreaker()
        self._pool = self._new_pool()
        self._closing: set[asyncio.Task] = set()  # old pools being closed after a recovery
        self._down_since, self._refused = 0.0, 0  # when the outage being logged began (0: up), calls refused in it

    def _new_pool(self) -> AsyncConnectionPool:
        return AsyncConnectionPool(
            self.conninfo, min_size=1, max_size=POOL_MAX, open=False, timeout=CALL_BOUND_S, name="batchserve-jobs"
        )

    @classmethod
    async def open(cls, url: str, first: Callable[[AsyncConnection], Awaitable[None]]) -> PgCalls:
        """`first(conn)` in one transaction on a plain connection, then the pool: a database that is down or refuses
        us fails at once with the server's own words (`StoreUnavailable`); the pool would retry quietly."""

        async def once(held: list[AsyncConnection]) -> None:
            async with await AsyncConnection.connect(with_timeouts(url)) as conn:
                held.append(conn)
                async with conn.transaction():
                    await first(conn)

        try:
            await within(OPEN_TIMEOUT_S, once)
        except psycopg.Error as exc:
            raise StoreUnavailable(str(exc).strip() or type(exc).__name__) from None
        except NoAnswer as exc:
            raise StoreUnavailable(f"the PostgreSQL job store: {exc}") from None
        calls = cls(url)
        try:
            await calls._pool.open(wait=True, timeout=OPEN_TIMEOUT_S)
        except PoolTimeout as exc:
            await calls._pool.close()
            raise StoreUnavailable(str(exc)) from None
        return calls

    async def tx(self, fn: Callable[[AsyncConnection], Awaitable[T]], bound_s: float = CALL_BOUND_S) -> T:
        """Run `fn` in one transaction within `bound_s`; a deadlock or serialization failure runs it again (it wrote
        nothing). `StoreDown` while the breaker is open, or when the database is unreachable (which opens it)."""
        try:
            probe = self.breaker.before()
        except StoreDown:
            self._refused += 1
            raise
        deadline = time.monotonic() + bound_s
        try:
            result = await within(bound_s, lambda held: self._attempts(fn, probe, held, deadline))
        except NoAnswer as exc:
            raise self._unreachable(str(exc)) from None
        except (PoolTimeout, psycopg.OperationalError, psycopg.InterfaceError) as exc:
            raise self._unreachable((str(exc).strip() or type(exc).__name__).splitlines()[0]) from None
        except psycopg.Error as exc:  # the database answered (a constraint, a trigger): it is up
            self._reachable()
            raise StoreUnavailable(f"the PostgreSQL job store failed: {exc}") from None
        except (StoreUnavailable, IdempotencyConflict, FileLimitReached):
            self._reachable()  # it answered (a conflict, a limit, a deadlock three times)
            raise
        else:
            self._reachable()
            return result
        finally:
            if probe:
                self.breaker.abandon_probe()  # no-op once a verdict was given

    async def rows(self, sql: str, args: Any = None, bound_s: float = CALL_BOUND_S) -> list[Any]:
        """One query in a transaction of its own (`tx`): its rows."""

        async def tx(conn: AsyncConnection) -> list[Any]:
            return await (await conn.execute(sql, args)).fetchall()

        return await self.tx(tx, bound_s)

    async def change(self, sql: str, args: Any, bound_s: float = CALL_BOUND_S) -> int:
        """One statement in a transaction of its own (`tx`): how many rows it changed."""

        async def tx(conn: AsyncConnection) -> int:
            return (await conn.execute(sql, args)).rowcount

        return await self.tx(tx, bound_s)

    async def _attempts(
        self, fn: Callable[[AsyncConnection], Awaitable[T]], probe: bool, held: list[AsyncConnection], deadline: float
    ) -> T:
        if probe:
            await self._reopen(deadline)
        for attempt in range(TX_ATTEMPTS):
            conn = await self._pool.getconn(timeout=max(0.001, deadline - time.monotonic()))
            held.append(conn)
            try:
                async with conn.transaction():
                    return await fn(conn)
            except (errors.DeadlockDetected, errors.SerializationFailure):
                if attempt == TX_ATTEMPTS - 1:
                    raise StoreUnavailable("the job store kept deadlocking; try again") from None
                await asyncio.sleep(random.uniform(0.005, 0.05) * (attempt + 1))
            finally:  # out of `held` first: `within` must never cut a connection the pool may hand to another call
                held.clear()
                await self._pool.putconn(conn)
        raise AssertionError("unreachable")

    def _unreachable(self, reason: str) -> StoreDown:
        """Open the breaker (one log line as the outage begins, none for the calls that fail during it)."""
        was_up = self.breaker.closed
        self.breaker.failure(reason)
        if was_up:
            self._down_since, self._refused = time.monotonic(), 0
            log.warning(
                "job store down: %s; /v1/batches answers 503 JOBS_UNAVAILABLE and a fresh connection is "
                "tried once a second",
                reason,
            )
        return StoreDown(f"the job store is unreachable ({reason}); tried again every {self.breaker.open_s:g} s")

    def _reachable(self) -> None:
        was_down = not self.breaker.closed
        self.breaker.success()
        if was_down and self._down_since:
            log.warning(
                "job store back up after %.1f s down (%d store calls refused meanwhile)",
                time.monotonic() - self._down_since,
                self._refused,
            )
            self._down_since = 0.0

    async def _reopen(self, deadline: float) -> None:
        """The probe after an outage: one fresh connection, then a fresh pool in place of the old. Failures raise
        psycopg's errors, which `tx` turns into a verdict."""
        conn = await AsyncConnection.connect(self.conninfo)
        await conn.close()
        pool = self._new_pool()
        try:
            await pool.open(wait=True, timeout=max(0.001, deadline - time.monotonic()))
        except BaseException:
            await pool.close(timeout=0)
            raise
        old, self._pool = self._pool, pool
        task = asyncio.create_task(old.close(timeout=1.0))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        await self._pool.close()
        if self._closing:  # an old pool closing under a stopped server gives up on its own, in a second
            await asyncio.gather(*self._closing, return_exceptions=True)
