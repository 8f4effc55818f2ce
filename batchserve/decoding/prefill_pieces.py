"""A prefill's pieces as the slot decoder pads and checks them: the join and width buckets a prefill is padded up
to, the checks before any row changes, the positions continued pieces attend to, and the five buffers every
prefill writes and its graphs read (`PrefillBuffers`). Apart from `slot_decoder.SlotDecoder` because none of it
needs the decoder's cache or model: shapes and tensors only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from batchserve.decoding.stepper import SamplingParams

PREFILL_ROWS = (1, 4, 16, 64, 128)  # joining prompts in one prefill, padded up to one of these
PREFILL_WIDTHS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)  # their longest prompt, padded up likewise


def prefill_row_buckets(slots: int) -> tuple[int, ...]:
    """The join counts a prefill is padded up to: PREFILL_ROWS below the slots, and the slots themselves if fewer
    than the largest (no prefill joins more sequences than there are slots)."""
    return tuple(sorted({r for r in PREFILL_ROWS if r < slots} | {min(slots, max(PREFILL_ROWS))}))


def check_pieces(
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    starts: Sequence[int],
    last: Sequence[bool],
    slot_tokens: int,
    most_joins: int,
) -> None:
    """Refuse a prefill that does not fit before it changes any row: each piece (plus its max_tokens, if it ends
    its prompt) within its slot's `slot_tokens`, and at most `most_joins` pieces (the prefill buffers' rows)."""
    if any(s + len(p) + (q.left if end else 0) > slot_tokens for s, p, q, end in zip(starts, prompts, params, last)):
        raise ValueError(f"a prompt plus its max_tokens is over the slot's {slot_tokens} tokens")
    if len(prompts) > most_joins:
        raise ValueError(f"{len(prompts)} joins in one prefill: at most {most_joins} (see prefill_fits)")


def prefill_span(starts: Sequence[int], prompts: Sequence[Sequence[int]], whole_slot: int) -> int:
    """The slot positions a prefill's pieces attend to besides their own: none for first pieces; for continued
    ones `whole_slot` when it is set (a captured shape: one graph serves every start), else only what they need."""
    if not any(starts):
        return 0
    return whole_slot or max(s + len(p) for s, p in zip(starts, prompts))


@dataclass(frozen=True)
class PrefillBuffers:
    """A prefill's prompt pieces, one a row, right-padded (a piece starts at its start): on the host as packed for
    one prefill, and on the device as the buffers its graphs read. Kept together because every prefill writes all
    five and `SlotDecoder._prefill_step` reads all five; padding rows write the scratch slot, which no step reads."""

    ids: torch.Tensor  # [rows, width]: each piece's tokens, then pad ids
    length: torch.Tensor  # its token count (padding rows: 1)
    slot: torch.Tensor  # the slot it writes (padding rows: the scratch slot)
    start: torch.Tensor  # its first position in its sequence
    last: torch.Tensor  # whether it ends its prompt (and so draws the first token)

    @classmethod
    def padding(
        cls, rows: int, width: int, pad_id: int, scratch: int, device: torch.device | None = None
    ) -> PrefillBuffers:
        """All rows padding: what the device buffers hold at first, and what a packing starts from."""
        return cls(
            torch.full((rows, width), pad_id, dtype=torch.long, device=device),
            torch.ones(rows, dtype=torch.long, device=device),
            torch.full((rows,), scratch, dtype=torch.long, device=device),
            torch.zeros(rows, dtype=torch.long, device=device),
            torch.ones(rows, dtype=torch.bool, device=device),
        )

    @classmethod
    def pack(
        cls,
        shape: tuple[int, int],
        pad_id: int,
        scratch: int,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        starts: Sequence[int],
        last: Sequence[bool],
    ) -> PrefillBuffers:
        """The pieces on the host, padded to `shape` (rows, width): built whole so that `load` copies each buffer
        to the device once, not once a piece."""
        host = cls.padding(*shape, pad_id, scratch)
        for row, (slot, p) in enumerate(zip(slots, prompts)):
            host.ids[row, : len(p)] = torch.tensor(p, dtype=torch.long)
            host.length[row], host.slot[row], host.start[row], host.last[row] = len(p), slot, starts[row], last[row]
        return host

    def load(self, host: PrefillBuffers) -> None:
        """Copy packed pieces into these device buffers' first rows, in place: the captured graphs read them."""
        rows, width = host.ids.shape
        dev = self.ids.device
        self.ids[:rows, :width] = host.ids.to(dev)
        for name in ("length", "slot", "start", "last"):
            getattr(self, name)[:rows] = getattr(host, name).to(dev)
