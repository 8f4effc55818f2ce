"""The static batch path with its GPU stood in by a clock: whether the host keeps the device fed inside the
server (issue 13, item 2), measured on a machine without a GPU.

    STATIC_STAND_IN=lagged=1 python -m bench.executor_bench --backend bench.static_host:StandInSmolLM2 \\
        --sizes 1,8,16,32,64,100 --max-new-tokens 64 --rates 100,200,300 --duration 10

Why: on a GPU a batch of 100 × 64 new tokens is ~64 graph replays of ~3.5-4.2 ms each, an eager prefill whose
~600 kernel launches run Python and hold the interpreter lock, and a host check of the rows' finished flags
every 4 steps. Inside the server the event loop wants the same lock; the H100 measured batches 7-11 % slower in
the server than alone. What of that is the host's can be measured here: everything but the device is real (the
smollm2 backend, SmolLM2's tokenizer and chat template, `StaticDecoder.generate`, `Runner.run`'s loop and its
check, the server, the executors), and the device is a clock:

- a decode step (`step_once`) takes `step_ms + step_ms_per_row × rows` of device time after the step before
  it ends (a GPU runs them in launch order), and costs the host nothing (a replay releases the lock);
- a prefill holds the lock for `host_prefill_ms` (the eager forward's launches: tiny torch ops here), then
  takes `prefill_ms + prefill_ms_per_row × rows` of device time;
- a check of the finished flags waits (the lock released, as a CUDA event's wait) for the step it reads: the
  newest (`lagged=0`, the loop before) or the one before it (`lagged=1`, the GPU loop now: the check's own step
  keeps the device busy meanwhile); rows never end early (as with random weights);
- the answers' tokens are read once the device is done (a `tolist` of the batch's token matrix).

The defaults are the H100's: 226.7 ms for a batch of 1 and 281.8 ms for 100, 64 new tokens
(`results/gpu-check-h100.md`). Set them as `STATIC_STAND_IN="step_ms=3.4,lagged=0,..."` (the server and its
device processes inherit it).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, fields
from types import SimpleNamespace
from collections.abc import Sequence

import torch

from batchserve.backends import all_callers_gone, pick_devices
from batchserve.backends.smollm2 import SmolLM2Backend, load_tokenizer, source_dir
from batchserve.backends.static_decode import GPU_CHECK_EVERY, FlagsCopy, Runner, Shape, StaticDecoder
from batchserve.config import ModelSpec, Settings
from bench.device_clock import DeviceClock

ENV = "STATIC_STAND_IN"


@dataclass
class StandInParams:
    step_ms: float = 3.4  # a decode step of one row
    step_ms_per_row: float = 0.008  # and each further row: 3.4 ms at 1, ~4.2 ms at 100
    prefill_ms: float = 4.0
    prefill_ms_per_row: float = 0.05
    host_prefill_ms: float = 6.0  # the eager prefill's kernel launches, lock held
    lagged: bool = True  # a check reads the flags of the step before its own (the GPU loop now)

    @classmethod
    def from_env(cls) -> StandInParams:
        """`STATIC_STAND_IN="step_ms=3.4,lagged=0"`: any of the fields, comma-separated."""
        p = cls()
        names = [f.name for f in fields(cls)]
        for item in filter(None, os.environ.get(ENV, "").split(",")):
            key, _, value = (part.strip() for part in item.partition("="))
            if key not in names:
                raise ValueError(f"{ENV}: unknown {key!r} (known: {', '.join(names)})")
            setattr(p, key, value not in ("0", "false") if key == "lagged" else float(value))
        return p


def hold_lock_for(seconds: float, scratch: torch.Tensor) -> None:
    """Host work that holds the interpreter lock: tiny torch ops, as an eager forward's launches are."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        scratch.add_(1)


@dataclass
class FlagsDue:
    """A stood-in copy of the finished flags: there once the device has run the step it was queued behind."""

    clock: DeviceClock
    due: float

    def synchronize(self) -> None:
        self.clock.wait(self.due)


class StandInRunner(Runner):
    """`Runner` with its device work stood in; `Runner.run` (the loop and its checks) is the real one."""

    def __init__(self, shape: Shape, max_new: int, pad_id: int, clock: DeviceClock, params: StandInParams) -> None:
        self.shape, self.max_new, self.pad_id = shape, max_new, pad_id
        self.clock, self.params = clock, params
        self.lagged = params.lagged
        self.graph = "stood in"
        self.scratch = torch.zeros(4)
        self.tokens = torch.full((shape.batch, max_new), 100, dtype=torch.long)

    def prefill(self, prompts: Sequence[Sequence[int]], finished: Sequence[bool] = ()) -> None:
        width = max(len(p) for p in prompts)
        ids = torch.full((self.shape.batch, width), self.pad_id, dtype=torch.long)  # the real host-side build
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        params = self.params
        hold_lock_for(params.host_prefill_ms / 1000, self.scratch)
        self.clock.enqueue((params.prefill_ms + params.prefill_ms_per_row * self.shape.batch) / 1000)

    def step_once(self) -> None:
        p = self.params
        self.clock.enqueue((p.step_ms + p.step_ms_per_row * self.shape.batch) / 1000)

    def snapshot_finished(self) -> FlagsDue:
        return FlagsDue(self.clock, self.clock.free_at)  # the flags of the newest step launched

    def all_finished(self, snapshot: FlagsCopy) -> bool:
        snapshot.synchronize()
        return False  # rows never end early here

    def finish(self, steps: int) -> list[list[int]]:
        self.clock.wait(self.clock.free_at)
        return self.tokens[:, :steps].tolist()


class StandInDecoder(StaticDecoder):
    """`StaticDecoder` (its buckets, plan and `generate` are the real ones) over stood-in runners."""

    def __init__(
        self, max_new_tokens: int, eos_ids: Sequence[int], pad_id: int, max_batch: int, params: StandInParams
    ) -> None:
        super().__init__(
            SimpleNamespace(device=torch.device("cpu")),
            max_new_tokens,
            eos_ids,
            pad_id,
            max_batch=max_batch,
            use_graphs=False,
            fixed_shapes=True,
        )
        self.use_graphs = True  # as on a GPU: the backend's warm() times every batch bucket
        self.check_every = GPU_CHECK_EVERY
        self.clock, self.params = DeviceClock(), params

    def warm(self) -> None:
        if not self.runners:
            self.runners = {
                s: StandInRunner(s, self.max_new, self.pad_id, self.clock, self.params) for s in self.graphed_shapes()
            }


class StandInSmolLM2(SmolLM2Backend):
    """The smollm2 backend (real tokenizer, chat template and decoding of answers) on a stood-in device."""

    @classmethod
    def from_settings(cls, spec: ModelSpec, s: Settings) -> StandInSmolLM2:
        tokenizer = load_tokenizer(source_dir(s))
        params = StandInParams.from_env()
        devices = pick_devices(s.devices)
        decoders = [
            StandInDecoder(s.max_new_tokens, [tokenizer.eos_token_id], tokenizer.pad_token_id, s.max_batch_size, params)
            for _ in devices
        ]
        return cls(
            devices=devices,
            max_new_tokens=s.max_new_tokens,
            tokenizer=tokenizer,
            decoders=decoders,
            should_stop=all_callers_gone,
        )
