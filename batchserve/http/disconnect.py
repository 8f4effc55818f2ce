"""Has the caller hung up? Read when a batch is formed, so a queued item whose caller left never takes a place in
a batch. Shared by every route that waits on the door (inference, embeddings, KServe v2)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.types import Receive


async def hung_up(receive: Receive) -> None:
    """Returns when the caller hangs up."""
    while (await receive())["type"] != "http.disconnect":
        pass


def watch(receive: Receive) -> Callable[[], bool]:
    """For ASGI servers without a disconnect flag: the check of a task that ends when the caller hangs up. Under
    uvicorn the check is its per-request cycle's `disconnected` flag, read by `Call.gone` (http/endpoint.py)."""
    return asyncio.ensure_future(hung_up(receive)).done
