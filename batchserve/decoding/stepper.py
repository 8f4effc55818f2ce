"""What the generation engine asks of the thing that runs its sequences on the device (a "stepper"), and the
values that cross between them. The engine (on the event loop) decides who runs; a stepper (on its own
thread) runs them and hands back each step's new tokens with one `call_soon_threadsafe` per step.

Two steppers: `slot_stepper.SlotStepper` (batchserve's own slot KV cache with CUDA-graph steps, the default)
and `manager_stepper.ManagerStepper` (transformers' `ContinuousBatchingManager`, `--generation-engine manager`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol
from collections.abc import Callable

GPU_MEMORY_SHARE = 0.5  # share of free GPU memory a stepper's KV cache may take (the batch path's model needs room)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0 (below 1e-5) = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    resumed: int = 0  # tokens made before a preemption: the prompt ends with them, and the next draw is this index

    @property
    def left(self) -> int:
        """Tokens still to make (all of max_tokens, less those made before a preemption)."""
        return self.max_tokens - self.resumed

    @property
    def greedy(self) -> bool:
        """0, or so close that scores / temperature would overflow."""
        return self.temperature < 1e-5


@dataclass(frozen=True, slots=True)
class TokenUpdate:
    """A sequence's tokens from one step (usually one), and whether it has ended (EOS, max_tokens, or error)."""

    seq_id: str
    tokens: list[int]
    finished: bool = False
    error: str | None = None


Deliver = Callable[[list[TokenUpdate]], None]


@dataclass(frozen=True)
class KvCapacity:
    """The admission resource a stepper offers: `blocks` KV blocks of `page_size` tokens, at most `max_seqs`
    sequences, and at most `max_sequence_tokens` (prompt + max_tokens) in one sequence."""

    blocks: int
    page_size: int
    max_seqs: int
    max_sequence_tokens: int


class Stepper(Protocol):
    capacity: KvCapacity
    step_s: float  # time per decode step seen at warm-up
    description: str  # for logs and /internal/generation
    resumable: bool  # True: a sequence dropped (`cancel`) may be added again with `resumed` set (preemption)
    shares_steps: bool  # True: it keeps background rows out of steps to hold `slowdown` itself (`step_share`)

    @property
    def row_growth(self) -> float:
        """How much one more row lengthens a decode step, of a one-row step (0: not measured, or free)."""

    def start(self, loop: asyncio.AbstractEventLoop, deliver: Deliver) -> None:
        """Begin running; `deliver` is called on `loop` with each step's updates."""

    def add(
        self, seq_id: str, prompt_ids: list[int], params: SamplingParams, background: bool = False, tenant: str = ""
    ) -> None:
        """Start a sequence that admission found fits; called on the loop. A resumed (preempted) one comes back
        under a new id, its prompt followed by its made tokens (`params.resumed` of them). `background` and
        `tenant`: its lane, for a stepper that `shares_steps` (`step_share`, `prefill_share`)."""

    def cancel(self, seq_id: str) -> None:
        """Drop a sequence now; no more updates matter for it. Called on the loop."""

    def is_running(self) -> bool: ...

    def kv_usage(self) -> float:
        """Share of the KV cache in use."""

    def step_mix(self) -> dict[str, float]:
        """Step counts for /internal/generation (empty where it does not share steps)."""

    def stop(self, timeout: float) -> None:
        """Stop running (blocking; called off the loop)."""
