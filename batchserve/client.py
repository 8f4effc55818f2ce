"""A small Python client for batchserve's own routes: `/v1/inference`, `/v1/embeddings` and the native batch
jobs (`/v1/batches`), sync (`Client`) and async (`AsyncClient`), on httpx.

Why: every caller otherwise writes the same retry loop by hand. The server says when a retry can help (503, 429)
and how long to wait (`retry_after_ms`, or `Retry-After`); the client waits that long and retries within `Retry`.
A refused connection (a node restarting) is retried the same way: the request never reached a server. Any other
error raises `BatchserveError`.

    from batchserve.client import Client
    with Client("http://127.0.0.1:8000") as bs:
        print(bs.infer("E equals ")["output"])
        job = bs.wait_job(bs.submit_job(["a", "b"])["id"])
        print(bs.job_results(job["id"]))
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from collections.abc import Awaitable, Callable, Iterable, Mapping

import httpx

H = TypeVar("H", httpx.Client, httpx.AsyncClient)  # the connection pool of a client: sync or async
# What a call gives (`_Connected`): the answer, or its awaitable.
Obj = TypeVar("Obj")
Rows = TypeVar("Rows")
Vectors = TypeVar("Vectors")

RETRY_STATUSES = frozenset({429, 503})
MAX_MESSAGE_CHARS = 2000  # of a server's error message kept in the raised error (a proxy may send megabytes)
JOB_DONE = frozenset({"completed", "failed", "cancelled"})


@dataclass(frozen=True)
class Retry:
    """How long to keep trying. `attempts` counts every try (1 = never retry); without a server hint the wait
    doubles from `backoff_s` up to `max_wait_s`; a hint is honoured plus up to `jitter` of it (so a crowd told the
    same wait does not come back in one burst), but never below `min_wait_s` doubled at each try (a hint of 0
    would otherwise spend every try in milliseconds). A wait past `deadline_s` is not taken: the error is raised."""

    attempts: int = 8
    deadline_s: float = 60.0
    backoff_s: float = 0.1
    max_wait_s: float = 10.0
    jitter: float = 0.1
    min_wait_s: float = 0.05


class BatchserveError(Exception):
    """A refusal or failure as the server described it ({"error", "message", "request_id"}), or a connection
    that failed (status 0, error "CONNECTION_FAILED")."""

    def __init__(
        self, status: int, error: str, message: str, request_id: str = "", retry_after_ms: float | None = None
    ) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            message = f"{message[:MAX_MESSAGE_CHARS]}... ({len(message) - MAX_MESSAGE_CHARS} more characters)"
        said = f"{status} {error}" if status else error  # status 0: no answer, so no status to show
        super().__init__(f"{said}: {message}" + (f" (request {request_id})" if request_id else ""))
        self.status, self.error, self.message = status, error, message
        self.request_id, self.retry_after_ms = request_id, retry_after_ms


def error_of(response: httpx.Response) -> BatchserveError:
    """The server's JSON error, or a stand-in for a body that is not one (a proxy's HTML 502)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        hint = body.get("retry_after_ms")
        return BatchserveError(
            response.status_code,
            body["error"],
            str(body.get("message", "")),
            str(body.get("request_id", "")),
            hint if isinstance(hint, (int, float)) and not isinstance(hint, bool) else None,
        )
    if isinstance(body, dict) and isinstance(body.get("error"), dict):  # the OpenAI-shaped routes
        err = body["error"]
        return BatchserveError(
            response.status_code, str(err.get("code") or err.get("type")), str(err.get("message", ""))
        )
    return BatchserveError(response.status_code, f"HTTP_{response.status_code}", response.text[:200])


def server_wait_s(response: httpx.Response) -> float | None:
    """The wait the server asked for: `retry_after_ms` in the body, else the `Retry-After` header (seconds)."""
    hint = error_of(response).retry_after_ms
    if hint is not None:
        if isinstance(hint, int) and abs(hint) > 10**300:  # JSON allows 10**400: past float, and any deadline
            return math.inf if hint > 0 else 0.0
        wait = hint / 1000
    else:
        try:
            wait = float(response.headers.get("Retry-After", ""))
        except ValueError:
            return None
    return None if math.isnan(wait) else max(0.0, wait)  # negative: 0 (`next_wait_s` floors it); NaN: no hint


def next_wait_s(
    policy: Retry, attempt: int, hint_s: float | None, remaining_s: float, rand: Callable[[], float] = random.random
) -> float | None:
    """Seconds to wait before try `attempt + 1` (attempt counts from 1), or None to give up: tries used up, or
    the wait would end past the deadline."""
    if attempt >= policy.attempts:
        return None
    doubling = 2 ** min(attempt - 1, 64)
    if hint_s is None or not hint_s >= 0:  # no hint, or one that is not a number
        wait = min(policy.max_wait_s, policy.backoff_s * doubling) * (0.5 + rand() / 2)
    else:
        wait = hint_s * (1 + policy.jitter * rand())
    wait = max(wait, min(policy.max_wait_s, policy.min_wait_s * doubling))
    return wait if wait < remaining_s else None


def _raise_for(response: httpx.Response) -> httpx.Response:
    if response.status_code >= 400:
        raise error_of(response)
    return response


def _given(**fields: object) -> dict:
    """A JSON body of the fields that are not None (the server's default holds for the rest)."""
    return {name: value for name, value in fields.items() if value is not None}


def _ndjson(answer: httpx.Response) -> list[dict]:
    return [json.loads(line) for line in answer.text.splitlines() if line.strip()]


@dataclass
class _Tries:
    """The retry bookkeeping both clients share."""

    retry: Retry
    on_retry: Callable[[int, float, BatchserveError], None] | None
    began: float = field(default_factory=time.monotonic)
    attempt: int = 0

    def wait_after(self, failed: httpx.Response | httpx.ConnectError) -> float:
        """Seconds to wait before trying again after `failed` (a retryable answer, or no connection); raises
        its BatchserveError when no retry is left within the deadline."""
        self.attempt += 1
        if isinstance(failed, httpx.ConnectError):
            try:
                url = str(failed.request.url)
            except RuntimeError:  # an error raised without its request
                url = "the server"
            err = BatchserveError(
                0,
                "CONNECTION_FAILED",
                f"could not connect to {url} ({failed}; {self.attempt} tr{'y' if self.attempt == 1 else 'ies'})",
            )
            hint = None
        else:
            err, hint = error_of(failed), server_wait_s(failed)
        wait = next_wait_s(self.retry, self.attempt, hint, self.retry.deadline_s - (time.monotonic() - self.began))
        if wait is None:
            raise err
        if self.on_retry is not None:
            self.on_retry(self.attempt, wait, err)
        return wait


def _vectors(answer: httpx.Response) -> list[list[float]]:
    """An embeddings answer's vectors, in input order."""
    return [item["embedding"] for item in sorted(answer.json()["data"], key=lambda item: item["index"])]


def _job_done(timeout_s: float | None, on_progress: Callable[[dict], None] | None) -> Callable[[dict], bool]:
    """`wait_job`'s test of each polled job: whether it is done; TimeoutError once `timeout_s` has passed."""
    give_up = time.monotonic() + (math.inf if timeout_s is None else timeout_s)

    def done(job: dict) -> bool:
        if on_progress is not None:
            on_progress(job)
        if job["status"] in JOB_DONE:
            return True
        if time.monotonic() > give_up:
            raise TimeoutError(f"job {job['id']} still {job['status']} after {timeout_s} s")
        return False

    return done


class _Connected(Generic[H, Obj, Rows, Vectors]):
    """What both clients hold: one connection pool (`http`, of `pool`'s kind), the retry policy and its hook, and
    the calls, each written once: `_call` sends one and reads its answer, at once (`Client`) or awaited
    (`AsyncClient`), so a call gives `Obj`, `Rows` or `Vectors`: the value, or its awaitable."""

    pool: Callable[..., H]

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        retry: Retry = Retry(),
        timeout_s: float = 120.0,
        on_retry: Callable[[int, float, BatchserveError], None] | None = None,
    ) -> None:
        self.retry, self.on_retry = retry, on_retry
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http: H = type(self).pool(base_url=base_url, headers=headers, timeout=timeout_s)

    def _call(self, read: Callable[[httpx.Response], Any], method: str, path: str, **kw: Any) -> Any:
        raise NotImplementedError

    def infer(self, text: str, model: str | None = None, timeout_ms: int | None = None) -> Obj:
        """`POST /v1/inference`: {"output", "model", "latency_ms", "queue_ms", "compute_ms", ...}."""
        body = _given(input=text, model=model or None, timeout_ms=timeout_ms)
        return self._call(httpx.Response.json, "POST", "/v1/inference", json=body)

    def embed(self, inputs: str | list[str], model: str) -> Vectors:
        """`POST /v1/embeddings`: one vector per input, in input order."""
        return self._call(_vectors, "POST", "/v1/embeddings", json={"input": inputs, "model": model})

    def submit_job(
        self,
        inputs: Iterable[str],
        model: str | None = None,
        metadata: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
    ) -> Obj:
        """`POST /v1/batches`: the job as stored (durable before this returns). With `idempotency_key`, a retry
        of a submit whose answer was lost returns the same job."""
        body = _given(inputs=list(inputs), model=model or None, metadata=dict(metadata) if metadata else None)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._call(httpx.Response.json, "POST", "/v1/batches", json=body, headers=headers)

    def get_job(self, job_id: str) -> Obj:
        return self._call(httpx.Response.json, "GET", f"/v1/batches/{job_id}")

    def job_results(self, job_id: str) -> Rows:
        """Every item in input order: {"index", "status", "output"} or {"index", "status", "error"}."""
        return self._call(_ndjson, "GET", f"/v1/batches/{job_id}/results")

    def cancel_job(self, job_id: str) -> Obj:
        return self._call(httpx.Response.json, "POST", f"/v1/batches/{job_id}/cancel")


class Client(_Connected[httpx.Client, dict, list[dict], list[list[float]]]):
    """Sync client; one connection pool, reuse it (a `with` block closes it). `on_retry(attempt, wait_s,
    error)` is told about every retry (for logs or tests)."""

    pool = httpx.Client

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One call, retried while the server says a retry can help; the 2xx response, else BatchserveError."""
        tries = _Tries(self.retry, self.on_retry)
        while True:
            try:
                response: httpx.Response | httpx.ConnectError = self.http.request(method, path, **kw)
            except httpx.ConnectError as exc:
                response = exc
            if isinstance(response, httpx.Response) and response.status_code not in RETRY_STATUSES:
                return _raise_for(response)
            time.sleep(tries.wait_after(response))

    def _call(self, read: Callable[[httpx.Response], Any], method: str, path: str, **kw: Any) -> Any:
        return read(self.request(method, path, **kw))

    def wait_job(
        self,
        job_id: str,
        poll_s: float = 0.5,
        timeout_s: float | None = None,
        on_progress: Callable[[dict], None] | None = None,
    ) -> dict:
        """Poll until the job is completed, failed or cancelled; `on_progress(job)` after every poll."""
        done = _job_done(timeout_s, on_progress)
        while not done(job := self.get_job(job_id)):
            time.sleep(poll_s)
        return job


class AsyncClient(_Connected[httpx.AsyncClient, Awaitable[dict], Awaitable[list[dict]], Awaitable[list[list[float]]]]):
    """The same calls as `Client`, for asyncio code (`async with AsyncClient(...) as bs`)."""

    pool = httpx.AsyncClient

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        tries = _Tries(self.retry, self.on_retry)
        while True:
            try:
                response: httpx.Response | httpx.ConnectError = await self.http.request(method, path, **kw)
            except httpx.ConnectError as exc:
                response = exc
            if isinstance(response, httpx.Response) and response.status_code not in RETRY_STATUSES:
                return _raise_for(response)
            await asyncio.sleep(tries.wait_after(response))

    async def _call(self, read: Callable[[httpx.Response], Any], method: str, path: str, **kw: Any) -> Any:
        return read(await self.request(method, path, **kw))

    async def wait_job(
        self,
        job_id: str,
        poll_s: float = 0.5,
        timeout_s: float | None = None,
        on_progress: Callable[[dict], None] | None = None,
    ) -> dict:
        done = _job_done(timeout_s, on_progress)
        while not done(job := await self.get_job(job_id)):
            await asyncio.sleep(poll_s)
        return job


__all__ = ["AsyncClient", "BatchserveError", "Client", "Retry"]
