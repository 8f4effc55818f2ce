"""The tokenizer stage (issue 36, "tokenize once, off the loop"): a backend that declares `tokenize(texts)` has
every input's tokens made here, on a worker thread, before the door costs it, so the event loop never runs a
tokenizer. The backend keeps what it made (by text) and reads it twice: on the loop to cost and bucket the input
(`cost_of`, `bucket_of`: a dictionary look-up), and on the device thread to run it (`batch`).

The texts of callers that arrive while the worker is busy are gathered and tokenized together in the next call,
so under load one call covers many requests (a fast tokenizer's batch call, which also leaves the interpreter
lock to Rust's threads). A failure here fails nobody: the backend tokenizes what it lacks where it needs it.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol, runtime_checkable
from collections.abc import Callable

log = logging.getLogger("batchserve")

Tokenize = Callable[[list[str]], None]


@runtime_checkable
class Pretokenizer(Protocol):
    """A backend whose inputs' tokens are made ahead, in the stage (`backends/hf.py`'s models, minilm)."""

    def tokenize(self, texts: list[str]) -> None: ...


def tokenizer_of(backend: object) -> Tokenize | None:
    return backend.tokenize if isinstance(backend, Pretokenizer) else None


class TokenizeStage:
    """One worker thread; the texts queued while it works go together in its next call (per backend)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None  # made on first use
        self._waiting: dict[Tokenize, list[tuple[list[str], asyncio.Future[None]]]] = {}
        self._busy = False
        self.calls = 0  # tokenizer calls made (each covering one or more requests)
        self.requests = 0  # requests tokenized

    async def run(self, tokenize: Tokenize, texts: list[str]) -> None:
        """Returns once `texts` are tokenized (or the attempt failed: the backend then does it itself)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._waiting.setdefault(tokenize, []).append((texts, done))
        self.requests += 1
        if not self._busy:
            self._next(loop)
        await done

    def _next(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._waiting:
            self._busy = False
            return
        self._busy = True
        tokenize = next(iter(self._waiting))
        group = self._waiting.pop(tokenize)
        texts = [t for ts, _ in group for t in ts]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self.calls += 1
        work = self._pool.submit(tokenize, texts)
        work.add_done_callback(lambda f: loop.call_soon_threadsafe(self._finished, loop, f, group))

    def _finished(
        self, loop: asyncio.AbstractEventLoop, work: Future, group: list[tuple[list[str], asyncio.Future[None]]]
    ) -> None:
        if work.exception() is not None:
            log.warning("the tokenizer stage failed (%s); inputs are tokenized where they are needed", work.exception())
        for _, done in group:
            if not done.done():
                done.set_result(None)
        self._next(loop)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
