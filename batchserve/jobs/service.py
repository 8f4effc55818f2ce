"""Batch jobs as one object the runtime starts and stops: the store, the scheduler and their metrics.

`--jobs-db` is a SQLite file (one node) or a `postgresql://` URL (one store shared by many nodes). The SQLite
file is created by the first job, not at start-up, so a server that never sees a job leaves no file behind;
when the file exists at start-up, its unfinished jobs resume at once. A PostgreSQL store is opened at start-up,
since other nodes may have jobs waiting there. A store that cannot be opened (another process holds the file,
a bad path, the database is down) makes `/v1/batches` answer 503 with the reason, and is tried again on the
next request: interactive serving never depends on it.

It also owns what bounds storage: the store's byte limits (`--tenant-storage-mb`, `--storage-max-mb`), the
cap on uploads in progress (`upload.UploadGate`), and the sweep that deletes expired files and finished jobs
every `--storage-sweep-s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from batchserve import errors
from batchserve.config import Settings
from batchserve.errors import ApiError
from batchserve.decoding.engine import Engine
from batchserve.jobs.breaker import CircuitBreaker
from batchserve.jobs.files import StorageLimits
from batchserve.jobs.lines import LineRunner, TokenCounter
from batchserve.jobs.metrics import JobMetrics
from batchserve.jobs.scheduler import Door, Scheduler
from batchserve.jobs.sqlite_store import SQLiteStore, StoreBusy
from batchserve.jobs.store import JobStore, StoreUnavailable, is_postgres_url, redact_url
from batchserve.jobs.upload import UploadGate

log = logging.getLogger("batchserve.jobs")


@dataclass(eq=False)
class JobService:
    door: Door
    settings: Settings
    metrics: JobMetrics
    store: JobStore | None = None
    scheduler: Scheduler | None = None
    problem: str = ""  # why the store could not be opened, for the 503
    count_tokens: TokenCounter = lambda model, texts: 0  # usage of OpenAI embeddings lines
    generation: Engine | None = None  # runs OpenAI chat and completions lines, when generation is on
    uploads: UploadGate = field(default_factory=lambda: UploadGate(0, 0))
    _sweeper: asyncio.Task | None = None
    _opening: asyncio.Lock = field(default_factory=asyncio.Lock)
    # PostgreSQL: after a failed open, the next try waits a second; the requests meanwhile get the 503 at once
    # instead of queueing on `_opening` behind one connect attempt each (the database may be down for minutes).
    # A SQLite file is tried again on every request (opening it is local and quick: a repair shows at once).
    _open_breaker: CircuitBreaker = field(default_factory=CircuitBreaker)

    @classmethod
    async def start(
        cls,
        door: Door,
        settings: Settings,
        registry: CollectorRegistry,
        count_tokens: TokenCounter,
        generation: Engine | None = None,
    ) -> JobService:
        svc = cls(
            door,
            settings,
            JobMetrics.create(registry),
            count_tokens=count_tokens,
            generation=generation,
            uploads=UploadGate(settings.files_max_uploads, settings.files_max_uploads_per_tenant),
        )
        with contextlib.suppress(ApiError):  # logged; the routes answer 503 and try again
            await svc.existing_store()  # one that exists: its unfinished jobs resume now
        return svc

    @property
    def path(self) -> str:
        return self.settings.jobs_db

    async def existing_store(self) -> JobStore | None:
        """The store for reads: None while no job was ever stored here (so every job id is unknown)."""
        if self.store is None and (is_postgres_url(self.path) or os.path.exists(self.path)):
            return await self.open_store()
        return self.store

    async def open_store(self) -> JobStore:
        """The store, opening (and creating) it on first use."""
        if self.store is not None:
            return self.store
        if self._opening.locked() and self.problem and is_postgres_url(self.path):  # another one is trying now
            raise self._unavailable()
        async with self._opening:
            if self.store is None:
                try:
                    if is_postgres_url(self.path):
                        self._open_breaker.before()
                except StoreUnavailable:
                    raise self._unavailable() from None
                try:
                    store, scheduler = await self._open()
                except (StoreBusy, StoreUnavailable, sqlite3.Error, OSError, ImportError) as exc:
                    problem = f"the job store {redact_url(self.path)} cannot be opened: {exc}"
                    if problem != self.problem:  # once per outage (and reason), not once per try
                        log.error("%s (tried again at most once a second)", problem)
                    self.problem = problem
                    self._open_breaker.failure(self.problem)
                    raise self._unavailable() from None
                self._open_breaker.success()
                self.store, self.scheduler, self.problem = store, scheduler, ""
                self._sweeper = asyncio.create_task(self._sweep_loop(), name="jobs-sweep")
                where = redact_url(self.path) if is_postgres_url(self.path) else os.path.abspath(self.path)
                log.info("batch jobs stored in %s", where)
        assert self.store is not None
        return self.store

    async def _open(self) -> tuple[JobStore, Scheduler]:
        """The store, with its bounds, and its scheduler resuming the unfinished jobs."""
        store: JobStore
        if not is_postgres_url(self.path):
            store = await SQLiteStore.open(self.path)
        else:
            try:
                from batchserve.jobs.pg_store import PostgresStore
            except ImportError as exc:
                raise ImportError(
                    f"{exc}; a postgresql:// job store needs pip install 'batchserve[postgres]'"
                ) from None
            store = await PostgresStore.open(self.path)
        mb, s = 1_000_000, self.settings
        store.limits = StorageLimits(
            int(s.tenant_storage_mb * mb),
            int(s.storage_max_mb * mb),
            {t: int(v * mb) for t, v in s.tenant_storage_mb_by_tenant.items()},
        )
        lines = LineRunner(self.door, self.settings, self.count_tokens, self.generation)
        try:
            scheduler = Scheduler(store, self.door, self.settings, self.metrics, lines)
            await scheduler.start()
        except BaseException:
            await store.close()
            raise
        return store, scheduler

    async def _sweep_loop(self) -> None:
        """Delete expired files and finished jobs past their expiry, now and every --storage-sweep-s."""
        while self.store is not None:
            try:
                files, jobs = await self.store.sweep(time.time())
                if files or jobs:
                    log.info("storage sweep: deleted %d expired file(s) and %d expired batch job(s)", files, jobs)
            except Exception as exc:  # noqa: BLE001 - a store outage: the next sweep tries again
                log.warning("storage sweep failed: %s", exc)
            await asyncio.sleep(self.settings.storage_sweep_s)

    def _unavailable(self) -> ApiError:
        # The caller learns that the store is down, not where it lives or what it said (a file path, a host):
        # the log has `self.problem` in full.
        return errors.jobs_unavailable("the job store cannot be opened now (the server log says why)")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        if self.scheduler is not None:
            await self.scheduler.stop()
        if self.store is not None:
            await self.store.close()
            self.store = None
