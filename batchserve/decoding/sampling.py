"""Per-request temperature, top_p, greedy and seed for transformers' continuous batching, computed on the device.

The library has per-request temperature and top_p processors, but its sampling is one draw for the whole batch:
no greedy request beside a sampled one, no per-request seed. So the manager runs greedy (argmax) and these
processors make the argmax a sample:
- temperature: the library's per-request processor (one cheap division);
- `TopP`: masks the tail of the rows that ask for top_p < 1;
- `TokenChoice`: draws the token of each sampling row by inverse CDF (one uniform per row, against the cumulative
  softmax) and leaves only that token's score finite. A seeded row's uniform is a hash of (seed, token index), so it
  gets the same tokens whatever else shares its batches. Greedy rows are left alone.

On the host only each row's argument is gathered (`prepare_tensor_args`); the sampling is tensor work over all
rows, on the device inside the manager's step. On CUDA the processors are `sync_free` (no host sync, no branch
on values), so the manager can capture them in its CUDA graph. On a CPU, where a sync is free and a vocabulary
sort is not, they first pick the rows that asked and work on those only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
    ContinuousBatchingLogitsProcessorList,
)
from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper

SAMPLE = -1  # draw with the global generator
GREEDY = -2  # argmax
SEED_KEY = "choice_seed"  # per-request kwarg: SAMPLE, GREEDY or a seed >= 0
STEP_KEY = "choice_step"  # tokens drawn so far by a seeded request (kept in its kwargs: survives offloading)
MASK31 = 0x7FFFFFFF
Key = TypeVar("Key", int, torch.Tensor)


if TYPE_CHECKING:
    from batchserve.decoding.stepper import SamplingParams


def choice_key(params: SamplingParams) -> int:
    """A request's draw: GREEDY, SAMPLE (a fresh uniform each token) or its seed (31 bits)."""
    if params.greedy:
        return GREEDY
    return SAMPLE if params.seed is None else params.seed & MASK31


def step_key(seed: Key, step: Key) -> Key:
    """A 31-bit seed per (request seed, token index): on ints, or on int64 tensors (the same bits, on the device)."""
    x = (seed * 0x9E3779B1 + step * 0x85EBCA77) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x = x ^ (x >> 12)
    return x & MASK31


def mask_top_p(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filtering, row by row: beyond the smallest set of top tokens holding `top_p` of the probability
    the scores become -inf (the top token is always kept). Rows with top_p >= 1 are returned unchanged."""
    ordered, order = scores.sort(dim=-1, descending=True)
    probs = ordered.softmax(dim=-1, dtype=torch.float64)  # see choose_tokens: sums over the whole vocabulary
    drop = (probs.cumsum(dim=-1) - probs > top_p.unsqueeze(-1)) & (top_p < 1.0).unsqueeze(-1)
    return scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def choose_tokens(scores: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Each row's token drawn by inverse CDF and left as its only finite score; GREEDY rows come back as they
    were. A seeded row's uniform is its key (+ 0.5) / 2^31, an unseeded row's comes from the default generator
    of the scores' device (CUDA graphs replay it with fresh offsets)."""
    seeded = keys >= 0
    fresh = torch.rand(keys.shape, dtype=torch.float64, device=scores.device)
    u = torch.where(seeded, (keys.to(torch.float64) + 0.5) / (MASK31 + 1), fresh)
    # float64: a float32 running sum over the vocabulary drifts as much as a tail token's probability, differently
    # per batch shape, so the same seed could land on another token depending on what shared the step.
    cdf = scores.softmax(dim=-1, dtype=torch.float64).cumsum(dim=-1)
    drawn = torch.searchsorted(cdf, u.unsqueeze(-1) * cdf[:, -1:]).clamp_(max=scores.size(-1) - 1)
    chosen = torch.full_like(scores, float("-inf")).scatter_(-1, drawn, 0.0)
    return torch.where((keys == GREEDY).unsqueeze(-1), scores, chosen)


class _PerRequest(ContinuousBatchingLogitsProcessor):
    def __init__(self, sync_free: bool = False) -> None:
        self.sync_free = sync_free

    def _on_rows(
        self, scores: torch.Tensor, arg: torch.Tensor, asked: torch.Tensor, fn: Callable[..., torch.Tensor]
    ) -> torch.Tensor:
        """`fn(scores, arg)` on every row (sync-free), or only on the rows that `asked`."""
        if self.sync_free:
            return fn(scores, arg)
        rows = asked.nonzero().squeeze(-1)
        if rows.numel() == 0:
            return scores
        out = scores.clone()
        out[rows] = fn(scores[rows], arg[rows])
        return out


class TopP(_PerRequest):
    """Nucleus filtering per request (`top_p`)."""

    supported_kwargs: dict[str, type] = {"top_p": float}
    ignored_kwargs: tuple[str, ...] = ()

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.copy_(torch.ones_like(int32_tensor, dtype=torch.float32).view(dtype=torch.int32))

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        top_p = [r.state.logit_processor_kwargs.get("top_p", 1.0) for r in requests_with_new_token]
        # float32 values in the int32 argument tensor the library hands each processor
        return torch.tensor(top_p, dtype=torch.float32, device="cpu").view(dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        top_p = tensor_arg[: scores.size(0)].view(dtype=torch.float32).to(scores.device)
        return self._on_rows(scores, top_p, top_p < 1.0, mask_top_p)


class TokenChoice(_PerRequest):
    """The last processor: each sampling row draws its token by inverse CDF and leaves only it for the argmax."""

    supported_kwargs: dict[str, type] = {SEED_KEY: int}
    ignored_kwargs: tuple[str, ...] = (STEP_KEY,)

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(GREEDY)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        keys = []
        for request in requests_with_new_token:
            kwargs = request.state.logit_processor_kwargs
            key = kwargs.get(SEED_KEY, GREEDY)
            if key >= 0:
                step = kwargs.get(STEP_KEY, 0)
                kwargs[STEP_KEY] = step + 1
                key = step_key(key, step)
            keys.append(key)
        return torch.tensor(keys, dtype=torch.int32, device="cpu")

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        keys = tensor_arg[: scores.size(0)].to(scores.device)
        return self._on_rows(scores, keys, keys != GREEDY, choose_tokens)


def processors(sync_free: bool = False) -> ContinuousBatchingLogitsProcessorList:
    """The per-request processor list for a greedy manager: temperature (the library's), TopP, TokenChoice;
    `sync_free` for CUDA graphs. Assign it to `manager.logit_processor` before the manager builds its batch
    processor, which sizes the per-request argument tensor from `tensors_required`."""
    plist = ContinuousBatchingLogitsProcessorList(
        LogitsProcessorList([TemperatureLogitsWarper(0.5)]), per_request_processors=True
    )
    for proc in (TopP(sync_free), TokenChoice(sync_free)):
        plist.logits_processor.append(proc)
        plist.tensors_required += 1
        plist.supported_keys.update(proc.supported_kwargs)
        plist.ignored_keys.update(proc.ignored_kwargs)
    plist.do_processing = True
    return plist
