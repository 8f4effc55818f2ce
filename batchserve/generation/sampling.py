"""Per-request temperature, top_p, greedy and seed for transformers' continuous batching.

The library has per-request temperature and top_p processors, but with them every row of every step pays a full
vocabulary sort (top_p) and a `torch.multinomial`: measured on this CPU, 34 ms + 16 ms for 16 rows, more than the
model's own forward pass. And its sampling is one draw for the whole batch: no greedy request beside a sampled
one, no per-request seed. So the manager runs greedy (argmax) and these processors make the argmax a sample:
- temperature: the library's per-request processor (one cheap division);
- `TopP`: masks the tail only in rows that ask for top_p < 1;
- `TokenChoice`: draws the token of each sampling row by inverse CDF (one uniform per row, against the cumulative
  softmax) and leaves only that token's score finite. A seeded row's uniform is a hash of (seed, token index), so it
  gets the same tokens whatever else shares its batches. Greedy rows are left alone.
"""

from __future__ import annotations

from typing import Any

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


def step_key(seed: int, step: int) -> int:
    """A 31-bit seed per (request seed, token index)."""
    x = (seed * 0x9E3779B1 + step * 0x85EBCA77) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x ^= x >> 12
    return x & MASK31


def _floats(values: list[float]) -> torch.Tensor:
    """float32 values in the int32 argument tensor the library hands each processor."""
    return torch.tensor(values, dtype=torch.float32, device="cpu").view(dtype=torch.int32)


class TopP(ContinuousBatchingLogitsProcessor):
    """Nucleus filtering, computed only for the rows that ask for it."""

    supported_kwargs: dict[str, type] = {"top_p": float}
    ignored_kwargs: tuple[str, ...] = ()

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.copy_(torch.ones_like(int32_tensor, dtype=torch.float32).view(dtype=torch.int32))

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        return _floats([r.state.logit_processor_kwargs.get("top_p", 1.0) for r in requests_with_new_token])

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        top_p = tensor_arg[: scores.size(0)].view(dtype=torch.float32).to(scores.device)
        rows = (top_p < 1.0).nonzero().squeeze(-1)
        if rows.numel() == 0:
            return scores
        sub = scores[rows]
        ordered, order = sub.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs > top_p[rows].unsqueeze(-1)  # the top token is always kept
        out = scores.clone()
        out[rows] = sub.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        return out


class TokenChoice(ContinuousBatchingLogitsProcessor):
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
        keys = tensor_arg[: scores.size(0)].tolist()
        rows = [i for i, k in enumerate(keys) if k != GREEDY]
        if not rows:
            return scores
        # One uniform per row: the global generator's, or a pure function of (seed, token index).
        u = torch.tensor([(keys[i] + 0.5) / (MASK31 + 1) if keys[i] >= 0 else float("nan") for i in rows])
        unseeded = u.isnan()
        u[unseeded] = torch.rand(int(unseeded.sum()))
        index = torch.tensor(rows, device=scores.device)
        cdf = scores[index].softmax(dim=-1).cumsum(dim=-1)
        drawn = torch.searchsorted(cdf, u.to(cdf.device).unsqueeze(-1) * cdf[:, -1:]).clamp_(max=scores.size(-1) - 1)
        chosen = torch.full_like(cdf, float("-inf")).scatter_(-1, drawn, 0.0)
        out = scores.clone()
        out[index] = chosen
        return out


def processors() -> ContinuousBatchingLogitsProcessorList:
    """The per-request processor list for a greedy manager: temperature (the library's), TopP, TokenChoice.

    Assign it to `manager.logit_processor` before the manager builds its batch processor, which sizes the
    per-request argument tensor from `tensors_required`."""
    plist = ContinuousBatchingLogitsProcessorList(LogitsProcessorList([TemperatureLogitsWarper(0.5)]),
                                                  per_request_processors=True)
    for proc in (TopP(), TokenChoice()):
        plist.logits_processor.append(proc)
        plist.tensors_required += 1
        plist.supported_keys.update(proc.supported_kwargs)
        plist.ignored_keys.update(proc.ignored_kwargs)
    plist.do_processing = True
    return plist
