"""The tokenizer stage: a backend that declares `tokenize(texts)` has every input's tokens made here, on a worker
thread, before the door costs it, so the event loop never runs a tokenizer. The backend keeps what it made (by text)
and reads it on the loop to cost and bucket the input (a dictionary look-up) and on the device thread to run it.

The stage runs before admission, so nothing downstream can price its work: it shares itself. Requests wait in one
lane per tenant, and each call takes texts from the tenant charged the fewest characters (a virtual counter, as
`fairqueue.Shares`), up to `CALL_CHARS` characters a call (at least one text). A tenant that starts waiting is lifted
to the least counter waiting, less one call's characters (idle time earns no burst, but a short request that comes
back goes before the next chunk of a tenant that never stops). So a tenant of huge inputs, refused or not, takes the
stage's time only in turn: another tenant's request waits at most about one call. `run` returns what a request cost
here, which the door charges to the tenant in the model's fair queue.

One call's texts go in one batch call of the backend (a fast tokenizer's also leaves the GIL to Rust's threads). A
failure here fails nobody: the backend tokenizes what it lacks where it needs it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

log = logging.getLogger("batchserve")

Tokenize = Callable[[list[str]], None]
CALL_CHARS = 8192  # characters one tokenizer call takes (at least one text): what another tenant waits behind
KEPT_TENANTS = 4096  # counters kept of tenants not waiting; past it, those a return would lift anyway are dropped


@runtime_checkable
class Pretokenizer(Protocol):
    """A backend whose inputs' tokens are made ahead, in the stage (`backends/hf.py`'s models, minilm)."""

    def tokenize(self, texts: list[str]) -> None: ...


@dataclass(eq=False)
class Request:
    """One caller's texts, taken from the front as calls have room; `done` once every one is tokenized."""

    tokenize: Tokenize
    tenant: str
    texts: deque[str]
    done: asyncio.Future[None]
    open: int = 0  # its chunks in calls not finished yet
    seconds: float = 0.0  # its characters' share of those calls' time


@dataclass
class Lanes:
    """The waiting requests, one lane per tenant, and the characters each tenant was charged (module docstring).
    Pure policy: `take` decides a call's texts, nothing here runs a tokenizer."""

    call_chars: int = CALL_CHARS
    charged: dict[str, float] = field(default_factory=dict)  # characters taken per tenant (lifted on joining)
    vtime: float = 0.0  # the counter of the last tenant taken from
    lanes: dict[str, deque[Request]] = field(default_factory=dict)  # tenants with requests waiting
    _heap: list[tuple[float, int, str]] = field(default_factory=list)  # waiting tenants by counter (exact)
    _order: itertools.count = field(default_factory=itertools.count)

    def __bool__(self) -> bool:
        return bool(self.lanes)

    def add(self, request: Request) -> None:
        lane = self.lanes.get(request.tenant)
        if lane is not None:
            lane.append(request)
            return
        floor = (self._heap[0][0] if self._heap else self.vtime) - self.call_chars
        counter = max(self.charged.get(request.tenant, 0.0), floor)
        self.charged[request.tenant] = counter
        self.lanes[request.tenant] = deque([request])
        heapq.heappush(self._heap, (counter, next(self._order), request.tenant))

    def take(self) -> list[tuple[Request, list[str]]]:
        """The next call's texts: from the least charged tenant's first request, then again the least charged,
        while the call has room and the next request is for the same tokenizer; each chunk charged now."""
        chunks: list[tuple[Request, list[str]]] = []
        room = self.call_chars
        tokenize: Tokenize | None = None
        while self._heap and room > 0:
            counter, _, tenant = self._heap[0]
            lane = self.lanes[tenant]
            request = lane[0]
            if request.done.done():  # its caller left: nothing more of it is tokenized
                self._drop_head(tenant, lane)
                continue
            if tokenize is not None and request.tokenize is not tokenize:
                break
            if chunks and len(request.texts[0]) > room:  # the call's first text may be any length, no later one
                break
            tokenize = request.tokenize
            texts: list[str] = []
            size = 0
            while request.texts and (not texts or size + len(request.texts[0]) <= room):
                text = request.texts.popleft()
                texts.append(text)
                size += len(text)
            room -= size
            request.open += 1
            chunks.append((request, texts))
            self.vtime = counter
            self.charged[tenant] = counter + size
            if request.texts:
                heapq.heapreplace(self._heap, (counter + size, next(self._order), tenant))
            else:
                self._drop_head(tenant, lane)
        return chunks

    def _drop_head(self, tenant: str, lane: deque[Request]) -> None:
        lane.popleft()
        if lane:
            heapq.heapreplace(self._heap, (self.charged[tenant], next(self._order), tenant))
        else:
            heapq.heappop(self._heap)
            del self.lanes[tenant]
            if len(self.charged) > KEPT_TENANTS:
                self._forget()

    def _forget(self) -> None:
        """Drop the counters of tenants not waiting that are at or under the floor a returning tenant is lifted to
        now (a returning tenant is lifted at least that far anyway); what is left are the tenants ahead."""
        floor = (self._heap[0][0] if self._heap else self.vtime) - self.call_chars
        self.charged = {t: c for t, c in self.charged.items() if t in self.lanes or c > floor}


class TokenizeStage:
    """One worker thread fed by `Lanes`; the texts queued while it works go together in its next call."""

    def __init__(self, call_chars: int = CALL_CHARS, clock: Callable[[], float] = time.perf_counter) -> None:
        self._pool: ThreadPoolExecutor | None = None  # made on first use
        self.lanes = Lanes(call_chars)
        self.clock = clock
        self._busy = False
        self.calls = 0  # tokenizer calls made (each covering one or more requests)
        self.requests = 0  # requests tokenized

    async def run(self, tokenize: Tokenize, texts: list[str], tenant: str = "") -> float:
        """Returns once `texts` are tokenized (or the attempt failed: the backend then does it itself): the
        seconds of tokenizer time charged to them (their characters' share of their calls)."""
        loop = asyncio.get_running_loop()
        request = Request(tokenize, tenant, deque(texts), loop.create_future())
        self.requests += 1
        if not texts:
            return 0.0
        self.lanes.add(request)
        if not self._busy:
            self._next(loop)
        try:
            await request.done
        finally:
            if not request.done.done():  # cancelled: `take` drops what is left of it
                request.done.cancel()
        return request.seconds

    def _next(self, loop: asyncio.AbstractEventLoop) -> None:
        chunks = self.lanes.take()
        if not chunks:
            self._busy = False
            return
        self._busy = True
        texts = [t for _, ts in chunks for t in ts]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self.calls += 1
        work = self._pool.submit(self._timed, chunks[0][0].tokenize, texts)
        work.add_done_callback(lambda f: loop.call_soon_threadsafe(self._finished, loop, f, chunks))

    def _timed(self, tokenize: Tokenize, texts: list[str]) -> float:
        started = self.clock()
        tokenize(texts)
        return self.clock() - started

    def _finished(
        self, loop: asyncio.AbstractEventLoop, work: Future[float], chunks: list[tuple[Request, list[str]]]
    ) -> None:
        error = work.exception()
        if error is not None:
            log.warning("the tokenizer stage failed (%s); inputs are tokenized where they are needed", error)
        seconds = work.result() if error is None else 0.0
        chars = sum(len(t) for _, ts in chunks for t in ts) or 1
        for request, texts in chunks:
            request.seconds += seconds * sum(map(len, texts)) / chars
            request.open -= 1
            if not request.open and not request.texts and not request.done.done():
                request.done.set_result(None)
        self._next(loop)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
