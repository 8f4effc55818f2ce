"""A sequence of the decoding engine, and what the loop hands its caller as it goes (`Delta`).

Why apart from `engine.py`: the generation routes, the `/v1/inference` adapter and the batch-job lines hold
sequences and read deltas without needing the engine's policy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchserve.decoding.kv_budget import Claim
from batchserve.decoding.shares import Lane, lane_of
from batchserve.decoding.stepper import SamplingParams
from batchserve.errors import ApiError


@dataclass
class Delta:
    """What the loop hands a caller: new text, and at the end a finish reason (or an error)."""

    text: str
    tokens: int  # completion tokens so far
    finish_reason: str | None = None  # "stop" | "length" once finished
    error: ApiError | None = None


WAITING, RUNNING, DONE = "waiting", "running", "done"


@dataclass(eq=False)
class EngineSequence:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    tier: int
    blocks: int
    arrived: float
    deadline: float  # latest start (admission into the stepper)
    text: Any  # textstream.TextStream
    deltas: asyncio.Queue = field(default_factory=asyncio.Queue)
    state: str = WAITING
    tokens: int = 0
    started: float = 0.0
    last_token: float = 0.0
    finish_reason: str | None = None
    streamed: bool = True  # False: the caller wants the whole text once, so no delta per token
    held: list[str] = field(default_factory=list)  # text of a sequence that is not streamed, until it ends
    token_ids: list[int] | None = None  # every token generated, when the caller asked to keep them
    on_start: Callable[[EngineSequence], None] | None = None  # called as it joins the stepper (leaves the queue)
    tenant: str = ""  # whose share it counts in (`shares.py`)
    order: int = 0  # arrival order: ties in the queue, and a preempted sequence keeps its place
    made: list[int] = field(default_factory=list)  # every token generated: a preempted sequence resumes from them
    run_id: str = ""  # its id in the stepper for this run (a resumed run gets a new one: stale tokens are ignored)
    runs: int = 0  # times it joined the stepper (more than 1: it was preempted and resumed)
    run_started: float = 0.0  # when this run joined (the latest started is preempted first)
    resumed: bool = False  # its next token is the first of a resumed run: the gap is the pause, not a step

    @property
    def finished(self) -> bool:
        return self.state == DONE

    @property
    def lane(self) -> Lane:
        return lane_of(self.tenant, self.tier)

    def claim(self) -> Claim:
        return Claim(self.blocks, max(0, self.params.max_tokens - self.tokens))
