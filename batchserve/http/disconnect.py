"""Has the caller hung up? Read when a batch is formed, so a queued item whose caller left never takes a place in
a batch. Shared by every route that waits on the door (inference, embeddings, KServe v2)."""

from __future__ import annotations

import asyncio

from starlette.types import Receive


class Watcher:
    """For ASGI servers without a disconnect flag: a task that notes the caller hanging up. Under uvicorn the
    check is its per-request cycle's `disconnected` flag, read by `Call.gone` (http/endpoint.py) instead."""

    def __init__(self, receive: Receive) -> None:
        self.gone = False
        self.task = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True

    def __call__(self) -> bool:
        return self.gone
