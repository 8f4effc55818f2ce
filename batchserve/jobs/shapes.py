"""The declared shapes of `/v1/batches` and `/v1/files` (`jobs/routes.py`, `jobs/file_routes.py`) and their
operations in /openapi.json. A job body is not decoded whole: `parse.py` streams it with ijson and checks each
value as it arrives (a body of megabytes must not hold the event loop), so `BatchRequest` declares what that
parser accepts; OpenAI's batch body is converted from the streamed values into `OpenAIBatchRequest`
(`openai_batch.py`)."""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

from msgspec import UNSET, Meta, Struct, UnsetType

from batchserve.http.openapi import DocAnswer, Operation, Param, one_of
from batchserve.http.shapes import NATIVE, NonNegative

Epoch = Annotated[float, Meta(description="seconds since the epoch")]
MAX_EXPIRY_S = 2592000
MAX_CUSTOM_ID = 512
Body = TypeVar("Body")


class BatchRequest(Struct):
    """batchserve's own job body."""

    inputs: Annotated[
        list[Annotated[str, Meta(min_length=1)]],
        Meta(
            min_length=1,
            description="at most --jobs-max-items (400 beyond); each at most --max-input-chars (413 beyond)",
        ),
    ]
    model: Annotated[
        Annotated[str, Meta(min_length=1)] | None,
        Meta(description="as for /v1/inference; resolved once, so the whole job runs on one version"),
    ] = None
    metadata: Annotated[
        dict[str, Any] | None, Meta(description="kept with the job and returned as given (16 KiB max)")
    ] = None


class ExpiresAfter(Struct):
    anchor: Literal["created_at"]
    seconds: Annotated[int, Meta(ge=1, le=MAX_EXPIRY_S)]


class OpenAIBatchRequest(Struct):
    """OpenAI's Batch API (told apart from BatchRequest by input_file_id)."""

    input_file_id: Annotated[str, Meta(min_length=1, description="a file uploaded with POST /v1/files, purpose batch")]
    endpoint: Annotated[
        Literal["/v1/embeddings", "/v1/inference", "/v1/chat/completions", "/v1/completions"],
        Meta(description="the route each line is sent to; chat and completions need the generation engine on"),
    ]
    completion_window: Literal["24h"] = "24h"
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | UnsetType = UNSET


class BatchInputLine(Struct, Generic[Body]):
    """One line of an OpenAI batch input file (JSONL), decoded line by line. `Body`: what the reader needs of
    the body: the whole object when the file is checked (`openai_batch.InputCheck`: the models named, the inputs
    counted), or its raw JSON when the line runs (`lines.LineRunner`), where the target route's own parse decodes
    it (so a bad body is that line's 400 in the error file, as OpenAI does)."""

    custom_id: Annotated[str, Meta(min_length=1, max_length=MAX_CUSTOM_ID)]
    url: Annotated[str, Meta(description="the batch's endpoint, on every line")]
    body: Body
    method: Literal["POST"] = "POST"


class BatchJob(Struct):
    id: Annotated[str, Meta(pattern="^batch_")]
    object: Literal["batch"]
    status: Annotated[
        Literal["queued", "running", "completed", "failed", "cancelled"],
        Meta(description="completed: every item is final and at least one completed; failed: every item failed"),
    ]
    model: Annotated[str, Meta(description="name@version running the job")]
    total: Annotated[int, Meta(ge=1)]
    completed: NonNegative
    failed: NonNegative
    cancelled: NonNegative
    pending: NonNegative
    created_at: Epoch
    started_at: float | None = None
    finished_at: float | None = None
    metadata: dict[str, Any] | None = None
    bytes: Annotated[
        int, Meta(ge=0, description="what the job keeps (inputs and outputs), counted against --tenant-storage-mb")
    ] = 0
    expires_at: Annotated[float | None, Meta(description="deleted after this once finished")] = None
    reason: Annotated[str, Meta(description="why the job failed whole (a storage quota)")] = ""


class RequestCounts(Struct):
    total: int
    completed: int
    failed: int


class OpenAIBatch(Struct):
    """OpenAI's batch object, for a job created with input_file_id."""

    id: Annotated[str, Meta(pattern="^batch_")]
    object: Literal["batch"]
    endpoint: str
    input_file_id: str
    completion_window: str
    status: Annotated[
        Literal["in_progress", "completed", "cancelled", "failed"],
        Meta(description="failed: its outputs would have passed a storage quota (see errors)"),
    ]
    created_at: int
    request_counts: RequestCounts
    errors: dict[str, Any] | None = None
    output_expires_at: int | None = None
    output_file_id: Annotated[str | None, Meta(description="the 2xx lines, once finished")] = None
    error_file_id: Annotated[str | None, Meta(description="the other lines, once finished")] = None
    metadata: dict[str, Any] | None = None


AnyBatch = Annotated[Any, one_of(BatchJob, OpenAIBatch, description="a job in the shape it was created in")]


class BatchDeleted(Struct):
    id: str
    object: Literal["batch"]
    deleted: Literal[True]


class BatchJobList(Struct):
    object: Literal["list"]
    data: list[AnyBatch]
    has_more: bool
    last_id: Annotated[str | None, Meta(description="pass as ?after= for the next page")] = None


class LineError(Struct):
    error: str
    message: str


class BatchResultLine(Struct):
    """One line of the NDJSON results, in input order."""

    index: NonNegative
    status: Literal["completed", "failed", "pending", "cancelled"]
    output: Annotated[
        Any, Meta(description="when completed: the backend's output, any JSON value (as on /v1/inference)")
    ] = None
    error: Annotated[LineError, Meta(description="when failed or cancelled")] | UnsetType = UNSET


class File(Struct):
    id: Annotated[str, Meta(pattern="^file-")]
    object: Literal["file"]
    bytes: NonNegative
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"] | UnsetType = UNSET
    expires_at: int | None = None


class FileList(Struct):
    object: Literal["list"]
    data: list[File]
    has_more: bool
    first_id: str | None = None
    last_id: Annotated[str | None, Meta(description="pass as ?after= for the next page")] = None


class FileDeleted(Struct):
    id: str
    object: Literal["file"]
    deleted: Literal[True]


class FileUpload(Struct, rename={"anchor": "expires_after[anchor]", "seconds": "expires_after[seconds]"}):
    """A multipart form: the JSONL file and its purpose."""

    file: Annotated[
        bytes,
        Meta(
            description="at most --files-max-bytes (413 beyond), streamed into the store; 413 past the caller's "
            "--tenant-storage-mb"
        ),
    ]
    purpose: Literal["batch"]
    anchor: Literal["created_at"] | UnsetType = UNSET
    seconds: Annotated[int, Meta(ge=1, le=MAX_EXPIRY_S)] | UnsetType = UNSET


ALSO_DOCUMENTED = (BatchJob, OpenAIBatch, BatchRequest, OpenAIBatchRequest)  # named only through one_of

_BATCH_ID = Param("batch_id", "path")
_FILE_ID = Param("file_id", "path")
_LIMIT = Param("limit", "query", Annotated[int, Meta(ge=1, le=100)], "at most this many (default 20)")
# Every job and file route: 401 and 429 (the skeleton), 404 with --jobs-db empty (jobs off) or an unknown id,
# 503 while the store opens or when it fails (JOBS_UNAVAILABLE).
_JOB_ERRORS = (401, 404, 429, 503)


def _op(method: str, path: str, op_id: str, summary: str, *answers: DocAnswer, **kw: Any) -> Operation:
    """An operation on the jobs' routes; one on the job or file its path names takes that id."""
    kw.setdefault("errors", _JOB_ERRORS)
    kw.setdefault("params", (_BATCH_ID,) if "{batch_id}" in path else (_FILE_ID,) if "{file_id}" in path else ())
    return Operation(method, path, op_id, summary, answers, NATIVE, **kw)


OPERATIONS = (
    _op(
        "POST",
        "/v1/batches",
        "createBatch",
        "Submit a batch job: stored durably (all items) before the answer, run from spare capacity",
        DocAnswer(202, "the new job", AnyBatch),
        DocAnswer(200, "the job created earlier with this Idempotency-Key", AnyBatch),
        request=Annotated[
            Any, one_of(BatchRequest, OpenAIBatchRequest), Meta(examples=[{"inputs": ["a", "b"], "model": "sim"}])
        ],
        errors=(400, 409, 413, *_JOB_ERRORS),
        params=(
            Param(
                "Idempotency-Key",
                "header",
                Annotated[str, Meta(max_length=255)],
                "a repeat with the same key and body returns the same job (200); the same key with another body "
                "gets 409",
            ),
        ),
    ),
    _op(
        "GET",
        "/v1/batches",
        "listBatches",
        "The caller's jobs, newest first",
        DocAnswer(200, "the caller's jobs", BatchJobList),
        errors=(400, *_JOB_ERRORS),
        params=(_LIMIT, Param("after", "query", str, "a job id: list the jobs older than it")),
    ),
    _op("GET", "/v1/batches/{batch_id}", "getBatch", "A job's status and counts", DocAnswer(200, "the job", AnyBatch)),
    _op(
        "DELETE",
        "/v1/batches/{batch_id}",
        "deleteBatch",
        "Delete a finished job with its items and output and error files (frees its bytes)",
        DocAnswer(200, "deleted", BatchDeleted),
        errors=(409, *_JOB_ERRORS),
    ),
    _op(
        "GET",
        "/v1/batches/{batch_id}/results",
        "batchResults",
        "One NDJSON line per item, in input order",
        DocAnswer(200, "NDJSON, one BatchResultLine per line", BatchResultLine, media="application/x-ndjson"),
    ),
    _op(
        "POST",
        "/v1/batches/{batch_id}/cancel",
        "cancelBatch",
        "Cancel the items not yet run (a finished job is returned as it is)",
        DocAnswer(200, "the job after cancelling", AnyBatch),
    ),
    _op(
        "POST",
        "/v1/files",
        "createFile",
        "Upload a JSONL batch input file (multipart: file, purpose=batch), OpenAI's Files API",
        DocAnswer(200, "the stored file", File),
        request=FileUpload,
        request_media="multipart/form-data",
        errors=(400, 409, 413, *_JOB_ERRORS),
    ),
    _op(
        "GET",
        "/v1/files",
        "listFiles",
        "The caller's uploaded files, newest first",
        DocAnswer(200, "the caller's files", FileList),
        errors=(400, *_JOB_ERRORS),
        params=(_LIMIT, Param("after", "query"), Param("purpose", "query")),
    ),
    _op(
        "GET",
        "/v1/files/{file_id}",
        "getFile",
        "A file's metadata (uploads, and finished jobs' output and error files)",
        DocAnswer(200, "the file", File),
    ),
    _op(
        "DELETE",
        "/v1/files/{file_id}",
        "deleteFile",
        "Delete an uploaded file (frees its bytes and a --files-max-count place)",
        DocAnswer(200, "deleted", FileDeleted),
    ),
    _op(
        "GET",
        "/v1/files/{file_id}/content",
        "fileContent",
        "The file's bytes: JSONL",
        DocAnswer(200, "the file", str, media="application/jsonl"),
    ),
)
