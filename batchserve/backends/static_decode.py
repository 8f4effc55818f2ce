"""Greedy batch decoding with a static KV cache: prefill once, then one decode step per token, and on CUDA every
decode step is one replay of a CUDA graph.

Why not `model.generate`: it is host-bound on a GPU (~600 small kernels launched one by one from Python per step,
plus the loop's bookkeeping: 18 ms a step where the arithmetic takes ~3.5 ms on an H200), and the CPU it needs is
the event loop's (the GIL). A replayed graph launches the whole step with one call that releases the GIL.

The model, its attention, `StaticCache` and mask building are transformers' own; its forward can be captured as
it is because everything a decode step reads stays on the device and data-dependent mask shortcuts are skipped
while capturing (`is_tracing`). The capture is ours (`torch.cuda.CUDAGraph`): `torch.compile(mode=
"reduce-overhead")` compiles per shape (minutes of warm-up, Triton needed) and still runs `generate`'s Python
loop. docs/gpu.md has the details.

Shapes: a graph is fixed to one batch size and one cache length, so batches are padded up to a batch bucket
(pad rows, finished from the start) and caches are sized by prompt bucket plus `max_new_tokens`. All graphs of a
device share one KV pool (a batch runs alone on its device) and one graph memory pool. A batch with no graph is
split into sub-batches that have one, or, past the longest bucket, decoded eagerly. On a CPU the same step runs
eagerly, with exact shapes.

Stopping: a row is finished at its first end-of-sequence token (later tokens are pads, as in `generate`); every
`check_every` steps the loop stops once every row is finished or `should_stop()` says so (all callers gone). On
a GPU a check reads the flags copied just before its own step was launched, so that step keeps the device busy
while the host, perhaps late by a GIL hand-over, reads them; the price is up to `check_every` extra steps.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger("batchserve.static_decode")

BATCH_BUCKETS = (1, 8, 16, 32, 64, 100)  # the batch is padded up to one of these (and to max_batch)
PROMPT_BUCKETS = (64, 128, 256, 512, 1024, 2048)  # prompt tokens; the chat template alone is ~30
GPU_CHECK_EVERY = 4  # decode steps between "all finished?" checks on a GPU (each is a host sync)

StopCheck = Callable[[], bool]


class FlagsCopy(Protocol):
    """A copy of the finished flags on its way to the host (a CUDA event behind it), or one already made."""

    def synchronize(self) -> None: ...


class MadeAlready:
    """The copy was made at once (a CPU): nothing to wait for."""

    def synchronize(self) -> None:
        return None


def bucket_up(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding n, or None when n is past the largest."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """BATCH_BUCKETS up to max_batch, with max_batch itself as the last."""
    return tuple(sorted({b for b in BATCH_BUCKETS if b < max_batch} | {max_batch}))


@dataclass(frozen=True, order=True)
class Shape:
    """One graph's shapes: rows in the batch, and cache slots (prompt bucket + new tokens)."""

    batch: int
    cache_len: int


class KvPool:
    """One K and one V buffer per layer for the largest captured shape; every shape's cache is a view of its
    front, safe because a device runs one batch at a time."""

    def __init__(self, config: Any, tokens: int, dtype: torch.dtype, device: torch.device) -> None:
        self.heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.tokens = tokens
        n = tokens * self.heads * self.head_dim
        self.buffers = [
            (torch.zeros(n, dtype=dtype, device=device), torch.zeros(n, dtype=dtype, device=device))
            for _ in range(config.num_hidden_layers)
        ]

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.buffers)

    def views(self, layer: int, shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
        n = shape.batch * self.heads * shape.cache_len * self.head_dim
        k, v = self.buffers[layer]
        size = (shape.batch, self.heads, shape.cache_len, self.head_dim)
        return k[:n].view(size), v[:n].view(size)


def static_cache(model: Any, shape: Shape, pool: KvPool | None) -> Any:
    """transformers' StaticCache for `shape`, its layers bound to views of `pool` (without one, the library's)."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    cache = StaticCache(config=model.config, max_cache_len=shape.cache_len)
    if pool is None:
        return cache
    for i, layer in enumerate(cache.layers):
        if type(layer) is not StaticLayer:  # a sliding or hybrid layer: let the library size it
            return StaticCache(config=model.config, max_cache_len=shape.cache_len)
        layer.keys, layer.values = pool.views(i, shape)
        # What StaticLayer.lazy_initialization sets, with our views instead of fresh tensors.
        layer.device = layer.keys.device
        layer.batch_size, layer.num_heads = shape.batch, pool.heads
        layer.k_head_dim = layer.v_head_dim = pool.head_dim
        layer.cumulative_length = layer.cumulative_length.to(layer.device)
        layer.is_initialized = True
    return cache


class Runner:
    """The static buffers of one shape and the decode step over them (eager, or captured once and replayed)."""

    def __init__(
        self, model: Any, shape: Shape, max_new: int, eos_ids: Sequence[int], pad_id: int, pool: KvPool | None
    ) -> None:
        dev = model.device
        self.model, self.shape, self.max_new, self.pad_id = model, shape, max_new, pad_id
        self.cache = static_cache(model, shape, pool)
        b = shape.batch
        self.ids = torch.full((b, 1), pad_id, dtype=torch.long, device=dev)  # this step's input token
        self.pos = torch.zeros((b, 1), dtype=torch.long, device=dev)  # its position id
        self.mask = torch.zeros((b, shape.cache_len), dtype=torch.bool, device=dev)  # cache slots to attend to
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)  # the cache slot this step writes
        self.step = torch.zeros(1, dtype=torch.long, device=dev)  # the token index this step writes
        self.tokens = torch.full((b, max_new), pad_id, dtype=torch.long, device=dev)
        self.done = torch.zeros(b, dtype=torch.bool, device=dev)
        self.eos = torch.tensor(list(eos_ids), dtype=torch.long, device=dev)
        self.pad = torch.tensor(pad_id, dtype=torch.long, device=dev)
        self.graph: Any = None  # torch.cuda.CUDAGraph once captured
        self.lagged = self.done.is_cuda  # a check reads the flags of the step before its own (module doc)
        self.done_host = torch.zeros(b, dtype=torch.bool, pin_memory=self.done.is_cuda)

    def prefill(self, prompts: Sequence[Sequence[int]], finished: Sequence[bool] = ()) -> None:
        """Run the left-padded prompts in one forward; each row's first new token is the next step's input.
        Positions and masks are what `generate` builds (pads are not counted nor attended to)."""
        b, dev = self.shape.batch, self.model.device
        width = max(len(p) for p in prompts)
        if len(prompts) != b or width + self.max_new > self.shape.cache_len:
            raise ValueError(f"{len(prompts)} prompts of up to {width} tokens do not fit {self.shape}")
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        seen = torch.zeros((b, width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            seen[row, width - len(p) :] = 1
        positions = (seen.cumsum(-1) - 1).masked_fill(seen == 0, 0)
        self.cache.reset()
        self.mask.zero_()
        self.mask[:, :width] = seen.bool().to(dev)
        out = self.model(
            input_ids=ids.to(dev),
            attention_mask=self.mask,
            position_ids=positions.to(dev),
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        first = out.logits[:, -1].argmax(-1)
        self.tokens.fill_(self.pad_id)
        self.tokens[:, 0] = first
        self.ids.copy_(first[:, None])
        self.pos.copy_(positions[:, -1:].to(dev) + 1)
        self.slot.fill_(width)
        self.step.fill_(1)
        self.done.copy_(self._is_eos(first))
        if any(finished):
            self.done |= torch.tensor(list(finished), dtype=torch.bool).to(dev)

    def _is_eos(self, tok: torch.Tensor) -> torch.Tensor:
        return (tok[:, None] == self.eos[None, :]).any(-1)

    def decode_step(self) -> None:
        """One token for every row, reading and writing only this runner's tensors (so it can be captured)."""
        self.mask.index_fill_(1, self.slot, True)
        out = self.model(
            input_ids=self.ids, attention_mask=self.mask, position_ids=self.pos, cache=self.cache, use_cache=True
        )
        tok = out.logits[:, -1].argmax(-1)
        tok = torch.where(self.done, self.pad, tok)
        self.tokens.index_copy_(1, self.step, tok[:, None])
        self.done |= self._is_eos(tok)
        self.ids.copy_(tok[:, None])
        self.pos.add_(1)
        self.slot.add_(1)
        self.step.add_(1)

    def capture(self, graph_pool: Any) -> None:
        """Record `decode_step` as a CUDA graph, its kernels warmed on a side stream first (as the PyTorch docs
        do); thread-local mode, so another thread's CUDA calls (the generation engine's) cannot break it."""
        dummy = [[self.pad_id]] * self.shape.batch
        self.prefill(dummy)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.decode_step()
        torch.cuda.current_stream().wait_stream(side)
        self.prefill(dummy)  # the warm-up steps moved the counters: start the capture from a clean state
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=graph_pool, capture_error_mode="thread_local"):
            self.decode_step()
        torch.cuda.current_stream().synchronize()
        self.graph = graph

    def step_once(self) -> None:
        """One decode step: the graph's replay (one launch, interpreter lock released) or the eager step."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self.decode_step()

    def snapshot_finished(self) -> FlagsCopy:
        """Queue a copy of the rows' finished flags to the host, for `all_finished` to wait for and read."""
        if not self.done.is_cuda:
            self.done_host.copy_(self.done)
            return MadeAlready()
        self.done_host.copy_(self.done, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return event

    def all_finished(self, snapshot: FlagsCopy) -> bool:
        """Whether every row had finished when `snapshot` was taken (waits for it with the lock released)."""
        snapshot.synchronize()
        return bool(self.done_host.all())

    def finish(self, steps: int) -> list[list[int]]:
        """Every row's tokens of the steps run, once the device is done with them."""
        if self.tokens.is_cuda:  # wait for the last steps with the interpreter lock released (tolist holds it)
            torch.cuda.current_stream().synchronize()
        return self.tokens[:, :steps].tolist()

    def run(
        self,
        prompts: Sequence[Sequence[int]],
        finished: Sequence[bool],
        check_every: int,
        should_stop: StopCheck | None,
        min_tokens: int = 0,
    ) -> tuple[list[list[int]], int]:
        """Decode a batch; the tokens of each row (all max_new of them, pads after its end) and the steps run.
        Lagged (`self.lagged`), a check reads the flags copied before its own step (module doc)."""
        self.prefill(prompts, finished)
        steps = 1
        while steps < self.max_new:
            checks = (steps + 1) % check_every == 0 and steps + 1 >= min_tokens and steps + 1 < self.max_new
            earlier = self.snapshot_finished() if checks and self.lagged else None
            self.step_once()
            steps += 1
            if checks:
                snapshot = earlier if earlier is not None else self.snapshot_finished()
                if self.all_finished(snapshot) or (should_stop is not None and should_stop()):
                    break
        return self.finish(steps), steps


def cut_at_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """A row's tokens up to and including its first end-of-sequence token."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: i + 1]
    return tokens


class StaticDecoder:
    """Greedy decoding of token-id batches on one model replica (one device), one batch at a time."""

    def __init__(
        self,
        model: Any,
        max_new_tokens: int,
        eos_ids: Sequence[int],
        pad_id: int,
        max_batch: int = 100,
        kv_tokens: int = 0,
        use_graphs: bool | None = None,
        fixed_shapes: bool | None = None,
        prompt_buckets: Sequence[int] = PROMPT_BUCKETS,
    ) -> None:
        """`fixed_shapes` (default: with graphs, i.e. on CUDA) pads to the buckets and keeps one runner per shape
        over a shared KV pool; off: exact shapes, buffers made per batch."""
        self.model = model
        self.device = model.device
        self.max_new = max(1, max_new_tokens)
        self.eos_ids = sorted({int(e) for e in eos_ids})
        self.pad_id = int(pad_id)
        self.max_batch = max_batch
        self.batch_buckets = batch_buckets(max_batch)
        self.prompt_buckets = tuple(prompt_buckets)
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.fixed_shapes = self.use_graphs if fixed_shapes is None else fixed_shapes or self.use_graphs
        # KV budget in cache slots (rows x slots): by default every batch bucket up to 1024-token prompts.
        self.kv_tokens = kv_tokens or max_batch * (
            self.prompt_buckets[min(4, len(self.prompt_buckets) - 1)] + self.max_new
        )
        self.check_every = GPU_CHECK_EVERY if self.device.type == "cuda" else 1
        self.runners: dict[Shape, Runner] = {}  # the fixed shapes, made by warm()
        self.pool: KvPool | None = None
        self.graph_pool: Any = None

    # -- shapes -------------------------------------------------------------------------------------------
    def cache_len(self, prompt_len: int) -> int:
        """Cache slots for a longest prompt of `prompt_len` tokens: exact on a CPU, else its prompt bucket
        (rounded up to 256 past the last one) plus the new tokens."""
        if not self.fixed_shapes:
            return prompt_len + self.max_new
        bucket = bucket_up(prompt_len, self.prompt_buckets) or -(-prompt_len // 256) * 256
        return bucket + self.max_new

    def graphed_shapes(self) -> list[Shape]:
        """Every (batch bucket, prompt bucket) shape whose cache fits the KV budget."""
        return [
            Shape(b, p + self.max_new)
            for p in self.prompt_buckets
            for b in self.batch_buckets
            if b * (p + self.max_new) <= self.kv_tokens
        ]

    def plan(self, n: int, cache_len: int) -> tuple[int, bool]:
        """How many rows go in one run, and whether a fixed shape's runner takes them: the smallest bucket
        holding n, else the largest made for this cache length (split), else as many as the KV budget fits."""
        if self.fixed_shapes:
            made = [s.batch for s in self.runners if s.cache_len == cache_len]
            if made:
                fit = [b for b in made if b >= n]
                return (min(fit) if fit else max(made)), True
        return max(1, min(n, self.kv_tokens // cache_len)), False

    # -- life ---------------------------------------------------------------------------------------------
    def warm(self) -> None:
        """Make the runner of every fixed shape over one KV pool and capture its decode step on CUDA, only once
        (warm-up rounds repeat, and a capture costs seconds)."""
        if not self.fixed_shapes or self.runners:
            return
        shapes = self.graphed_shapes()
        started = time.monotonic()
        context = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with torch.inference_mode(), context:
            self.pool = KvPool(
                self.model.config, max(s.batch * s.cache_len for s in shapes), self.model.dtype, self.device
            )
            if self.use_graphs:
                self.graph_pool = torch.cuda.graph_pool_handle()
            for shape in shapes:
                runner = Runner(self.model, shape, self.max_new, self.eos_ids, self.pad_id, self.pool)
                if self.use_graphs:
                    runner.capture(self.graph_pool)
                self.runners[shape] = runner
        log.info(
            "%s %d decode shapes on %s in %.1f s (batch buckets %s, cache lengths %s, KV pool %.2f GB)",
            "captured" if self.use_graphs else "made",
            len(shapes),
            self.device,
            time.monotonic() - started,
            self.batch_buckets,
            sorted({s.cache_len for s in shapes}),
            self.pool.nbytes / 1e9,
        )

    def generate(
        self, prompts: Sequence[Sequence[int]], should_stop: StopCheck | None = None, min_tokens: int = 0
    ) -> list[list[int]]:
        """Each prompt's new tokens, up to and including its end-of-sequence token. `should_stop` is asked between
        steps; `min_tokens` keeps the loop going that many steps even if every row has ended (benchmarks)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        cache_len = self.cache_len(max(len(p) for p in prompts))
        out: list[list[int]] = []
        eos = set(self.eos_ids)
        context = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with torch.inference_mode(), context:
            start = 0
            while start < len(prompts):
                rows, fixed = self.plan(len(prompts) - start, cache_len)
                part = list(prompts[start : start + rows])
                shape = Shape(rows if fixed else len(part), cache_len)
                runner = (
                    self.runners[shape]
                    if fixed
                    else Runner(self.model, shape, self.max_new, self.eos_ids, self.pad_id, None)
                )
                filler = shape.batch - len(part)
                tokens, _ = runner.run(
                    part + [[self.pad_id]] * filler,
                    [False] * len(part) + [True] * filler,
                    self.check_every,
                    should_stop,
                    min_tokens,
                )
                out.extend(cut_at_eos(t, eos) for t in tokens[: len(part)])
                start += len(part)
                if should_stop is not None and start < len(prompts) and should_stop():
                    out.extend([] for _ in prompts[start:])
                    break
        return out
