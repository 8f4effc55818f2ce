"""`/v1/files`: OpenAI's Files API, for the Batch API's input files and its output and error files.

Uploads are multipart (`file`, `purpose=batch`, optionally `expires_after[anchor]=created_at` and
`expires_after[seconds]`), parsed as they stream in (`upload.py`) and stored a chunk at a time (`files.py`): 413 past
`--files-max-bytes` (at once for a larger Content-Length), at most `--files-max-count` files per caller, upload places
shared per tenant (`upload.UploadGate`: 429, and 503 past `--files-max-uploads` in all), an upload slower than
`--files-upload-min-kbps` ended (408), and no upload that would pass the caller's byte quota (413). The caller sees
only its own files: another tenant's file id answers 404 exactly as an unknown one. A job's output and error files
(`openai_batch.py`) are its items, read a page bounded in bytes at a time (`pages.py`).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Mapping

from python_multipart.multipart import parse_options_header
from starlette.routing import Route

from batchserve import errors
from batchserve.errors import ApiError
from batchserve.http.endpoint import Answer, Call, Stream, json_answer
from batchserve.http.plumbing import ascii_count
from batchserve.jobs.routes import JobsHost, listed, route
from batchserve.jobs.files import CHUNK_BYTES, FileLimitReached, StoredFile
from batchserve.jobs.openai_batch import check_expires_after, file_line, job_of_file
from batchserve.jobs.pages import pages
from batchserve.jobs.service import JobService
from batchserve.jobs.store import ACTIVE, OUTPUT, Job, JobStore
from batchserve.jobs.upload import FormError, FormStream, UploadPace
from batchserve.http.guards import Caller

PURPOSES = ("batch",)
MULTIPART_SLACK = 64 << 10  # the form's other fields and part headers, on top of the file itself
MAX_FILENAME = 255


def not_found(file_id: str) -> ApiError:
    return ApiError(404, "FILE_NOT_FOUND", f"no file {errors.short(file_id)!r} (files are visible to their owner only)")


def upload_filename(given: str | None) -> str:
    """The part's filename cut to MAX_FILENAME, or a 400 for one holding a control character: PostgreSQL's text
    type refuses a NUL, and a newline or escape would reach logs and listings."""
    name = given or "upload.jsonl"
    if any(ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F for ch in name):
        raise errors.invalid("the file's name holds a control character (NUL, newline, ...): rename it")
    return name[:MAX_FILENAME]


def too_large(limit: int) -> ApiError:
    return errors.payload_too_large(f"the file is over the {limit}-byte limit (--files-max-bytes)")


def boundary_of(content_type: str) -> bytes:
    media, options = parse_options_header(content_type)
    if media != b"multipart/form-data":
        raise errors.invalid("upload a file as multipart/form-data with the fields 'file' and 'purpose'")
    boundary = options.get(b"boundary")
    if not boundary:
        raise errors.invalid("the multipart Content-Type has no boundary")
    return boundary


async def create_file(call: Call, rt: JobsHost, svc: JobService, caller: Caller) -> Answer | Stream:
    limit = rt.settings.files_max_bytes
    boundary = boundary_of(call.headers.get("content-type", ""))
    declared = call.headers.get("content-length")
    if declared is not None:
        size = ascii_count(declared, limit + MULTIPART_SLACK)
        if size is None:
            raise errors.invalid("Content-Length is not a number")
        if size > limit + MULTIPART_SLACK:
            raise too_large(limit)
        # 413 at once where the declared size alone would pass the caller's quota (503: the server's total):
        # refused later, as its bytes arrive, the upload would hold what it stored (and refuse others) until then.
        store = await svc.open_store()
        if size > MULTIPART_SLACK and store.limits.bounded:
            store.limits.check(caller.owner, *await store.usage(caller.owner), size - MULTIPART_SLACK, "this upload")
    svc.uploads.enter(caller.tenant, anonymous=not caller.key_id)
    try:
        return await _receive(call, rt, svc, caller, boundary, limit)
    finally:
        svc.uploads.leave(caller.tenant)


async def _receive(
    call: Call, rt: JobsHost, svc: JobService, caller: Caller, boundary: bytes, limit: int
) -> Answer | Stream:
    store = await svc.open_store()
    now = time.time()
    meta = StoredFile("file-" + secrets.token_hex(12), caller.owner, "upload.jsonl", "batch", 0, now)
    form = FormStream(boundary)
    received, blank, done = 0, True, False
    loop = asyncio.get_running_loop()
    pace = UploadPace(rt.settings.files_upload_min_kbps * 1000, rt.settings.files_upload_grace_s, loop.time())
    stored = StoredChunks(store, meta, form, rt.settings.files_max_count)
    try:
        body = call.body().__aiter__()
        while True:
            try:
                async with asyncio.timeout_at(pace.deadline(received)):
                    data = await anext(body)
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise pace.too_slow(received, loop.time()) from None
            received += len(data)
            if received > limit + MULTIPART_SLACK:
                raise too_large(limit)
            form.feed(data)
            if form.file_bytes > limit:
                raise too_large(limit)
            if len(form.pending) >= CHUNK_BYTES:
                chunk = form.take()
                blank = blank and not chunk.strip()
                await stored.put(chunk)
        form.finish()
        if form.filename is None:
            raise errors.invalid("the form has no 'file' part")
        purpose = check_purpose(form.fields.get("purpose"))
        seconds = expires_after(form.fields, rt.settings.files_expire_days)
        last = form.take()
        if blank and not last.strip():
            raise errors.invalid("the file is empty")
        await stored.put(last)
        meta.filename, meta.purpose, meta.bytes = upload_filename(form.filename), purpose, form.file_bytes
        meta.expires_at = now + seconds if seconds else None
        await store.finish_file(meta)
        done = True
    except FormError as exc:
        raise errors.invalid(f"the multipart body cannot be read: {exc}") from None
    finally:
        if stored.began and not done:
            await asyncio.shield(store.abort_file(meta.id))
    return json_answer(meta.public())


class StoredChunks:
    """An upload's chunks as they are stored, in order; the file row is made with the first chunk, after the
    form's own refusals (its purpose, a control character in its name) and within --files-max-count."""

    def __init__(self, store: JobStore, meta: StoredFile, form: FormStream, max_count: int) -> None:
        self.store, self.meta, self.form, self.max_count = store, meta, form, max_count
        self.seq, self.began = 0, False

    async def put(self, chunk: bytes | bytearray) -> None:
        if not self.began:
            check_purpose(self.form.fields.get("purpose", PURPOSES[0]))
            upload_filename(self.form.filename)
            try:
                await self.store.begin_file(self.meta, self.max_count)
            except FileLimitReached:
                raise errors.conflict(
                    f"you already keep {self.max_count} files (--files-max-count); "
                    f"DELETE /v1/files/{{id}} the ones you are done with"
                ) from None
            self.began = True
        await self.store.put_chunk(self.meta.tenant, self.meta.id, self.seq, chunk)
        self.seq += 1


def check_purpose(purpose: str | None) -> str:
    if purpose not in PURPOSES:
        raise errors.invalid(f"'purpose' must be one of {', '.join(PURPOSES)}")
    return purpose


def expires_after(fields: dict[str, str], default_days: float) -> float | None:
    """Seconds the file is kept: the form's `expires_after` (OpenAI's form fields), else the server's default."""
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return default_days * 86400 if default_days > 0 else None
    count = ascii_count(seconds or "", 1 << 40)
    return check_expires_after({"anchor": anchor, "seconds": count}, "expires_after")


def job_file(job: Job, file_id: str, kind: str) -> StoredFile:
    """A finished job's output or error file, as a file object: its size was kept as its lines were written."""
    name = f"{job.id}_{'output' if kind == OUTPUT else 'errors'}.jsonl"
    size = job.output_bytes if kind == OUTPUT else job.error_bytes
    return StoredFile(
        file_id, job.tenant, name, "batch_output", size, job.finished_at or job.created_at, job.expires_at
    )


async def found_file(
    call: Call, svc: JobService, caller: Caller
) -> tuple[JobStore, StoredFile, tuple[Job, str] | None]:
    """The file the path names, of this caller, with its store: an uploaded one, or a finished job's output or
    error file (then also the job and which file of it); 404 when neither."""
    file_id = call.path("file_id")
    store = await svc.existing_store()
    if store is not None:
        meta = await store.get_file(caller.owner, file_id)
        if meta is not None:
            return store, meta, None
        job_id, kind = job_of_file(file_id) or ("", "")
        job = await store.get(caller.owner, job_id) if job_id else None
        if job is not None and job.openai is not None and job.status not in ACTIVE:  # finished: its file is whole
            return store, job_file(job, file_id, kind), (job, kind)
    raise not_found(file_id)


async def get_file(call: Call, rt: JobsHost, svc: JobService, caller: Caller) -> Answer | Stream:
    return json_answer((await found_file(call, svc, caller))[1].public())


async def file_content(call: Call, rt: JobsHost, svc: JobService, caller: Caller) -> Answer | Stream:
    store, meta, made = await found_file(call, svc, caller)
    if made is None:
        return Stream(store.file_chunks(caller.owner, meta.id), media=b"application/jsonl")
    job, kind = made  # its lines in input order, a page bounded in bytes at a time (`pages.py`)
    return Stream(
        pages(store, job.id, lambda row: file_line(job.id, row, kind), with_input=True), media=b"application/jsonl"
    )


async def delete_file(call: Call, rt: JobsHost, svc: JobService, caller: Caller) -> Answer | Stream:
    file_id = call.path("file_id")
    store = await svc.existing_store()
    if store is None or not await store.delete_file(caller.owner, file_id):
        raise not_found(file_id)  # a job's output file goes with its job; it is not deleted alone
    return json_answer({"id": file_id, "object": "file", "deleted": True})


async def list_files(call: Call, rt: JobsHost, svc: JobService, caller: Caller) -> Answer | Stream:
    def fetch(store: JobStore, n: int, query: Mapping[str, str]) -> Awaitable[list[StoredFile]]:
        return store.list_files(caller.owner, n, query.get("after"), query.get("purpose"))

    return await listed(call, svc, fetch, StoredFile.public)


ROUTES = [
    Route("/v1/files", route(create_file), methods=["POST"]),
    Route("/v1/files", route(list_files), methods=["GET"]),
    Route("/v1/files/{file_id}", route(get_file), methods=["GET"]),
    Route("/v1/files/{file_id}", route(delete_file), methods=["DELETE"]),
    Route("/v1/files/{file_id}/content", route(file_content), methods=["GET"]),
]
