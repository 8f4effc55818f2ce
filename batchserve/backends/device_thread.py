"""One thread per device, on which everything for that device runs, in order: the backend's `setup` and
`warm` at start-up, then the worker pool's loop that runs its batches.

Why one thread for all of it: state a backend makes in `setup` may belong to the thread that made it (a CUDA
stream or context made current, a thread-local session of an inference runtime); running the batches on the
same thread keeps it valid. The thread is a daemon: a worker hung in a backend call must not keep the
process from exiting once the server has drained (a `ThreadPoolExecutor` thread would be joined at exit).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, TypeVar
from collections.abc import Callable

T = TypeVar("T")


class DeviceThread:
    def __init__(self, name: str) -> None:
        self.name = name
        self._calls: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=f"device-{name}", daemon=True)
        self.thread.start()

    def call(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run `fn(*args)` on this device's thread after what was queued before; its outcome in a Future."""
        future: Future[T] = Future()
        self._calls.put((future, fn, args))
        return future

    def _loop(self) -> None:
        while True:
            future, fn, args = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)
