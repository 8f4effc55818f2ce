"""Running one line of an OpenAI batch input file: the same body the online route would answer, built by the same
code (the embeddings wing's `parse.parse` and `render.answer`, the inference route's `parse_inference`), each input
entering the batcher through the one door (`Door.submit_background`, tier `batch`) as the job scheduler finds room
for it (`LineRun.feed`; a line is priced by the inputs it holds, `line_inputs`, so it never floods the queue).

A line of /v1/chat/completions or /v1/completions runs on the generation engine instead (it batches on its own):
`generation.complete.complete`, the online route's code, at tier `batch` in its tenant's share, so it only fills
capacity interactive callers leave. Refused for capacity, it waits with backoff until the batch's completion window
closes (`window_end`), since the scheduler's few quick retries would fail most lines under load; past the window,
or for any other error, it is raised like a door error.

A line's outcome is OpenAI's `response` object, `{status_code, request_id, body}`. A body the online route would
refuse with a 4xx is answered the same way, at once and for good (running it again cannot help). An error from the
door (deadline, drain, a worker lost; a 500 after bisection) is raised, so the scheduler retries or records it as it
does every job item.
"""

from __future__ import annotations

import asyncio
import random
import secrets
from collections import deque
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, Protocol, TypeVar
from collections.abc import Awaitable, Callable

import msgspec
import orjson

from batchserve.config import Settings
from batchserve.core.fairqueue import Item, ItemResult
from batchserve.core.tiers import BATCH
from batchserve.embeddings.parse import parse as parse_embeddings
from batchserve.embeddings.render import answer as embeddings_answer
from batchserve import errors
from batchserve.errors import ApiError
from batchserve.generation.complete import complete
from batchserve.decoding.engine import Engine
from batchserve.inference.parse import parse_inference
from batchserve.http.dialects import OPENAI

EMBEDDINGS, INFERENCE = "/v1/embeddings", "/v1/inference"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
RUNNABLE = (EMBEDDINGS, INFERENCE)  # endpoints whose lines ride the batcher (see docs/batch-jobs.md)
GENERATION = (CHAT, COMPLETIONS)  # endpoints whose lines run on the generation engine, when it is on

TokenCounter = Callable[[str, list[str]], int]  # (model id, texts) -> prompt tokens (0 when it cannot count)
WINDOW_S = 24 * 3600.0  # OpenAI's one completion window
CAPACITY_BACKOFF_CAP_S = 30.0  # a generation line refused for capacity tries again at least this often
CAPACITY_CODES = ("SERVICE_OVERLOADED", "DEADLINE_EXCEEDED")  # the engine had no room (yet): wait, don't fail


def window_end(created_at: float, openai: dict[str, Any] | None) -> float | None:
    """When an OpenAI batch's completion window closes (seconds since the epoch); None for a native job. Its one
    window is 24h (`shapes.OpenAIBatchRequest.completion_window`)."""
    return created_at + WINDOW_S if openai else None


def capacity_backoff_s(attempt: int, base_s: float, retry_after_ms: int | None, left_s: float) -> float:
    """How long a line refused for capacity waits: exponential with jitter, at least the engine's Retry-After hint,
    never past what is left of the window."""
    delay = min(CAPACITY_BACKOFF_CAP_S, base_s * 2**attempt) * random.uniform(0.5, 1.0)
    if retry_after_ms:
        delay = max(delay, min(CAPACITY_BACKOFF_CAP_S, retry_after_ms / 1000))
    return max(0.0, min(delay, left_s))


class Entrance(Protocol):
    """How job work enters the batcher, through the one door (`core.service.InferenceService`): an input in the
    shared background share, or a group as a batch of its own."""

    def submit_background(self, text: str, model: str, tenant: str, deadline_s: float, alone: bool = False) -> Item: ...
    def submit_group(self, texts: list[str], model: str, tenant: str, deadline_s: float) -> list[Item]: ...


@dataclass(slots=True)
class LineResult:
    """A line's `response` (status, request id, body as JSON text) and, when not 2xx, its error code."""

    status_code: int
    request_id: str
    body: bytes
    error: str | None = None
    message: str | None = None

    def response_json(self) -> str:
        return orjson.dumps(
            {"status_code": self.status_code, "request_id": self.request_id, "body": orjson.Fragment(self.body)}
        ).decode()


@dataclass(eq=False)
class LineRun:
    """One line in flight, fed to the door an input at a time (`feed`). Looks like an `Item` to the scheduler
    (`future`, `dispatched`, `text`); cancelling the future withdraws every input fed and feeds no more. The first
    input that fails fails the line (its other inputs leave the queue)."""

    future: asyncio.Future
    text: str = ""  # the line itself: an isolated job takes back the lines no batch has taken yet
    inputs: int = 0  # what the line holds, its price (0: answered at once, a 4xx)
    items: list[Item] = field(default_factory=list)  # its inputs fed so far, in input order
    pending: deque[str] = field(default_factory=deque)  # its inputs not fed yet
    submit: Callable[[str, bool], Item] | None = None  # one input through the door (`alone`: a batch of its own)
    begin: Callable[[], None] | None = None  # a generation line: starts it on the engine (one input, no Item)
    finish: Callable[[list[ItemResult]], Awaitable[LineResult]] | None = None  # every input answered: the body
    _answered: int = 0
    _task: asyncio.Future | None = None

    def __post_init__(self) -> None:
        self.future.add_done_callback(self._withdraw)

    @property
    def dispatched(self) -> float:
        return max((i.dispatched for i in self.items), default=0.0)

    @property
    def unfed(self) -> int:
        """Inputs still to feed (0 once the line is answered, failed or cancelled)."""
        if self.future.done():
            return 0
        return len(self.pending) + (self.begin is not None)

    def feed(self, alone: bool) -> Item | None:
        """Put the line's next input through the door (None for a generation line, or when nothing is left)."""
        if self.begin is not None:
            begin, self.begin = self.begin, None
            if not self.future.done():
                begin()
            return None
        if not self.pending or self.future.done() or self.submit is None:
            return None
        item = self.submit(self.pending.popleft(), alone)
        self.items.append(item)
        item.future.add_done_callback(self._input_done)
        return item

    def _input_done(self, fut: asyncio.Future) -> None:
        if self.future.done():
            return
        if fut.cancelled():  # withdrawn by someone else (never by the line while it runs): the line goes too
            self.future.cancel()
            return
        exc = fut.exception()
        if exc is not None:
            self.future.set_exception(exc)  # `_withdraw` takes its other inputs out of the queue
            return
        self._answered += 1
        if self._answered == self.inputs and not self.pending and self.finish is not None:
            self.answer_with(self.finish([i.future.result() for i in self.items]))

    def answer_with(self, work: Awaitable[LineResult]) -> None:
        """The line's answer is what `work` ends with, run as a task (cancelled with the line)."""
        self._task = asyncio.ensure_future(work)
        self._task.add_done_callback(self._settle)

    def _settle(self, task: asyncio.Future) -> None:
        if self.future.done():
            return
        if task.cancelled():
            self.future.cancel()
        elif (exc := task.exception()) is not None:
            self.future.set_exception(exc)
        else:
            self.future.set_result(task.result())

    def _withdraw(self, fut: asyncio.Future) -> None:
        self.pending.clear()
        self.begin = None
        for item in self.items:
            if not item.future.done():
                item.future.cancel()
        if fut.cancelled() and self._task is not None:
            self._task.cancel()


def line_inputs(endpoint: str, body: object) -> int:
    """The inputs a line's body holds, its price: each of an `/v1/embeddings` line's `input` list, else one. A body
    its route will refuse still counts what it names, so `--jobs-max-items` bounds what a file may bring."""
    if endpoint == EMBEDDINGS and isinstance(body, dict):
        raw = body.get("input")
        if isinstance(raw, list):
            return max(1, len(raw))
    return 1


Body = TypeVar("Body")


class StoredLine(msgspec.Struct, Generic[Body]):
    """What running a stored line and writing its answer read of it: the line was checked whole
    (`shapes.BatchInputLine`) when its batch was created, and the members not read here are skipped, not built."""

    custom_id: str
    body: Body


class _Input(msgspec.Struct):
    """The one member of a line's body `line_texts` reads."""

    input: Any = None


RAW_LINE = msgspec.json.Decoder(StoredLine[msgspec.Raw])  # the body left as its JSON, for the route's parse
_INPUT_LINE = msgspec.json.Decoder(StoredLine[_Input])


def line_texts(endpoint: str, line: str) -> list[str]:
    """The texts a line will put through the door, read ahead so the tokenizer stage tokenizes them before they are
    fed (`Scheduler._read`); [] for another endpoint's line or one its route will refuse (`start` answers it)."""
    if endpoint not in RUNNABLE:
        return []
    try:
        raw = _INPUT_LINE.decode(line).body.input
    except msgspec.DecodeError:  # ValidationError included
        return []
    if isinstance(raw, str):
        return [raw]
    if endpoint == EMBEDDINGS and isinstance(raw, list):
        return [t for t in raw if isinstance(t, str)]
    return []


def refused(err: ApiError, request_id: str, openai_shape: bool) -> LineResult:
    """A 4xx answer for a line, in the error shape of the endpoint it names (the route's dialect); its code is
    OpenAI's finer one where the error names one (INVALID_VALUE)."""
    if openai_shape:
        body = OPENAI.error_body(err, request_id)
        code = (err.reason or err.code).upper()
    else:
        body = orjson.dumps({"error": err.code, "message": err.message, "request_id": request_id})
        code = err.code
    return LineResult(err.status, request_id, body, code, err.message)


def failed_response(err: ApiError, endpoint: str) -> str:
    """The `response` recorded for a line that failed for good at the door (a 500, or out of retries)."""
    request_id = "req_" + secrets.token_hex(8)
    return refused(err, request_id, endpoint != INFERENCE).response_json()


@dataclass(eq=False)
class LineRunner:
    door: Entrance
    settings: Settings
    count_tokens: TokenCounter
    engine: Engine | None = None  # the generation engine, when it is on: runs chat and completions lines
    clock: Callable[[], float] = time.time  # wall clock: completion windows are stored as epoch seconds
    sleep: Callable[[float], Any] = asyncio.sleep

    def models(self) -> list[str]:
        """The generation model, when it is on: its jobs' lines run here too."""
        return [self.engine.cfg.model_id] if self.engine is not None else []

    def start(
        self, endpoint: str, line: str, model: str, tenant: str, deadline_s: float, expires_at: float | None = None
    ) -> LineRun:
        """Parse the line; its inputs go to the door as the scheduler feeds them, and the run's future resolves to
        its LineResult. A generation line waits for capacity until `expires_at` (default: `deadline_s` from now)."""
        loop = asyncio.get_running_loop()
        request_id = "req_" + secrets.token_hex(8)
        body = bytes(RAW_LINE.decode(line).body)  # the body's own bytes, for the route's parse to decode
        if endpoint in GENERATION:
            until = expires_at if expires_at is not None else self.clock() + deadline_s
            return self._generate(body, endpoint == CHAT, request_id, line, tenant, until)
        try:
            if endpoint == EMBEDDINGS:
                req = parse_embeddings(body, self.settings.max_input_chars, self.settings.max_timeout_ms)
                texts, finish = req.inputs, partial(self._embeddings, model, req.inputs, req.base64, request_id)
            elif endpoint == INFERENCE:
                text, _, _, _ = parse_inference(body, "application/json", self.settings)
                texts, finish = [text], partial(self._inference, model, request_id)
            else:
                raise AssertionError(f"{endpoint} lines are refused when the batch is created")
        except ApiError as err:
            done = loop.create_future()
            done.set_result(refused(err, request_id, endpoint != INFERENCE))
            return LineRun(done, text=line)
        door = self.door

        def submit(text: str, alone: bool) -> Item:
            return door.submit_background(text, model, tenant, deadline_s, alone=alone)

        return LineRun(loop.create_future(), line, len(texts), pending=deque(texts), submit=submit, finish=finish)

    def _generate(self, body: bytes, chat: bool, request_id: str, line: str, tenant: str, until: float) -> LineRun:
        loop = asyncio.get_running_loop()
        run = LineRun(loop.create_future(), text=line, inputs=1)
        engine = self.engine
        if engine is None:  # a job stored while generation was on, read by a node started without it: retried
            run.future.set_exception(
                errors.no_healthy_worker(
                    "generation is off on this node (start it with --backend smollm2 or --generation on)"
                )
            )
            return run

        async def answer() -> LineResult:
            attempt = 0
            while True:
                left_s = until - self.clock()
                try:
                    done = await complete(
                        self.settings, engine, body, chat, BATCH.rank, tenant=tenant, max_wait_s=max(0.0, left_s)
                    )
                    return LineResult(200, request_id, done)
                except ApiError as err:
                    if err.status < 500:  # what the route answers with a 4xx: the line's answer, for good
                        return refused(err, request_id, True)
                    left_s = until - self.clock()
                    if err.code not in CAPACITY_CODES or left_s <= 0:
                        raise
                    await self.sleep(
                        capacity_backoff_s(attempt, self.settings.jobs_retry_base_ms / 1000, err.retry_after_ms, left_s)
                    )
                    attempt += 1

        run.begin = lambda: run.answer_with(answer())  # fed by the scheduler: the line starts on the engine
        return run

    async def _embeddings(
        self, model: str, texts: list[str], as_base64: bool, request_id: str, results: list[ItemResult]
    ) -> LineResult:
        tokens = await asyncio.to_thread(self.count_tokens, model, texts)
        try:
            body = embeddings_answer([r.output for r in results], as_base64, model, tokens)
        except ApiError as err:  # the backend's outputs are not vectors: as the online route, a 500
            return refused(err, request_id, True)
        return LineResult(200, request_id, body)

    async def _inference(self, model: str, request_id: str, results: list[ItemResult]) -> LineResult:
        r = results[0]
        queue_ms, compute_ms = r.queue_s * 1000, r.compute_s * 1000
        body = orjson.dumps(
            {
                "request_id": request_id,
                "output": r.output,
                "model": model,
                "latency_ms": round(queue_ms + compute_ms),
                "queue_ms": round(queue_ms),
                "compute_ms": round(compute_ms),
                "batch_size": r.batch_size,
            }
        )
        return LineResult(200, request_id, body)
