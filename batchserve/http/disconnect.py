"""Has the caller hung up? Read when a batch is formed, so a queued item whose caller left never takes a place in
a batch. Shared by every route that waits on the door (inference, embeddings, KServe v2)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

from starlette.types import Receive


def disconnect_probe(receive: Receive) -> Callable[[], bool] | None:
    """A cheap "has the caller hung up?" check, read when a batch is formed, so a queued item whose caller
    left never takes a place in a batch. uvicorn's receive() is a method of its per-request cycle, which
    flags the disconnect; other ASGI servers get a watcher task instead (`Watcher`)."""
    cycle = getattr(receive, "__self__", None)
    if cycle is not None and isinstance(getattr(cycle, "disconnected", None), bool):
        return functools.partial(getattr, cycle, "disconnected")
    return None


class Watcher:
    """For ASGI servers without a disconnect flag: a task that notes the caller hanging up."""

    def __init__(self, receive: Receive) -> None:
        self.gone = False
        self.task = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True

    def __call__(self) -> bool:
        return self.gone
