"""`/v1/batches`: submit a batch job, follow it, read its results in input order, cancel it, list your jobs.

Every route is a declaration on the one request path (`route`). A caller only ever sees its own jobs (another
tenant's job id answers 404, as an unknown one does). A job is validated whole before anything is stored, so a limit
breached by any item refuses the job (400/413) and no partial job exists.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import sqlite3
import time
from typing import Any, Protocol, TypeVar
from collections.abc import Awaitable, Callable, Mapping

import orjson
from starlette.routing import Route

from batchserve import errors
from batchserve.backends import Backend
from batchserve.config import Settings
from batchserve.http.model_choice import ModelRegistry, EMBEDDING, pick_model
from batchserve.errors import ApiError
from batchserve.generation.complete import model_aliases
from batchserve.decoding.engine import Engine
from batchserve.http.dialects import NATIVE_ANY_KEY
from batchserve.http.endpoint import COUNTED, Answer, Call, Endpoint, Stream, json_answer
from batchserve.http.guards import Guard, Caller
from batchserve.http.plumbing import ascii_count
from batchserve.jobs.parse import MAX_METADATA_BYTES, read_job_body
from batchserve.jobs.lines import EMBEDDINGS, GENERATION, INFERENCE
from batchserve.jobs.files import StorageFull
from batchserve.jobs.openai_batch import InputCheck, batch_object, check_batch_request, expires_s
from batchserve.jobs.pages import pages
from batchserve.jobs.service import JobService
from batchserve.jobs.store import (
    ACTIVE,
    FileGone,
    IdempotencyConflict,
    Job,
    JobStore,
    NewJob,
    Progress,
    StoreDown,
    StoreUnavailable,
    UnstorableInput,
)

log = logging.getLogger("batchserve.jobs")

MAX_IDEMPOTENCY_KEY = 255
IDEMPOTENCY_KEY = b"idempotency-key"  # the header a job's creator may send, read by the skeleton
LIST_DEFAULT, LIST_MAX = 20, 100
T = TypeVar("T")


class JobsHost(Protocol):
    """What the job and file routes read from `app.state.rt` (the runtime, which app.py wires): this much only."""

    settings: Settings
    guard: Guard
    registry: ModelRegistry
    backends: dict[str, Backend]
    jobs: JobService | None  # None until the workers are up
    generation: Engine | None  # for OpenAI batches of chat lines

    @property
    def draining(self) -> bool: ...


Handler = Callable[[Call, JobsHost, JobService, Caller], Awaitable[Answer | Stream]]


def service(rt: JobsHost, call: Call, body: bytes) -> JobService:
    """The job service, or why there is none (404 when jobs are off, 503 while the store opens)."""
    if not rt.settings.jobs_db:
        raise errors.not_found("batch jobs are disabled on this server (--jobs-db is empty)")
    if rt.jobs is None:
        raise errors.warming_up()
    return rt.jobs


def route(handler: Handler) -> Endpoint[JobsHost, JobService, Answer | Stream]:
    """A job or file route on the one request path (`http/endpoint.py`: caller identified, one rate token taken,
    native errors); any key is anonymous with no keys configured, as OpenAI's clients always send one. Its body is
    read as it streams in by its own parser (`parse.py`, `upload.py`): a job or a file may exceed any request body.
    The job store's own failures are said as the ApiErrors they are to the caller."""

    async def handle(rt: JobsHost, call: Call, svc: JobService) -> Answer | Stream:
        try:
            return await handler(call, rt, svc, call.who)
        except StorageFull as full:
            raise (
                errors.overloaded(full.message, 60_000) if full.server else errors.payload_too_large(full.message)
            ) from None
        except StoreDown as exc:  # refused by the breaker in microseconds: the outage was logged once already
            raise errors.jobs_unavailable(str(exc), 1000) from None
        except (sqlite3.Error, StoreUnavailable) as exc:
            log.error("job store error: %s", exc)  # no traceback: an outage would write one per request
            raise errors.jobs_unavailable(  # no store text to the caller: it may name paths
                f"the job store failed on this request ({type(exc).__name__}; the server log says more)", 1000
            ) from None

    return Endpoint(NATIVE_ANY_KEY, service, handle, as_is, book=COUNTED, body=False, headers=(IDEMPOTENCY_KEY,))


def as_is(rt: JobsHost, call: Call, svc: JobService, answer: Answer | Stream) -> Answer | Stream:
    return answer


# -- POST /v1/batches ----------------------------------------------------------------------------------------
def idempotency_key(call: Call) -> str | None:
    key = call.headers.get("idempotency-key")
    if key is not None and (not key or len(key) > MAX_IDEMPOTENCY_KEY or not key.isprintable()):
        raise errors.invalid(f"Idempotency-Key must be 1..{MAX_IDEMPOTENCY_KEY} printable characters")
    return key


async def create_batch(call: Call, rt: JobsHost, svc: JobService, caller: Caller) -> Answer | Stream:
    if rt.draining:
        raise errors.draining()
    key = idempotency_key(call)
    s = rt.settings
    body = await read_job_body(  # a caller gone meanwhile: ClientDisconnect, counted by the skeleton
        call.body(),
        call.headers.get("content-type", ""),
        call.headers.get("content-length"),
        s.jobs_max_body_bytes,
        s.jobs_max_items,
        s.max_input_chars,
    )
    if body.openai:
        return await create_openai_batch(body.values, key, rt, svc, caller)
    inputs, requested, metadata = body.inputs, body.model, check_metadata(body.metadata)
    model = batch_model(rt, INFERENCE, requested, caller)  # as /v1/inference resolves it
    canon = {"inputs": inputs, "model": requested, "metadata": metadata}
    return await stored(caller, svc, model, key, canon, None, inputs=inputs, metadata=metadata)


def check_metadata(metadata: dict | None) -> dict | None:
    if metadata is not None and len(orjson.dumps(metadata)) > MAX_METADATA_BYTES:
        raise errors.payload_too_large(f'"metadata" is over {MAX_METADATA_BYTES} bytes')
    return metadata


async def stored(
    caller: Caller, svc: JobService, model: str, key: str | None, canon: Any, seconds: float | None, **more: Any
) -> Answer | Stream:
    """Store a new job of the caller's (an OpenAI one's file lines copied in the store's transaction), start running
    it (when new), and answer 202 (200 for a repeat of an idempotent one). Its hash is of its body's meaning
    (`canon`), not its bytes: key order and spacing do not make a repeat a different request. It expires `seconds`
    after its creation, else --batches-expire-days after (0: never)."""
    now, days = time.time(), svc.settings.batches_expire_days
    if seconds is None and days > 0:
        seconds = days * 86400
    new = NewJob(
        "batch_" + secrets.token_hex(12),
        caller.owner,
        model,
        idempotency_key=key,
        request_hash=hashlib.sha256(orjson.dumps(canon, option=orjson.OPT_SORT_KEYS)).hexdigest(),
        created_at=now,
        expires_at=now + seconds if seconds is not None else None,
        **more,
    )
    store = await svc.open_store()  # the OpenAI route opened it already: then this is a look-up
    try:
        job, created = await store.create(new)
    except IdempotencyConflict:
        raise errors.conflict("this Idempotency-Key was used before with a different body") from None
    except UnstorableInput as exc:
        raise errors.invalid(str(exc)) from None
    except FileGone:
        raise file_missing(new.source_file or "") from None
    if created:
        svc.metrics.created.inc()
        svc.metrics.progress(Progress(job.id, job.model, job.status, {"pending": job.total}))
        assert svc.scheduler is not None
        svc.scheduler.add(job)
    return json_answer(job_view(job), 202 if created else 200, ((b"location", b"/v1/batches/%s" % job.id.encode()),))


def job_view(job: Job) -> dict[str, Any]:
    """The job in the shape it was created in: OpenAI's batch object, or batchserve's own."""
    return batch_object(job) if job.openai is not None else job.public()


async def create_openai_batch(
    values: dict[str, Any], key: str | None, rt: JobsHost, svc: JobService, caller: Caller
) -> Answer | Stream:
    """OpenAI's `POST /v1/batches`: the input file's lines become the job's items (`openai_batch.py`)."""
    req = check_batch_request(values, rt.generation is not None)
    file_id, endpoint, metadata = req.input_file_id, req.endpoint, check_metadata(req.metadata)
    store = await svc.open_store()
    meta = await store.get_file(caller.owner, file_id)
    if meta is None or meta.purpose != "batch":
        raise file_missing(file_id)
    mine, total = await store.usage(caller.owner)  # refused before the file is read; checked again as it is stored
    store.limits.check(caller.owner, mine, total, meta.bytes, "this batch's copy of its input file")
    parsed = InputCheck(endpoint, rt.settings.jobs_max_items, rt.settings.jobs_max_body_bytes)
    async for chunk in store.file_chunks(caller.owner, file_id):  # one stored chunk at a time, parsed off the loop
        await asyncio.to_thread(parsed.feed, chunk)
    await asyncio.to_thread(parsed.end)
    named = {m for m in parsed.models if m is not None}
    if len(named) > 1:
        raise errors.invalid("the lines name different models; one batch runs on one model")
    model = batch_model(rt, endpoint, next(iter(named), None), caller)
    openai = {"endpoint": endpoint, "input_file_id": file_id, "completion_window": req.completion_window}
    canon = {"openai": openai, "metadata": metadata}
    return await stored(
        caller,
        svc,
        model,
        key,
        canon,
        expires_s(req),
        inputs=[],
        metadata=metadata,
        openai=openai,
        source_file=file_id,
        total=parsed.lines,
        input_bytes=parsed.nbytes,
    )


def batch_model(rt: JobsHost, endpoint: str, requested: str | None, caller: Caller) -> str:
    """The model a batch runs on: the generation model for chat and completions lines, else the one its lines name
    (an embeddings batch naming none: the first embedder), as the online route picks it (`pick_model`)."""
    sticky = caller.key_id or caller.tenant
    if endpoint in GENERATION:
        assert rt.generation is not None  # checked by check_batch_request
        if requested is not None and requested not in model_aliases(rt.settings, rt.generation):
            raise errors.model_not_found(requested)
        return rt.generation.cfg.model_id
    if endpoint == EMBEDDINGS:
        return pick_model(rt, EMBEDDING, requested, sticky)[0]
    spec = rt.registry.resolve(requested, sticky)
    if spec is None:
        raise errors.model_not_found(requested)
    return spec.id


def file_missing(file_id: str) -> ApiError:
    return ApiError(
        404, "FILE_NOT_FOUND", f"no file {errors.short(file_id)!r} with purpose 'batch' (upload it with POST /v1/files)"
    )


# -- reads and cancel ----------------------------------------------------------------------------------------
Act = Callable[[JobStore, str, str], Awaitable[Job | None]]  # (store, tenant, job id): the job, None: no such job


async def found_job(
    call: Call, svc: JobService, caller: Caller, act: Act = lambda store, tenant, job_id: store.get(tenant, job_id)
) -> tuple[JobStore, Job]:
    """The job the path names, of this caller, with its store, after `act` on it (default: read it); 404 when
    there is none."""
    job_id = call.path("batch_id")
    store = await svc.existing_store()
    job = await act(store, caller.owner, job_id) if store is not None else None
    if job is None or store is None:
        raise errors.batch_not_found(job_id)
    return store, job


async def get_batch(call: Call, rt: JobsHost, svc: JobService, caller: Caller) -> Answer | Stream:
    return json_answer(job_view((await found_job(call, svc, caller))[1]))


async def batch_results(call: Call, rt: JobsHost, svc: JobService, caller: Caller) -> Answer | Stream:
    store, job = await found_job(call, svc, caller)
    return Stream(pages(store, job.id, lambda row: orjson.dumps(row.public()) + b"\n"), media=b"application/x-ndjson")


async def cancel_batch(call: Call, rt: JobsHost, svc: JobService, caller: Caller) -> Answer | Stream:
    _, job = await found_job(call, svc, caller, lambda store, tenant, job_id: store.cancel(tenant, job_id, time.time()))
    if svc.scheduler is not None:
        svc.scheduler.cancel(job.id)
    svc.metrics.progress(Progress(job.id, job.model, job.status, {}))  # a cancelled job leaves the gauges
    return json_answer(job_view(job))


async def delete_batch(call: Call, rt: JobsHost, svc: JobService, caller: Caller) -> Answer | Stream:
    """Delete a finished job with its items and output and error files (frees its bytes at once)."""
    _, job = await found_job(call, svc, caller, lambda store, tenant, job_id: store.delete_job(tenant, job_id))
    if job.status in ACTIVE:
        raise errors.conflict(
            f"batch {job.id} is still {job.status}; cancel it first (POST /v1/batches/{job.id}/cancel)"
        )
    return json_answer({"id": job.id, "object": "batch", "deleted": True})


async def listed(
    call: Call,
    svc: JobService,
    fetch: Callable[[JobStore, int, Mapping[str, str]], Awaitable[list[T]]],
    view: Callable[[T], dict[str, Any]],
) -> Answer:
    """A page of the caller's jobs or files, in OpenAI's shape: `fetch(store, n, query)` reads `n` of them."""
    query = call.query()
    limit = ascii_count(query.get("limit", str(LIST_DEFAULT)), LIST_MAX)
    if limit is None or not 1 <= limit <= LIST_MAX:
        raise errors.invalid(f"limit must be an integer in [1, {LIST_MAX}]")
    store = await svc.existing_store()
    found = await fetch(store, limit + 1, query) if store is not None else []
    data = [view(x) for x in found[:limit]]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    page = {"object": "list", "data": data, "has_more": len(found) > limit, "first_id": first, "last_id": last}
    return json_answer(page)


async def list_batches(call: Call, rt: JobsHost, svc: JobService, caller: Caller) -> Answer | Stream:
    return await listed(
        call, svc, lambda store, n, query: store.list_jobs(caller.owner, n, query.get("after")), job_view
    )


ROUTES = [
    Route("/v1/batches", route(create_batch), methods=["POST"]),
    Route("/v1/batches", route(list_batches), methods=["GET"]),
    Route("/v1/batches/{batch_id}", route(get_batch), methods=["GET"]),
    Route("/v1/batches/{batch_id}", route(delete_batch), methods=["DELETE"]),
    Route("/v1/batches/{batch_id}/results", route(batch_results), methods=["GET"]),
    Route("/v1/batches/{batch_id}/cancel", route(cancel_batch), methods=["POST"]),
]
