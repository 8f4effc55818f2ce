"""`/v1/files`: OpenAI's Files API, for the Batch API's input files and its output and error files.

Uploads are multipart (`file`, `purpose=batch`), read with a byte bound (`--files-max-bytes`, 413 while it
streams in) and stored in the job store (`files.py`), at most `--files-max-count` per caller. The caller is
identified and rate-limited as on `/v1/batches`, and sees only its own files: another tenant's file id answers
404 exactly as an unknown one. A job's output and error files (`openai_batch.py`) are rendered from its items.
"""

from __future__ import annotations

import secrets
import time
from typing import AsyncGenerator

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from batchserve import errors
from batchserve.errors import ApiError
from batchserve.http.body import json_response, read_body
from batchserve.jobs.api import LIST_DEFAULT, LIST_MAX, RESULTS_PAGE, JobsHost, list_limit, route
from batchserve.jobs.files import FileLimitReached, StoredFile
from batchserve.jobs.openai_batch import OUTPUT, file_line, job_of_file
from batchserve.jobs.service import JobService
from batchserve.jobs.store import JobStore
from batchserve.tenancy import Caller

PURPOSES = ("batch",)
MULTIPART_SLACK = 64 << 10  # the form's other fields and part headers, on top of the file itself
MAX_FILENAME = 255


def not_found(file_id: str) -> ApiError:
    return ApiError(404, "FILE_NOT_FOUND", f"no file {errors.short(file_id)!r} (files are visible to their owner only)")


def upload_filename(given: str | None) -> str:
    """The name an upload is stored under: the part's filename cut to MAX_FILENAME, or a refusal (400) for one
    holding a control character. A NUL is refused by PostgreSQL's text type (it was a 503 JOBS_UNAVAILABLE
    with a retry hint and an ERROR line per request), and a newline or escape would reach logs and listings."""
    name = given or "upload.jsonl"
    if any(ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F for ch in name):
        raise errors.invalid("the file's name holds a control character (NUL, newline, ...): rename it")
    return name[:MAX_FILENAME]


async def _one_chunk(body: bytes) -> AsyncGenerator[bytes, None]:  # what MultiPartParser takes
    yield body


async def create_file(request: Request, rt: JobsHost, svc: JobService, caller: Caller) -> Response:
    limit = rt.settings.files_max_bytes
    ctype = request.headers.get("content-type", "")
    if not ctype.lower().startswith("multipart/form-data"):
        raise errors.invalid("upload a file as multipart/form-data with the fields 'file' and 'purpose'")
    try:
        body = await read_body(request, limit + MULTIPART_SLACK)
    except ClientDisconnect:
        return Response(status_code=499)
    try:
        form = await MultiPartParser(request.headers, _one_chunk(body), max_files=1, max_fields=8,
                                     max_part_size=64 << 10).parse()
    except MultiPartException as exc:
        raise errors.invalid(f"the multipart body cannot be read: {exc.message}") from None
    try:
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise errors.invalid("the form has no 'file' part")
        if purpose not in PURPOSES:
            raise errors.invalid(f"'purpose' must be one of {', '.join(PURPOSES)}")
        content = await upload.read()
        filename = upload_filename(upload.filename)
    finally:
        await form.close()
    if len(content) > limit:
        raise errors.payload_too_large(f"the file is over the {limit}-byte limit (--files-max-bytes)")
    if not content.strip():
        raise errors.invalid("the file is empty")
    meta = StoredFile("file-" + secrets.token_hex(12), caller.owner, filename, str(purpose), len(content), time.time())
    store = await svc.open_store()
    try:
        await store.put_file(meta, content, rt.settings.files_max_count)
    except FileLimitReached:
        raise errors.conflict(f"you already keep {rt.settings.files_max_count} files (--files-max-count); "
                              f"DELETE /v1/files/{{id}} the ones you are done with") from None
    return json_response(meta.public())


async def generated(store: JobStore, caller: Caller, file_id: str) -> tuple[StoredFile, bytes] | None:
    """A job's output or error file, rendered from its items (None: no such job of this caller, or not done)."""
    found = job_of_file(file_id)
    if found is None:
        return None
    job_id, kind = found
    job = await store.get(caller.owner, job_id)
    if job is None or job.openai is None or job.status in ("queued", "running"):
        return None
    parts: list[bytes] = []
    after = -1
    while rows := await store.results(job_id, after, RESULTS_PAGE, with_input=True):
        parts += [line for r in rows if (line := file_line(job_id, r, kind)) is not None]
        after = rows[-1].index
    content = b"".join(parts)
    name = f"{job_id}_{'output' if kind == OUTPUT else 'errors'}.jsonl"
    made = job.finished_at or job.created_at
    return StoredFile(file_id, caller.owner, name, "batch_output", len(content), made), content


async def get_file(request: Request, rt: JobsHost, svc: JobService, caller: Caller) -> Response:
    file_id = request.path_params["file_id"]
    store = await svc.existing_store()
    if store is not None:
        meta = await store.get_file(caller.owner, file_id)
        if meta is not None:
            return json_response(meta.public())
        made = await generated(store, caller, file_id)
        if made is not None:
            return json_response(made[0].public())
    raise not_found(file_id)


async def file_content(request: Request, rt: JobsHost, svc: JobService, caller: Caller) -> Response:
    file_id = request.path_params["file_id"]
    store = await svc.existing_store()
    if store is not None:
        content = await store.file_content(caller.owner, file_id)
        if content is None and (made := await generated(store, caller, file_id)) is not None:
            content = made[1]
        if content is not None:
            return Response(content, media_type="application/jsonl")
    raise not_found(file_id)


async def delete_file(request: Request, rt: JobsHost, svc: JobService, caller: Caller) -> Response:
    file_id = request.path_params["file_id"]
    store = await svc.existing_store()
    if store is None or not await store.delete_file(caller.owner, file_id):
        raise not_found(file_id)  # a job's output file goes with its job; it is not deleted alone
    return json_response({"id": file_id, "object": "file", "deleted": True})


async def list_files(request: Request, rt: JobsHost, svc: JobService, caller: Caller) -> Response:
    limit = list_limit(request, LIST_DEFAULT, LIST_MAX)
    after, purpose = request.query_params.get("after"), request.query_params.get("purpose")
    store = await svc.existing_store()
    files = await store.list_files(caller.owner, limit + 1, after, purpose) if store is not None else []
    data = [f.public() for f in files[:limit]]
    return json_response({"object": "list", "data": data, "has_more": len(files) > limit,
                          "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None})


ROUTES = [
    Route("/v1/files", route(create_file), methods=["POST"]),
    Route("/v1/files", route(list_files), methods=["GET"]),
    Route("/v1/files/{file_id}", route(get_file), methods=["GET"]),
    Route("/v1/files/{file_id}", route(delete_file), methods=["DELETE"]),
    Route("/v1/files/{file_id}/content", route(file_content), methods=["GET"]),
]
