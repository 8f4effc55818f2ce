"""The device side of continuous batching: a KV cache of fixed slots, one sequence per slot, and a decode step
over all slots that is replayed as a CUDA graph.

transformers' `ContinuousBatchingManager` (`--generation-engine manager`) is host-bound (~3,400 tokens/s at 256
sequences on an H100): it schedules, rebuilds index tensors and gathers sampling arguments in Python every step.
Here every per-sequence value lives on the device from the moment the sequence joins, so a step is one graph
replay plus one copy of the new tokens back:

- `SlotCache`: one K and one V buffer per layer, `[slots, kv_heads, slot_tokens, head_dim]`, a slot per sequence
  with its own write position (`pos`), so sequences of any age share a step. It stands in for transformers'
  cache object, so the model's own forward, RoPE and attention run unchanged, with a ready-made 4-D mask.
- A step reads the first `rows` slots (joins take the lowest free slot) and attends to the first `span`
  positions; both are padded up to buckets, one graph per `(rows, span, sampling)`. Finished or empty rows run
  along, held by their `done` flag.
- Sampling (temperature, top_p, seeded or unseeded draw) is tensor work inside the step; greedy-only steps use a
  graph without the sort.
- Prefill writes the joining prompts' K/V (right-padded, one forward) and draws each first token. On CUDA it is a
  graph per (joins, width) bucket too (an eager forward costs ~20 ms of host work whatever its size); padding
  rows write a scratch slot that no step reads.
- Chunked prefill: a prompt may be prefilled in pieces (`starts`), each attending to the slot's earlier
  positions; only the last piece draws a token. Between pieces the row is held with its position at the next
  piece's start, so steps meanwhile write only where that piece will write. Continuation pieces have their own
  graphs (`chunk_graphs`, widths up to `chunk_tokens`).

On a CPU the same code runs eagerly with exact row and span counts.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Sequence

import torch

from batchserve.decoding.sampling import GREEDY, choice_key, choose_tokens, mask_top_p, step_key as device_step_key
from batchserve.decoding.sizing import ROW_BUCKETS, row_buckets
from batchserve.decoding.prefill_pieces import (
    PREFILL_ROWS,
    PREFILL_WIDTHS,
    PrefillBuffers,
    check_pieces,
    prefill_row_buckets,
    prefill_span,
)
from batchserve.decoding.stepper import SamplingParams

log = logging.getLogger("batchserve.slot_decoder")

SPAN_BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192)  # attended positions, padded up likewise
# a sequence's row state on the device, beside its K/V (what `SlotDecoder.move` carries)
ROW_STATE = ("ids", "pos", "count", "max_tokens", "done", "stop_at_eos", "temperature", "top_p", "seed", "out")


def bucket_up(n: int, buckets: Sequence[int], top: int) -> int:
    """The smallest bucket >= n (buckets past `top` dropped, `top` itself the last)."""
    for b in buckets:
        if n <= b < top:
            return b
    return top


def warm_summary(graphs: bool, steps: int, prefills: int) -> str:
    """What the warm-up did, for its log line (without CUDA graphs there is nothing captured to count)."""
    if graphs:
        return f"captured {steps} decode steps and {prefills} prefills as CUDA graphs"
    return "warmed the decode steps and prefills eagerly (no CUDA graphs: timed a full step)"


@dataclass(frozen=True)
class LaunchedStep:
    """A launched step: its rows, the host buffer its tokens are copied into, and (CUDA) the events before the step
    and after its copy; on a CPU (where launch runs the step) its time."""

    rows: int
    buffer: int
    event: Any = None  # torch.cuda.Event
    began: Any = None  # torch.cuda.Event recorded before the step (timed)
    seconds: float = 0.0  # a CPU step's time, measured in launch


class SlotCache:
    """Per-layer K/V slot buffers behind transformers' cache interface (`update` stores and returns what to attend
    to). The mode is set before each forward: decode (scatter at each row's `pos`), prefill (copy from position 0)
    or continuation (a later prefill piece)."""

    def __init__(self, config: Any, slots: int, slot_tokens: int, dtype: torch.dtype, device: torch.device) -> None:
        heads = config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (slots, heads, slot_tokens, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.heads, self.head_dim = heads, head_dim
        self._mode = "decode"
        self._rows, self._span = slots, slot_tokens
        # Set by decode / prefill / continuation before each forward (empty until then).
        self._index = torch.empty(0, dtype=torch.long, device=device)  # decode: pos as a scatter index; prefill: slots
        self._at = torch.empty(0, dtype=torch.long, device=device)  # continuation: each row's positions, [rows, width]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def decode(self, rows: int, span: int, pos: torch.Tensor) -> None:
        self._mode, self._rows, self._span = "decode", rows, span
        self._index = pos.view(rows, 1, 1, 1).expand(rows, self.heads, 1, self.head_dim)

    def prefill(self, slots: torch.Tensor) -> None:
        self._mode, self._index = "prefill", slots

    def continuation(self, slots: torch.Tensor, at: torch.Tensor, span: int) -> None:
        """A prefill piece that follows earlier ones: write at positions `at` of each slot, attend to the
        first `span` positions of the slot (earlier pieces and this one)."""
        self._mode, self._index, self._at, self._span = "continue", slots, at, span

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if self._mode == "continue":
            slots = self._index[:, None]
            k[slots, :, self._at] = key_states.transpose(1, 2)
            v[slots, :, self._at] = value_states.transpose(1, 2)
            return k[self._index, :, : self._span], v[self._index, :, : self._span]
        if self._mode == "prefill":
            width = key_states.shape[2]
            k[self._index, :, :width] = key_states
            v[self._index, :, :width] = value_states
            return key_states, value_states
        rows, span = self._rows, self._span
        k[:rows].scatter_(2, self._index, key_states)
        v[:rows].scatter_(2, self._index, value_states)
        return k[:rows, :, :span], v[:rows, :, :span]


class SlotDecoder:
    """Continuous-batching decode over `slots` sequences of at most `slot_tokens` tokens (prompt + output) each,
    on one model replica. Not thread-safe: one thread (the engine's stepper) calls it."""

    def __init__(
        self,
        model: Any,
        slots: int,
        slot_tokens: int,
        eos_ids: Sequence[int],
        pad_id: int,
        use_graphs: bool | None = None,
        fixed_shapes: bool | None = None,
        prefill_tokens: int = 8192,
        chunk_tokens: int = 0,
    ) -> None:
        """`fixed_shapes` (default: with graphs; tests set it on a CPU) pads to the buckets; `prefill_tokens`: the
        most padded tokens (joins x width) in one prefill; `chunk_tokens`: the most of one prompt per piece."""
        self.model = model
        self.device = model.device
        self.slots, self.slot_tokens = slots, slot_tokens
        self.prefill_tokens = prefill_tokens
        self.chunk_tokens = max(1, min(chunk_tokens or 512, prefill_tokens, slot_tokens))
        self.prefill_rows = prefill_row_buckets(slots)  # joins in one prefill, padded up to one of these
        tops = {False: slot_tokens, True: self.chunk_tokens}  # a prompt's first piece, and a continued one
        self.widths = {c: sorted({w for w in (*PREFILL_WIDTHS, top) if w <= top}) for c, top in tops.items()}
        self.pad_id = int(pad_id)
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs  # on exactly on CUDA
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        # a captured graph has fixed shapes, so graphs imply them
        self.fixed_shapes = self.use_graphs if fixed_shapes is None else fixed_shapes or self.use_graphs
        self.base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.head = model.get_output_embeddings()
        self.bool_mask = getattr(model.config, "_attn_implementation", "sdpa") in ("sdpa", "flash_attention_2")
        dev, n = self.device, slots + 1  # + the scratch slot that prefill's padding rows write into
        self.scratch = slots
        self.cache = SlotCache(model.config, n, slot_tokens, model.dtype, dev)
        self.ids = torch.full((n, 1), self.pad_id, dtype=torch.long, device=dev)  # each row's input token
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)  # its position (= the slot it writes)
        self.count = torch.zeros(n, dtype=torch.long, device=dev)  # tokens made so far
        self.max_tokens = torch.ones(n, dtype=torch.long, device=dev)
        self.done = torch.ones(n, dtype=torch.bool, device=dev)
        self.stop_at_eos = torch.ones(n, dtype=torch.bool, device=dev)
        self.temperature = torch.ones(n, dtype=torch.float32, device=dev)
        self.top_p = torch.ones(n, dtype=torch.float32, device=dev)
        self.seed = torch.full((n,), GREEDY, dtype=torch.long, device=dev)
        self.out = torch.full((n,), self.pad_id, dtype=torch.long, device=dev)  # the last step's tokens
        self.eos = torch.tensor(sorted({int(e) for e in eos_ids}) or [-1], dtype=torch.long, device=dev)
        self.pad = torch.tensor(self.pad_id, dtype=torch.long, device=dev)
        self.positions = torch.arange(slot_tokens, device=dev)
        self.graphs: dict[tuple[int, int, bool], Any] = {}  # (rows, span, sampling) -> torch.cuda.CUDAGraph
        # Prefill's inputs, read by its graphs: prompt pieces (right-padded), their lengths, slots, starts, ends.
        self.pieces = PrefillBuffers.padding(max(PREFILL_ROWS), slot_tokens, self.pad_id, self.scratch, dev)
        self.prefill_graphs: dict[tuple[int, int, bool], Any] = {}  # (joins, width, sampling) -> graph
        self.chunk_graphs: dict[tuple[int, int, bool], Any] = {}  # continuation pieces: the same keys
        # Two host copies of a step's tokens and done flags: one step can run while the last one's are read.
        pinned = self.device.type == "cuda"
        self.out_host = torch.empty((2, n), dtype=torch.long, pin_memory=pinned)
        self.done_host = torch.empty((2, n), dtype=torch.bool, pin_memory=pinned)
        self._buffer = 0
        self.row_growth = 0.0  # how much a second row lengthens a step, of a one-row step (`warm` times it)
        self.step_times: dict[int, float] = {}  # a step's time by its (padded) rows, as `warm` timed it

    # -- shapes -------------------------------------------------------------------------------------------
    def shape(self, rows: int, span: int) -> tuple[int, int]:
        """Exact on a CPU; padded up to the captured buckets on a GPU."""
        if not self.fixed_shapes:
            return rows, span
        return bucket_up(rows, ROW_BUCKETS, self.slots), bucket_up(span, SPAN_BUCKETS, self.slot_tokens)

    def shapes(self) -> list[tuple[int, int]]:
        spans = sorted({bucket_up(s, SPAN_BUCKETS, self.slot_tokens) for s in (*SPAN_BUCKETS, self.slot_tokens)})
        return [(r, s) for r in row_buckets(self.slots) for s in spans]

    def prefill_shape(self, joins: int, width: int, continued: bool = False) -> tuple[int, int] | None:
        """Exact on a CPU; on a GPU padded up to a captured bucket, or None when none holds it (then it runs
        eagerly). `continued`: a later piece of its prompt (widths stop at `chunk_tokens`)."""
        if not self.fixed_shapes:
            return joins, width
        rows = next((r for r in self.prefill_rows if joins <= r), None)
        wide = next((w for w in self.widths[continued] if width <= w), None)
        if rows is None or wide is None or rows * wide > self.prefill_tokens:
            return None
        return rows, wide

    def prefill_fits(self, joins: int, width: int, continued: bool = False) -> bool:
        """Whether `joins` prompts (or pieces) of up to `width` tokens go in one prefill."""
        if self.fixed_shapes:
            return self.prefill_shape(joins, width, continued) is not None
        return joins <= len(self.pieces.slot) and joins * width <= self.prefill_tokens

    def prefill_shapes(self, continued: bool = False) -> list[tuple[int, int]]:
        return [(r, w) for r in self.prefill_rows for w in self.widths[continued] if r * w <= self.prefill_tokens]

    def _device(self) -> contextlib.AbstractContextManager:
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    # -- the step -----------------------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, allowed: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The model's last hidden states for `ids` at positions `pos` over the slots, attending where `allowed` (a
        4-D boolean mask, True = attend: as is for SDPA, made additive for eager attention)."""
        mask, dtype = allowed, self.model.dtype
        if not self.bool_mask:
            mask = torch.zeros_like(allowed, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        out = self.base(input_ids=ids, attention_mask=mask, position_ids=pos, cache=self.cache, use_cache=True)
        return out.last_hidden_state

    def _pick(self, logits: torch.Tensor, rows: slice | torch.Tensor, sampling: bool) -> torch.Tensor:
        """Each row's next token, on the device; `count` (the token's index) keys a seeded row's draw."""
        if not sampling:
            return logits.argmax(-1)
        seed = self.seed[rows]
        keys = torch.where(seed >= 0, device_step_key(seed, self.count[rows]), seed)
        scores = mask_top_p(logits / self.temperature[rows].unsqueeze(-1), self.top_p[rows])
        return choose_tokens(scores, keys).argmax(-1)

    def _advance(self, rows: slice | torch.Tensor, tok: torch.Tensor, live: torch.Tensor) -> None:
        """Record the tokens of live rows (pads elsewhere), move their counters, flag EOS and length ends."""
        tok = torch.where(live, tok, self.pad)
        count = self.count[rows] + live.long()
        eos = (tok[:, None] == self.eos[None, :]).any(-1) & self.stop_at_eos[rows]
        self.out[rows] = tok
        self.count[rows] = count
        self.done[rows] = ~live | self.done[rows] | eos | (count >= self.max_tokens[rows])
        self.ids[rows] = tok[:, None]

    def _decode_step(self, rows: int, span: int, sampling: bool) -> None:
        """One token for each of the first `rows` slots, reading and writing only the decoder's tensors (so it
        can be captured): attend to the first `span` positions up to each row's own."""
        pos = self.pos[:rows]
        allowed = (self.positions[:span][None, :] <= pos[:, None]).view(rows, 1, 1, span)
        self.cache.decode(rows, span, pos)
        logits = self.head(self._forward(self.ids[:rows], allowed, pos[:, None])[:, -1]).float()
        live = ~self.done[:rows]
        self._advance(slice(0, rows), self._pick(logits, slice(0, rows), sampling), live)
        self.pos[:rows] = pos + live.long()

    def launch(self, rows: int, span: int, sampling: bool) -> LaunchedStep:
        """Run one decode step over the first `rows` slots (live positions < `span`) and queue its tokens' copy to
        the host. On CUDA this only enqueues: the next step may launch before this one is `collect`ed (two
        buffers), so the GPU is not idle while the host hands tokens over."""
        shape = self.shape(rows, span)
        buffer, self._buffer = self._buffer, self._buffer ^ 1
        cuda = self.device.type == "cuda"
        t0 = time.perf_counter()
        with torch.inference_mode(), self._device():
            began = None
            if cuda:
                began = torch.cuda.Event(enable_timing=True)
                began.record()
            graph = self.graphs.get((*shape, sampling))
            if graph is not None:
                graph.replay()
            else:
                self._decode_step(*shape, sampling)
            self.out_host[buffer, :rows].copy_(self.out[:rows], non_blocking=cuda)
            self.done_host[buffer, :rows].copy_(self.done[:rows], non_blocking=cuda)
            event = None
            if cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
        return LaunchedStep(rows, buffer, event, began, 0.0 if cuda else time.perf_counter() - t0)

    @staticmethod
    def step_seconds(ticket: LaunchedStep) -> float:
        """A collected step's time: on CUDA the device's, between its events; on a CPU launch's own."""
        if ticket.began is not None and ticket.event is not None:
            return float(ticket.began.elapsed_time(ticket.event)) / 1000
        return ticket.seconds

    def collect(self, ticket: LaunchedStep) -> tuple[list[int], list[bool]]:
        """Waits for a launched step (on CUDA with the GIL released); its rows' tokens and done flags."""
        if ticket.event is not None:
            ticket.event.synchronize()
        return (
            self.out_host[ticket.buffer, : ticket.rows].tolist(),
            self.done_host[ticket.buffer, : ticket.rows].tolist(),
        )

    # -- joining ------------------------------------------------------------------------------------------
    def prefill(
        self,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        starts: Sequence[int] | None = None,
        last: Sequence[bool] | None = None,
    ) -> tuple[list[int], list[bool]]:
        """Write these prompt pieces' K/V (piece i from position `starts[i]`, default 0) and, for each piece that
        ends its prompt (`last`, default all), draw the first token. Returns each row's first token and whether it
        is already done; a piece that is not last gives (pad, True), its row held until its last piece."""
        k, width = len(slots), max(len(p) for p in prompts)
        starts = list(starts) if starts is not None else [0] * k
        last = list(last) if last is not None else [True] * k
        check_pieces(prompts, params, starts, last, self.slot_tokens, len(self.pieces.slot))
        continued = any(starts)
        shape = self.prefill_shape(k, width, continued)
        rows, wide = shape if shape is not None else (k, width)
        span = prefill_span(starts, prompts, self.slot_tokens if shape is not None and self.fixed_shapes else 0)
        host = PrefillBuffers.pack((rows, wide), self.pad_id, self.scratch, slots, prompts, starts, last)
        dev = self.device
        sampling = any(not q.greedy for q in params)
        with torch.inference_mode(), self._device():
            index = torch.tensor(list(slots), dtype=torch.long, device=dev)
            row_values = {
                self.max_tokens: [q.max_tokens for q in params],
                self.stop_at_eos: [not q.ignore_eos for q in params],
                self.temperature: [1.0 if q.greedy else float(q.temperature) for q in params],
                self.top_p: [1.0 if q.greedy else float(q.top_p) for q in params],
                self.seed: [choice_key(q) for q in params],
                # a resumed (preempted) sequence counts on from its made tokens, so its length end and seeded
                # draws match an unpaused run
                self.count: [q.resumed for q in params],
            }
            for tensor, values in row_values.items():
                tensor[index] = torch.tensor(values, dtype=tensor.dtype).to(dev)
            self.done[index] = False
            self.pieces.load(host)
            table = self.chunk_graphs if continued else self.prefill_graphs
            graph = table.get((rows, wide, sampling)) if shape is not None else None
            if graph is not None:
                graph.replay()
            else:
                self._prefill_step(rows, wide, sampling, span)
            return self.out[index].tolist(), self.done[index].tolist()

    def _prefill_step(self, rows: int, wide: int, sampling: bool, span: int = 0) -> None:
        """Prefill the first `rows` buffered pieces at width `wide` (capturable); `span` > 0 also attends to the
        slot's first `span` positions (earlier pieces)."""
        buffers = self.pieces
        ids, lengths, where = buffers.ids[:rows, :wide], buffers.length[:rows], buffers.slot[:rows]
        start, ends = buffers.start[:rows], buffers.last[:rows]
        at = self.positions[:wide]
        if span:
            pos = start[:, None] + at[None, :]  # each query's position in its sequence
            keys = self.positions[:span]
            allowed = (keys[None, None, :] <= pos[:, :, None]) & (
                keys[None, None, :] < (start + lengths)[:, None, None]
            )
            self.cache.continuation(where, pos.clamp(max=self.slot_tokens - 1), span)
        else:
            pos = at[None, :].expand(rows, wide)
            allowed = (at[None, :] <= at[:, None])[None] & (at[None, None, :] < lengths[:, None, None])
            self.cache.prefill(where)
        last = self._forward(ids, allowed[:, None], pos)[torch.arange(rows, device=ids.device), lengths - 1]
        logits = self.head(last).float()
        self._advance(where, self._pick(logits, where, sampling), ends)
        self.pos[where] = start + lengths

    def release(self, slots: Sequence[int]) -> None:
        """Hold these slots' rows still (their sequences were cancelled or ended)."""
        if slots:
            with torch.inference_mode(), self._device():
                self.done[torch.tensor(list(slots), dtype=torch.long, device=self.device)] = True

    def move(self, sources: Sequence[int], targets: Sequence[int], span: int) -> None:
        """Move sequences to free slots (first `span` cache positions and row state), leaving the sources held.
        Stream-ordered after any step in flight, so what that step writes moves too."""
        if not sources:
            return
        with torch.inference_mode(), self._device():
            src = torch.tensor(list(sources), dtype=torch.long, device=self.device)
            dst = torch.tensor(list(targets), dtype=torch.long, device=self.device)
            for buffers in (self.cache.keys, self.cache.values):
                for layer in buffers:
                    layer[dst, :, :span] = layer[src, :, :span]
            for name in ROW_STATE:
                row = getattr(self, name)
                row[dst] = row[src]
            self.done[src] = True

    def swap(self, a: int, b: int, span: int) -> None:
        """Swap two live sequences' slots through the scratch slot (no step reads it)."""
        self.move([a], [self.scratch], span)
        self.move([b], [a], span)
        self.move([self.scratch], [b], span)

    # -- warm-up ------------------------------------------------------------------------------------------
    def warm(self) -> float:
        """Capture the graphs on CUDA (a failed capture falls back to eager), then time a full step (best of
        three) for the engine's first wait predictions."""
        started = time.monotonic()
        if self.use_graphs:
            try:
                self._capture()
            except Exception:  # serve eagerly rather than not at all; the log says why
                log.exception("capturing the decode steps failed: generation runs them eagerly (slower)")
                for table in (self.graphs, self.prefill_graphs, self.chunk_graphs):
                    table.clear()
                self.use_graphs = self.fixed_shapes = False
                torch.cuda.synchronize(self.device)
        with torch.inference_mode(), self._device():
            self.done.fill_(True)
            self.pos.zero_()
            span = min(self.slot_tokens, 256)
            timings: dict[int, list[float]] = {self.slots: [], 1: [], 2: []}
            for _ in range(3):
                for rows in timings if self.slots > 2 else (self.slots,):
                    t0 = time.perf_counter()
                    self.collect(self.launch(rows, span, False))
                    timings[rows].append(time.perf_counter() - t0)
        self.step_times = {self.shape(rows, span)[0]: min(times) for rows, times in timings.items() if times}
        if self.slots > 2:
            self.row_growth = max(0.0, min(timings[2]) / min(timings[1]) - 1)
        log.info(
            "%s for %d slots x %d tokens on %s in %.1f s (KV %.2f GB, %.1f ms a full step, a second row adds %.0f%%)",
            warm_summary(self.use_graphs, len(self.graphs), len(self.prefill_graphs) + len(self.chunk_graphs)),
            self.slots,
            self.slot_tokens,
            self.device,
            time.monotonic() - started,
            self.cache.nbytes / 1e9,
            min(timings[self.slots]) * 1000,
            self.row_growth * 100,
        )
        return min(timings[self.slots])

    def _capture(self) -> None:
        """Warm the kernels on a side stream (as the PyTorch docs do), then capture every bucket into one memory
        pool, safe to share: every graph writes only the decoder's own buffers and a device runs one at a time."""

        # (graph table, the function captured, its shapes); the prefill buffers hold padding: scratch slot, length 1
        def continued(rows: int, wide: int, sampling: bool) -> None:
            self._prefill_step(rows, wide, sampling, self.slot_tokens)

        kinds = (
            (self.graphs, self._decode_step, self.shapes()),
            (self.prefill_graphs, self._prefill_step, self.prefill_shapes()),
            (self.chunk_graphs, continued, self.prefill_shapes(continued=True)),
        )
        todo = [(table, run, (a, b, g)) for table, run, shapes in kinds for a, b in shapes for g in (False, True)]
        with torch.inference_mode(), self._device():
            pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _, run, key in todo:
                    run(*key)
            torch.cuda.current_stream(self.device).wait_stream(side)
            for table, run, key in todo:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    run(*key)
                table[key] = graph
            torch.cuda.current_stream(self.device).synchronize()
