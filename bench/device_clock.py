"""A GPU's time stood in by a clock, for the benches that measure the host without a GPU (`stepper_host.py`,
`static_host.py`): work launched runs in launch order, each piece after the one before it ends, and waiting
for it sleeps with the interpreter lock released, as a CUDA event's or stream's wait does."""

from __future__ import annotations

import time


class DeviceClock:
    """When the stood-in device has run everything launched so far, and how long it has been busy."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy_s = 0.0

    def enqueue(self, seconds: float) -> float:
        """Launch `seconds` of device work; when it will be done."""
        start = max(time.perf_counter(), self.free_at)
        self.free_at = start + seconds
        self.busy_s += seconds
        return self.free_at

    @staticmethod
    def wait(due: float) -> None:
        left = due - time.perf_counter()
        if left > 0:
            time.sleep(left)
