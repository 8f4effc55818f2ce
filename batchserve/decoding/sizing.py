"""How big the slot stepper is on a device, and how much prefill one step may carry (issue 25): pure
functions of numbers, so they are unit-tested with made-up free-memory figures and no device.

Why these rules:
- Rows to the memory. On a GPU a decode step of this model is launch-bound: on an H200 a step of 256 rows took
  4.8 ms, of 1,024 rows 8.18 ms (`bench/results/gpu-h200-49af27a/cb1024.md`), so rows are nearly free and
  the slot count should be what the KV cache share of free memory holds, not a fixed 256. A slot holds a whole
  context (`max_context` tokens; SmolLM2: 30 layers x K and V x 3 heads x 64 x 2 bytes = 23 KB a token, 47 MB a
  slot of 2,048), so half of an H200's ~139 GB holds ~1,400 slots and half of an H100's ~79 GB ~830.
  The count is rounded down to a multiple of `SLOT_ROUND` (a row bucket boundary, so no graph is captured for a
  handful of rows past one) and capped at `GPU_MAX_SEQS`, past which a step stops being nearly free.
- Row buckets up to the slots, denser above 256 (384, 768, 1,536): a step runs padded up to its bucket, and
  513 live rows padded to 1,024 would pay ~40 % more per step than they need.
- Prefill in pieces. Every prefill pauses the running sequences, so one step carries at most
  `step_tokens` prompt tokens of prefill, each prompt in pieces of at most `chunk` tokens: a burst of a
  thousand new sequences, or one long prompt, is spread over several steps instead of stalling every running
  sequence for all of it at once (`prefill_share.plan_prefill`, which also shares and prices it by lane).
"""

from __future__ import annotations


GPU_MAX_SEQS = 2048  # auto slots on a GPU at most (a step of 1,024 rows took 8.18 ms on an H200; 256 took 4.8)
SLOT_ROUND = 64  # auto slots on a GPU are a multiple of this (when at least this many fit)
ROW_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)  # decode rows padded up to one


def auto_gpu_slots(fit: int) -> int:
    """Slots on a GPU when none is configured: as many as fit, rounded down to a multiple of SLOT_ROUND once
    at least that many fit, and at most GPU_MAX_SEQS."""
    if fit >= SLOT_ROUND:
        fit -= fit % SLOT_ROUND
    return max(1, min(GPU_MAX_SEQS, fit))


def kv_tokens_for(free_bytes: int, share: float, bytes_per_token: int) -> int:
    """KV-cache tokens that `share` of `free_bytes` holds at `bytes_per_token` (all layers, K and V)."""
    return int(free_bytes * share) // max(1, bytes_per_token)


def row_buckets(slots: int) -> list[int]:
    """The decode row counts a step is padded up to (and captured at): the buckets below `slots`, and `slots`."""
    return sorted({b for b in ROW_BUCKETS if b < slots} | {slots})
