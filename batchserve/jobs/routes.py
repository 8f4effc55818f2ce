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
from typing import Any, Protocol
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
from batchserve.jobs.lines import EMBEDDINGS, GENERATION
from batchserve.jobs.files import StorageFull
from batchserve.jobs.openai_batch import InputCheck, batch_object, check_batch_request, expires_s
from batchserve.jobs.pages import pages
from batchserve.jobs.service import JobService
from batchserve.jobs.store import (
    ACTIVE,
    FileGone,
    IdempotencyConflict,
    ItemRow,
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


def store_errors(handler: Handler) -> Callable[[JobsHost, Call, JobService], Awaitable[Answer | Stream]]:
    """The handler, with the job store's own failures said as the ApiErrors they are to the caller."""

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

    return handle


def as_is(rt: JobsHost, call: Call, svc: JobService, answer: Answer | Stream) -> Answer | Stream:
    return answer


def route(handler: Handler) -> Endpoint[JobsHost, JobService, Answer | Stream]:
    """A job or file route on the one request path (`http/endpoint.py`: caller identified, one rate token taken,
    native errors); any key is anonymous with no keys configured, as OpenAI's clients always send one. Its body is
    read as it streams in by its own parser (`parse.py`, `upload.py`): a job or a file may exceed any request body."""
    return Endpoint(
        NATIVE_ANY_KEY, service, store_errors(handler), as_is, book=COUNTED, body=False, headers=(IDEMPOTENCY_KEY,)
    )


# -- POST /v1/batches ----------------------------------------------------------------------------------------
def idempotency_key(call: Call) -> str | None:
    key = call.headers.get("idempotency-key")
    if key is None:
        return None
    if not key or len(key) > MAX_IDEMPOTENCY_KEY or not key.isprintable():
        raise errors.invalid(f"Idempotency-Key must be 1..{MAX_IDEMPOTENCY_KEY} printable characters")
    return key


def request_hash(inputs: list[str], model: str | None, metadata: dict | None) -> str:
    """The body's meaning, not its bytes: key order and spacing do not make a repeat a different request."""
    canon = orjson.dumps({"inputs": inputs, "model": model, "metadata": metadata}, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(canon).hexdigest()


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
    spec = rt.registry.resolve(requested, caller.key_id or caller.tenant)
    if spec is None:
        raise errors.model_not_found(requested)
    store = await svc.open_store()
    now = time.time()
    new = NewJob(
        "batch_" + secrets.token_hex(12),
        caller.owner,
        spec.id,
        inputs,
        metadata,
        key,
        request_hash(inputs, requested, metadata),
        now,
        expires_at=expiry(now, None, s.batches_expire_days),
    )
    return await stored(svc, store, new)


def check_metadata(metadata: dict | None) -> dict | None:
    if metadata is not None and len(orjson.dumps(metadata)) > MAX_METADATA_BYTES:
        raise errors.payload_too_large(f'"metadata" is over {MAX_METADATA_BYTES} bytes')
    return metadata


def expiry(now: float, seconds: float | None, default_days: float) -> float | None:
    """When a job (anchored at its creation) expires: `seconds` after, else the server's default (0: never)."""
    if seconds is not None:
        return now + seconds
    return now + default_days * 86400 if default_days > 0 else None


async def stored(svc: JobService, store: JobStore, new: NewJob) -> Answer | Stream:
    """Store the job (an OpenAI one's file lines copied in the store's transaction), start running it (when new),
    and answer 202 (200 for a repeat of an idempotent one)."""
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
    canon = orjson.dumps({"openai": openai, "metadata": metadata}, option=orjson.OPT_SORT_KEYS)
    now = time.time()
    new = NewJob(
        "batch_" + secrets.token_hex(12),
        caller.owner,
        model,
        [],
        metadata,
        key,
        hashlib.sha256(canon).hexdigest(),
        now,
        openai,
        source_file=file_id,
        total=parsed.lines,
        input_bytes=parsed.nbytes,
        expires_at=expiry(now, expires_s(req), rt.settings.batches_expire_days),
    )
    return await stored(svc, store, new)


def batch_model(rt: JobsHost, endpoint: str, requested: str | None, caller: Caller) -> str:
    """The model an OpenAI batch runs on: the generation model for chat and completions lines, else the one its
    lines name (an embeddings batch naming none: the first embedder), as the online route picks it (`pick_model`)."""
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
async def found_job(call: Call, svc: JobService, caller: Caller) -> tuple[JobStore, Job]:
    """The job the path names, of this caller, with its store; 404 when there is none."""
    job_id = call.path("batch_id")
    store = await svc.existing_store()
    job = await store.get(caller.owner, job_id) if store is not None else None
    if job is None or store is None:
        raise errors.batch_not_found(job_id)
    return store, job


async def get_batch(call: Call, rt: JobsHost, svc: JobService, caller: Caller) -> Answer | Stream:
    return json_answer(job_view((await found_job(call, svc, caller))[1]))


async def batch_results(call: Call, rt: JobsHost, svc: JobService, caller: Caller) -> Answer | Stream:
    store, job = await found_job(call, svc, caller)
    return Stream(pages(store, job.id, ndjson_line), media=b"application/x-ndjson")


def ndjson_line(row: ItemRow) -> bytes:
    return orjson.dumps(row.public()) + b"\n"


async def cancel_batch(call: Call, rt: JobsHost, svc: JobService, caller: Caller) -> Answer | Stream:
    job_id = call.path("batch_id")
    store = await svc.existing_store()
    job = await store.cancel(caller.owner, job_id, time.time()) if store is not None else None
    if job is None:
        raise errors.batch_not_found(job_id)
    if svc.scheduler is not None:
        svc.scheduler.cancel(job_id)
    svc.metrics.progress(Progress(job.id, job.model, job.status, {}))  # a cancelled job leaves the gauges
    return json_answer(job_view(job))


async def delete_batch(call: Call, rt: JobsHost, svc: JobService, caller: Caller) -> Answer | Stream:
    """Delete a finished job with its items and output and error files (frees its bytes at once)."""
    job_id = call.path("batch_id")
    store = await svc.existing_store()
    job = await store.delete_job(caller.owner, job_id) if store is not None else None
    if job is None:
        raise errors.batch_not_found(job_id)
    if job.status in ACTIVE:
        raise errors.conflict(
            f"batch {job_id} is still {job.status}; cancel it first (POST /v1/batches/{job_id}/cancel)"
        )
    return json_answer({"id": job_id, "object": "batch", "deleted": True})


def list_limit(query: Mapping[str, str], default: int, most: int) -> int:
    limit = ascii_count(query.get("limit", str(default)), most)
    if limit is None or not 1 <= limit <= most:
        raise errors.invalid(f"limit must be an integer in [1, {most}]")
    return limit


async def list_batches(call: Call, rt: JobsHost, svc: JobService, caller: Caller) -> Answer | Stream:
    query = call.query()
    limit, after = list_limit(query, LIST_DEFAULT, LIST_MAX), query.get("after")
    store = await svc.existing_store()
    jobs = await store.list_jobs(caller.owner, limit + 1, after) if store is not None else []
    return list_answer([job_view(j) for j in jobs[:limit]], len(jobs) > limit)


def list_answer(data: list[dict[str, Any]], has_more: bool) -> Answer:
    """A page of a list, in OpenAI's shape."""
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return json_answer({"object": "list", "data": data, "has_more": has_more, "first_id": first, "last_id": last})


ROUTES = [
    Route("/v1/batches", route(create_batch), methods=["POST"]),
    Route("/v1/batches", route(list_batches), methods=["GET"]),
    Route("/v1/batches/{batch_id}", route(get_batch), methods=["GET"]),
    Route("/v1/batches/{batch_id}", route(delete_batch), methods=["DELETE"]),
    Route("/v1/batches/{batch_id}/results", route(batch_results), methods=["GET"]),
    Route("/v1/batches/{batch_id}/cancel", route(cancel_batch), methods=["POST"]),
]
