"""OpenAI's Batch API on the job store: checking an input file before it becomes job items, and writing a job
back as OpenAI's batch object and its output and error files.

An input file is JSONL, one request per line: `{"custom_id", "method": "POST", "url", "body"}`. It is checked whole
when the batch is created, in one streaming pass (`InputCheck`): a line not in its declared shape
(`shapes.BatchInputLine`), a repeated custom_id, a url other than the batch's endpoint, or a body nested too deep is
a 400 naming the line and the member, and no job is stored. Each non-blank line then becomes one job item as it is
(`NewJob.source_file`); its body is checked when the line runs, by the online route's own parser, so a bad body
becomes that line's 400 in the error file, as OpenAI does.

Output and error files (`file-<batch id>-output`, `file-<batch id>-errors`) are the job's items, written as the
batch runs (their sizes kept on the job row as lines are recorded: `line_size`) and read back in input order a page
at a time. A line is in the output file when its response was 2xx, else in the error file (with its `response`, or
with `error` alone when it never ran: cancelled, or refused because its outputs would pass a storage quota).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson

from batchserve import errors
from batchserve.http.plumbing import NOT_JSON, BodyRefusal, decode, refusal
from batchserve.jobs import shapes
from batchserve.jobs.files import LineSplitter, LineTooLong
from batchserve.jobs.lines import GENERATION, RAW_LINE, RUNNABLE, line_inputs
from batchserve.jobs.shapes import MAX_CUSTOM_ID, MAX_EXPIRY_S
from batchserve.jobs.store import ERRORS, OUTPUT, ItemRow, Job, Outcome

ENDPOINTS = ("/v1/embeddings", "/v1/chat/completions", "/v1/completions", "/v1/inference")
COMPLETION_WINDOWS = ("24h",)
STATUS = {
    "queued": "in_progress",
    "running": "in_progress",
    "completed": "completed",
    "failed": "completed",  # every line failed: the batch itself completed, its error file says why
    "cancelled": "cancelled",
}


@dataclass(eq=False)
class InputCheck:
    """One streaming pass over an input file: `feed` each chunk (on a worker thread: it parses JSON), then `end`.
    Keeps only what the batch needs to know, never the lines."""

    endpoint: str
    max_inputs: int  # --jobs-max-items: inputs, not lines (`lines.line_inputs`)
    max_line_bytes: int
    models: set[str | None] = field(default_factory=set)  # the body models named (None: a line named none)
    lines: int = 0
    nbytes: int = 0  # the lines' bytes: what the batch's copy adds to its tenant's storage
    inputs: int = 0  # the inputs the lines hold
    _seen: set[str] = field(default_factory=set)
    _split: LineSplitter = field(default_factory=LineSplitter)

    def __post_init__(self) -> None:
        self._split = LineSplitter(self.max_line_bytes)

    def feed(self, chunk: bytes) -> None:
        self._check(lambda: self._split.feed(chunk))

    def end(self) -> None:
        self._check(self._split.end)
        if not self.lines:
            raise errors.invalid("the input file holds no requests")

    def _check(self, split: Callable[[], list[bytes]]) -> None:
        try:
            raws = split()
        except LineTooLong:
            raise errors.invalid(
                f"line {self.lines + 1} of the input file is over {self.max_line_bytes} bytes "
                f"(a request is at most --jobs-max-body-bytes)"
            ) from None
        for raw in raws:
            self.lines += 1
            self.nbytes += len(raw)
            self._one(raw, self.lines)

    def _one(self, raw: bytes, n: int) -> None:
        if n > self.max_inputs:
            raise errors.invalid(
                f"the input file has more than {self.max_inputs} requests; a batch takes at most "
                f"{self.max_inputs} inputs (--jobs-max-items)"
            )
        try:
            line = decode(_LINE, raw)
        except BodyRefusal as r:
            raise line_refused(r, n, self.endpoint) from None
        custom_id = line.custom_id
        if custom_id in self._seen:
            raise errors.invalid(f"line {n}: the custom_id {errors.short(custom_id)!r} appears twice")
        self._seen.add(custom_id)
        if line.url != self.endpoint:
            raise errors.invalid(
                f"line {n}: 'url' is {errors.short(line.url)!r}, but the batch's "
                f"endpoint is {self.endpoint}; every line must name it"
            )
        body = line.body
        try:
            # A bound on what a line may hold, said before anything is stored: orjson's 254 levels.
            orjson.dumps(body)
        except TypeError:
            # orjson refuses an integer past 64 bits too: JSON has no such bound, and the route's own parser
            # judges it when the line runs (that line's 400 if its field cannot take it, the others run).
            if depth(body) > MAX_BODY_DEPTH:
                raise errors.invalid(
                    f"line {n}: 'body' is nested too deeply (JSON deeper than {MAX_BODY_DEPTH} levels)"
                ) from None
        self.inputs += line_inputs(self.endpoint, body)
        if self.inputs > self.max_inputs:
            raise errors.invalid(
                f"the input file holds more than {self.max_inputs} inputs: line {n} brings them "
                f"to {self.inputs}; a batch takes at most {self.max_inputs} inputs "
                f"(--jobs-max-items), each item of an 'input' list counting as one"
            )
        model = body.get("model")
        self.models.add(model if isinstance(model, str) and model else None)


MAX_BODY_DEPTH = 254  # containers nested in a line's body (orjson's bound)


def depth(value: object) -> int:
    """How deep containers nest in a decoded JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, level + 1)
            stack.extend((child, level + 1) for child in item)
    return deepest


_LINE = msgspec.json.Decoder(shapes.BatchInputLine[dict[str, Any]])
_LINE_EXPLAINED = {  # what each member of a line must be, said before msgspec's words on what it was
    "custom_id": f"'custom_id' must be a string of 1 to {MAX_CUSTOM_ID} characters",
    "method": "'method' must be POST",
    "body": "'body' must be a JSON object",
}


def line_refused(r: BodyRefusal, n: int, endpoint: str) -> errors.ApiError:
    """The 400 for line `n` of an input file that is not a `shapes.BatchInputLine`, naming the line and the member."""
    if r.not_json:
        why = r.message.removeprefix(NOT_JSON).lstrip(": ")
        return errors.invalid(f"line {n} of the input file is not JSON in UTF-8: {errors.short(why)}")
    if r.field is None:
        return errors.invalid(f"line {n} of the input file must be a JSON object")
    explained = _LINE_EXPLAINED.get(r.field, "")
    if r.field == "url":
        explained = f"'url' must be the batch's endpoint, {endpoint}"
    return errors.invalid(f"line {n}: {explained} ({r.message})" if explained else f"line {n}: {r.message}")


EXPIRES_AFTER = f'{{"anchor": "created_at", "seconds": 1 to {MAX_EXPIRY_S} (30 days)}}'


def check_expires_after(value: object, name: str) -> float | None:
    """Seconds from an `expires_after` in OpenAI's shape, converted to the declared `shapes.ExpiresAfter` (the
    upload's form fields, gathered); None: absent."""
    if value is None:
        return None
    try:
        given = msgspec.convert(value, shapes.ExpiresAfter)
    except msgspec.ValidationError as exc:
        raise errors.invalid(f"'{name}' must be {EXPIRES_AFTER} ({refusal(str(exc)).message})") from None
    return float(given.seconds)


def expires_s(req: shapes.OpenAIBatchRequest) -> float | None:
    """Seconds a batch's output is kept, from its `output_expires_after` (None: the server's default)."""
    given = req.output_expires_after
    return None if given is msgspec.UNSET else float(given.seconds)


_EXPLAINED = {  # what each member must be, said before msgspec's words on what it was
    "input_file_id": "'input_file_id' must be the id of a file uploaded with purpose 'batch'",
    "endpoint": f"'endpoint' must be one of {', '.join(ENDPOINTS)}",
    "completion_window": f"'completion_window' must be one of {', '.join(COMPLETION_WINDOWS)}",
    "metadata": "'metadata' must be an object of strings",
    "output_expires_after": f"'output_expires_after' must be {EXPIRES_AFTER}",
}


def check_batch_request(values: dict[str, Any], generating: bool) -> shapes.OpenAIBatchRequest:
    """A `POST /v1/batches` in OpenAI's shape (`parse.JobBody.values`) as `shapes.OpenAIBatchRequest`, each refusal
    naming the member. `generating`: the generation engine is on here, so chat and completions lines can run."""
    try:
        req = msgspec.convert(values, shapes.OpenAIBatchRequest)
    except msgspec.ValidationError as exc:
        r = refusal(str(exc))
        explained = _EXPLAINED.get(r.field or "")
        raise errors.invalid(f"{explained} ({r.message})" if explained else r.message) from None
    if req.endpoint in GENERATION and not generating:
        raise errors.invalid(
            f"batches for {req.endpoint} run on the generation engine, which is off on this server "
            f"(start it with --backend smollm2 or --generation on); batch {' or '.join(RUNNABLE)}"
        )
    return req


def output_file_id(job_id: str, kind: str) -> str:
    return f"file-{job_id}{kind}"


def job_of_file(file_id: str) -> tuple[str, str] | None:
    """(job id, OUTPUT or ERRORS) for the id of a job's output or error file; None for any other id."""
    for kind in (OUTPUT, ERRORS):
        if file_id.startswith("file-batch_") and file_id.endswith(kind):
            return file_id[len("file-") : -len(kind)], kind
    return None


def batch_object(job: Job) -> dict[str, Any]:
    """The job as OpenAI's batch object."""
    o = job.openai or {}
    final = job.status not in ("queued", "running")
    errored = job.failed + job.cancelled
    created = int(job.created_at)
    failed = job.reason is not None  # failed as a whole (a storage quota), not line by line
    return {
        "id": job.id,
        "object": "batch",
        "endpoint": o.get("endpoint"),
        "errors": {
            "object": "list",
            "data": [{"code": "storage_quota_exceeded", "message": job.reason, "param": None, "line": None}],
        }
        if failed
        else None,
        "input_file_id": o.get("input_file_id"),
        "completion_window": o.get("completion_window"),
        "status": "failed" if failed else STATUS[job.status],
        "output_file_id": output_file_id(job.id, OUTPUT) if final and job.completed else None,
        "error_file_id": output_file_id(job.id, ERRORS) if final and errored else None,
        "created_at": created,
        "in_progress_at": _int(job.started_at) or created,
        "expires_at": created + 24 * 3600,
        "finalizing_at": None,
        "completed_at": _int(job.finished_at) if job.status in ("completed", "failed") and not failed else None,
        "failed_at": _int(job.finished_at) if failed else None,
        "expired_at": None,
        "cancelling_at": _int(job.finished_at) if job.status == "cancelled" else None,
        "cancelled_at": _int(job.finished_at) if job.status == "cancelled" else None,
        "request_counts": {"total": job.total, "completed": job.completed, "failed": errored},
        "metadata": job.metadata,
        "model": job.model,
        "output_expires_at": _int(job.expires_at),
    }


def _int(t: float | None) -> int | None:
    return int(t) if t is not None else None


def file_line(job_id: str, row: ItemRow, kind: str, response: str | None = None) -> bytes | None:
    """The row's line in the job's output (`OUTPUT`) or error (`ERRORS`) file, or None when it is not in it
    (`response`: stands in for the row's output, for `line_size`)."""
    if row.status == "pending" or (row.status == "completed") != (kind == OUTPUT):
        return None
    custom_id = row.custom_id  # read by the store where the input is large
    if custom_id is None:
        assert row.input is not None
        custom_id = RAW_LINE.decode(row.input).custom_id  # its body skipped, not built
    line: dict[str, Any] = {
        "id": f"batch_req_{job_id.removeprefix('batch_')}_{row.index}",
        "custom_id": custom_id,
        "response": None,
        "error": None,
    }
    if row.output is not None:
        line["response"] = orjson.Fragment(response if response is not None else row.output)
    else:
        line["error"] = {"code": (row.error or "failed").lower(), "message": row.message}
    return orjson.dumps(line) + b"\n"


def line_size(job_id: str, row: ItemRow) -> tuple[str, int]:
    """(OUTPUT or ERRORS, bytes) of a final row's line in its job's file, without copying its output: what
    the store adds to the file's size when it records the row."""
    kind = OUTPUT if row.status == "completed" else ERRORS
    line = file_line(job_id, row, kind, response="0")
    assert line is not None
    output = row.output
    extra = 0 if output is None else (len(output) if output.isascii() else len(output.encode())) - 1
    return kind, len(line) + extra


@dataclass(slots=True)
class Sizes:
    """What a store write adds to a job: its items made final, by status, and the bytes kept in all and in its
    OpenAI output and error files."""

    counts: Counter[str] = field(default_factory=Counter)
    stored: int = 0
    output: int = 0
    errors: int = 0

    def add(self, o: Outcome, stored: int, line: str | None) -> None:
        """`o` was written, keeping `stored` bytes; `line`: its item's input, where an OpenAI file holds its line."""
        self.counts[o.status] += 1
        self.stored += stored
        if line is not None:
            kind, size = line_size(o.job_id, ItemRow(o.index, o.status, o.output, o.error, o.message, line))
            if kind == OUTPUT:
                self.output += size
            else:
                self.errors += size

    @classmethod
    def ended(cls, job_id: str, rows: Sequence[Any], status: str, error: str, message: str, openai: bool) -> Sizes:
        """What `end_pending` adds: its `rows` (index, input) made final with this error."""
        if not openai:
            return cls(Counter({status: len(rows)}))
        sizes = cls()
        for idx, text in rows:
            sizes.add(Outcome(job_id, idx, status, None, error, message), 0, text)
        return sizes

    def grows(self) -> tuple[int, int, int, int, int]:
        """What the job row's completed, failed, bytes, output_bytes and error_bytes grow by."""
        return self.counts["completed"], self.counts["failed"], self.stored, self.output, self.errors

    def merge(self, other: Sizes) -> None:
        self.counts.update(other.counts)
        self.stored += other.stored
        self.output += other.output
        self.errors += other.errors
