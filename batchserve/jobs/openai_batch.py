"""OpenAI's Batch API on the job store: reading an input file into job items, and writing a job back as
OpenAI's batch object and its output and error files.

An input file is JSONL, one request per line: `{"custom_id", "method": "POST", "url", "body"}`. It is checked
whole when the batch is created (a line that is not such an object, a repeated custom_id, a url other than
the batch's endpoint: 400 naming the line, and no job is stored). Each line becomes one job item holding
`{"custom_id", "body"}`; what is in the body is checked when the line runs, by the online route's own parser,
so a bad body becomes that line's 400 in the error file, as OpenAI does.

Output and error files are never stored: `file-<batch id>-output` and `file-<batch id>-errors` are rendered
from the job's items, in input order, when read. A line is in the output file when its response was 2xx,
else in the error file (with its `response`, or with `error` alone when it never ran: cancelled).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from batchserve import errors
from batchserve.jobs.lines import GENERATION, RUNNABLE, line_inputs
from batchserve.jobs.store import ItemRow, Job

ENDPOINTS = ("/v1/embeddings", "/v1/chat/completions", "/v1/completions", "/v1/inference")
COMPLETION_WINDOWS = ("24h",)
MAX_CUSTOM_ID = 512
OUTPUT, ERRORS = "-output", "-errors"
STATUS = {"queued": "in_progress", "running": "in_progress", "completed": "completed",
          "failed": "completed",  # every line failed: the batch itself completed, its error file says why
          "cancelled": "cancelled"}


@dataclass(slots=True)
class InputFile:
    items: list[str]  # per line: {"custom_id", "body"} as JSON text
    models: set[str | None]  # the body models named (None: a line named none)
    inputs: int = 0  # the inputs the lines hold (`lines.line_inputs`): what --jobs-max-items bounds


def parse_input_file(content: bytes, endpoint: str, max_inputs: int) -> InputFile:
    """The file's lines as job items, or 400 naming the first line that is not a request for `endpoint`, or
    the line whose inputs bring the file past `max_inputs` (--jobs-max-items counts inputs, not lines: an
    embeddings line with a list of 2,048 inputs counts 2,048)."""
    items: list[str] = []
    models: set[str | None] = set()
    seen: set[str] = set()
    inputs = 0
    for n, raw in enumerate(content.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise errors.invalid(f"line {n} of the input file is not JSON: {errors.short(str(exc))}") from None
        if not isinstance(line, dict):
            raise errors.invalid(f"line {n} of the input file must be a JSON object")
        custom_id = line.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
            raise errors.invalid(f"line {n}: 'custom_id' must be a string of 1 to {MAX_CUSTOM_ID} characters")
        if custom_id in seen:
            raise errors.invalid(f"line {n}: the custom_id {errors.short(custom_id)!r} appears twice")
        seen.add(custom_id)
        if line.get("method", "POST") != "POST":
            raise errors.invalid(f"line {n}: 'method' must be POST")
        if line.get("url") != endpoint:
            raise errors.invalid(f"line {n}: 'url' is {errors.short(line.get('url'))!r}, but the batch's endpoint "
                                 f"is {endpoint}; every line must name it")
        body = line.get("body")
        if not isinstance(body, dict):
            raise errors.invalid(f"line {n}: 'body' must be a JSON object")
        inputs += line_inputs(endpoint, body)
        if inputs > max_inputs:
            raise errors.invalid(f"the input file holds more than {max_inputs} inputs: line {n} brings them to "
                                 f"{inputs}; a batch takes at most {max_inputs} inputs (--jobs-max-items), each "
                                 f"item of an 'input' list counting as one")
        model = body.get("model")
        models.add(model if isinstance(model, str) and model else None)
        items.append(orjson.dumps({"custom_id": custom_id, "body": body}).decode())  # no raw NUL: escaped
    if not items:
        raise errors.invalid("the input file holds no requests")
    return InputFile(items, models, inputs)


def check_batch_request(values: dict[str, Any], generating: bool) -> tuple[str, str, str, dict | None]:
    """(input_file_id, endpoint, completion_window, metadata) of a `POST /v1/batches` in OpenAI's shape.
    `generating`: the generation engine is on here, so chat and completions lines can run."""
    file_id, endpoint = values.get("input_file_id"), values.get("endpoint")
    window, metadata = values.get("completion_window", "24h"), values.get("metadata")
    if not isinstance(file_id, str) or not file_id:
        raise errors.invalid("'input_file_id' must be the id of a file uploaded with purpose 'batch'")
    if endpoint not in ENDPOINTS:
        raise errors.invalid(f"'endpoint' must be one of {', '.join(ENDPOINTS)}")
    if endpoint in GENERATION and not generating:
        raise errors.invalid(f"batches for {endpoint} run on the generation engine, which is off on this server "
                             f"(start it with --backend smollm2 or --generation on); batch {' or '.join(RUNNABLE)}")
    if window not in COMPLETION_WINDOWS:
        raise errors.invalid(f"'completion_window' must be one of {', '.join(COMPLETION_WINDOWS)}")
    if metadata is not None and (not isinstance(metadata, dict)
                                 or not all(isinstance(v, str) for v in metadata.values())):
        raise errors.invalid("'metadata' must be an object of strings")
    return file_id, endpoint, window, metadata


def output_file_id(job_id: str, kind: str) -> str:
    return f"file-{job_id}{kind}"


def job_of_file(file_id: str) -> tuple[str, str] | None:
    """(job id, OUTPUT or ERRORS) for the id of a job's output or error file; None for any other id."""
    for kind in (OUTPUT, ERRORS):
        if file_id.startswith("file-batch_") and file_id.endswith(kind):
            return file_id[len("file-"):-len(kind)], kind
    return None


def batch_object(job: Job) -> dict[str, Any]:
    """The job as OpenAI's batch object."""
    o = job.openai or {}
    final = job.status not in ("queued", "running")
    errored = job.failed + job.cancelled
    created = int(job.created_at)
    return {
        "id": job.id, "object": "batch", "endpoint": o.get("endpoint"), "errors": None,
        "input_file_id": o.get("input_file_id"), "completion_window": o.get("completion_window"),
        "status": STATUS[job.status],
        "output_file_id": output_file_id(job.id, OUTPUT) if final and job.completed else None,
        "error_file_id": output_file_id(job.id, ERRORS) if final and errored else None,
        "created_at": created, "in_progress_at": _int(job.started_at) or created,
        "expires_at": created + 24 * 3600, "finalizing_at": None,
        "completed_at": _int(job.finished_at) if job.status in ("completed", "failed") else None,
        "failed_at": None, "expired_at": None,
        "cancelling_at": _int(job.finished_at) if job.status == "cancelled" else None,
        "cancelled_at": _int(job.finished_at) if job.status == "cancelled" else None,
        "request_counts": {"total": job.total, "completed": job.completed, "failed": errored},
        "metadata": job.metadata, "model": job.model,
    }


def _int(t: float | None) -> int | None:
    return int(t) if t is not None else None


def file_line(job_id: str, row: ItemRow, kind: str) -> bytes | None:
    """The row's line in the job's output (`OUTPUT`) or error (`ERRORS`) file, or None when it is not in it."""
    if row.status == "pending" or (row.status == "completed") != (kind == OUTPUT):
        return None
    assert row.input is not None
    custom_id = orjson.loads(row.input)["custom_id"]
    line: dict[str, Any] = {"id": f"batch_req_{job_id.removeprefix('batch_')}_{row.index}",
                            "custom_id": custom_id, "response": None, "error": None}
    if row.output is not None:
        line["response"] = orjson.Fragment(row.output)
    else:
        line["error"] = {"code": (row.error or "failed").lower(), "message": row.message}
    return orjson.dumps(line) + b"\n"
