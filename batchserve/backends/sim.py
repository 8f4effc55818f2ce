"""The batch contract, exactly: ~fixed time per batch whatever its size, 1..max inputs, one batch at a time
per simulated device, each output the input reversed, fault hooks for tests (docs/contract.md#batch-contract).
A batch whose callers have all left ends early, as a real model's generation does; a hang never does.

A plugin like any other (docs/backends.md), registered as the entry point `sim`; it reads the server's flags
through `from_settings`."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from batchserve.backends import all_callers_gone
from batchserve.config import ModelSpec, Settings

# How often a running batch asks whether its callers are all gone: the stand-in for a model's generation step,
# between which a real model asks (smollm2's decode steps take ~60-140 ms on this machine's CPU). Each ask wakes
# the device thread, which takes the GIL from the event loop and walks the batch's items: ~60 µs of the thread's
# CPU a wake on this machine (bench/hotpath), the stand-in device's cost, not the route's. At 100 ms a batch of
# the default 100 ms sleeps once, as the minimal batcher's device does; a longer batch abandoned by its callers
# still stops at most this long after the last one left (tests/integration/backends/test_warmup.py).
POLL_S = 0.1


class SimFault(RuntimeError):
    """Raised by the fault hooks and by calls that break the contract."""


@dataclass
class SimBackend:
    output_kind = "text"  # (a class attribute, not a field) each output is its input reversed
    batch_s: float = 0.1
    max_batch_size: int = 100
    device_count: int = 1
    fail_marker: str = ""
    input_fail_marker: str = ""  # an input holding it fails alone: an exception in its output's place
    hang_marker: str = ""
    hang_s: float = 60.0
    bad_output_marker: str = ""
    flaky_device: int = -1
    _busy: dict[str, threading.Lock] = field(default_factory=dict, repr=False)
    _flaky: str = ""

    def __post_init__(self) -> None:
        self._busy = {name: threading.Lock() for name in self.devices()}
        self._flaky = f"sim:{self.flaky_device}"

    @classmethod
    def from_settings(cls, spec: ModelSpec, s: Settings) -> SimBackend:
        return cls(
            batch_s=spec.sim_batch_ms / 1000,
            max_batch_size=s.max_batch_size,
            device_count=s.devices or 1,
            fail_marker=s.sim_fail_marker,
            input_fail_marker=s.sim_input_fail_marker,
            hang_marker=s.sim_hang_marker,
            hang_s=s.sim_hang_ms / 1000,
            bad_output_marker=s.sim_bad_output_marker,
            flaky_device=s.sim_flaky_device,
        )

    @property
    def initial_batch_s(self) -> float:
        return self.batch_s

    def devices(self) -> list[str]:
        return [f"sim:{i}" for i in range(self.device_count)]

    def warm(self, device: str) -> None:
        if device != self._flaky:
            self.batch(["warm-up"], device)

    def batch(self, inputs: list[str], device: str) -> list[str | Exception]:
        if not 1 <= len(inputs) <= self.max_batch_size:
            raise SimFault(f"batch of {len(inputs)} inputs; the contract takes 1..{self.max_batch_size}")
        lock = self._busy[device]
        if not lock.acquire(blocking=False):
            raise SimFault(f"device {device} is already running a batch")
        try:
            started = time.perf_counter()
            if self.hang_marker and any(self.hang_marker in s for s in inputs):
                time.sleep(self.hang_s)
            if device == self._flaky:
                raise SimFault(f"device {device} is broken (--sim-flaky-device)")
            if self.fail_marker and any(self.fail_marker in s for s in inputs):
                raise SimFault("fail marker in batch")
            outputs: list[str | Exception] = [
                SimFault("input fail marker") if self.input_fail_marker and self.input_fail_marker in s else s[::-1]
                for s in inputs
            ]
            # Sleep to the batch time measured from the start, so per-batch overhead does not add up; like a
            # model between generation steps, stop early once every caller has left (its outputs go unread).
            remaining = self.batch_s - (time.perf_counter() - started)
            while remaining > 0:
                time.sleep(min(remaining, POLL_S))
                remaining = self.batch_s - (time.perf_counter() - started)
                if remaining > 0 and all_callers_gone():  # asked only where stopping would save time
                    break
            if self.bad_output_marker and any(self.bad_output_marker in s for s in inputs):
                return outputs[:-1]
            return outputs
        finally:
            lock.release()
