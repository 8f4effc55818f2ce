"""transformers' `ContinuousBatchingManager` as a stepper (`--generation-engine manager`), kept beside the slot
stepper so the two can be measured side by side (`bench/cb_compare.py`).

Every sequence is submitted `streaming=True`, so the loop sees each token as it is made. The manager samples
greedily; the per-request processors of `sampling.py` turn the argmax into each request's own draw.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from batchserve.decoding.stepper import GPU_MEMORY_SHARE, KvCapacity, Deliver, SamplingParams, TokenUpdate


def processor_kwargs(params: SamplingParams) -> dict[str, Any]:
    """Per-request arguments of the manager's logits processors (see sampling.py)."""
    from batchserve.decoding import sampling  # torch: imported only where generation runs

    greedy = params.greedy
    return {
        "temperature": 1.0 if greedy else float(params.temperature),
        "top_p": 1.0 if greedy else float(params.top_p),
        sampling.SEED_KEY: sampling.choice_key(params),
    }


def build_manager(
    model: Any,
    tokenizer: Any,
    max_tokens: int,
    kv_tokens: int,
    page_size: int,
    max_seqs: int,
    max_batch_tokens: int,
    cuda_graphs: bool,
) -> Any:
    """A ready (not started) manager with per-request temperature, top_p, greedy and seed."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from batchserve.decoding import sampling

    on_cpu = model.device.type == "cpu"
    generation_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    cb_config = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=math.ceil(kv_tokens / page_size) if kv_tokens else None,
        max_batch_tokens=max_batch_tokens or None,
        max_memory_percent=None if on_cpu else GPU_MEMORY_SHARE,
        max_requests_per_batch=max_seqs,
        safety_margin=0.0,  # admission already guarantees every admitted sequence's worst case fits
        per_request_processors=True,
        # On CUDA the step (forward, our sampling, the pick) is replayed as a CUDA graph, one per padded shape;
        # the library would leave graphs off with SDPA (its masks make the padding cost more).
        use_cuda_graph=False if on_cpu else cuda_graphs,
    )
    manager = model.init_continuous_batching(generation_config=generation_config, continuous_batching_config=cb_config)
    manager.logit_processor = sampling.processors(sync_free=not on_cpu)
    manager.warmup()  # builds the cache and batch processor (and CUDA graphs where used)
    return manager


def warm(manager: Any, tokenizer: Any, tokens: int = 8) -> float:
    """Run one short greedy request to the end; return the time per decode step it showed."""
    ids = list(tokenizer("Hello, how are you?", add_special_tokens=False)["input_ids"])
    kwargs = processor_kwargs(SamplingParams(max_tokens=tokens, temperature=0))
    request_id = manager.add_request(
        ids, request_id="warmup", max_new_tokens=tokens, streaming=True, eos_token_id=-1, **kwargs
    )
    first = None
    for out in manager.request_id_iter(request_id):
        if first is None and out.generated_tokens:
            first = time.monotonic()
        if out.is_finished():
            if out.error:
                raise RuntimeError(f"warm-up generation failed: {out.error}")
            break
    if first is None:
        raise RuntimeError("warm-up generation produced nothing")
    return max(1e-4, (time.monotonic() - first) / (tokens - 1))


class ManagerStepper:
    """The manager behind the `Stepper` interface: cumulative outputs become new tokens."""

    def __init__(self, manager: Any, page_size: int, max_seqs: int, step_s: float) -> None:
        self.manager = manager
        blocks = int(manager.batch_processor.cache.num_blocks)
        self.capacity = KvCapacity(blocks, page_size, max_seqs, blocks * page_size)
        self.step_s = step_s
        self.row_growth = 0.0  # not measured: the share of the places alone bounds batch rows
        self.resumable = False  # its requests have no token offset to resume from: the engine never preempts here
        # the library runs every request in every step, so the engine bounds batch rows itself
        self.shares_steps = False
        self.description = f"transformers' ContinuousBatchingManager on {manager.model.device}"
        self._deliver: Deliver | None = None

    def start(self, loop: asyncio.AbstractEventLoop, deliver: Deliver) -> None:
        self._deliver = deliver  # the manager itself was started (and warmed) when it was built

    def add(
        self, seq_id: str, prompt_ids: list[int], params: SamplingParams, background: bool = False, tenant: str = ""
    ) -> None:
        """`background` and `tenant` are not used: the library's scheduler runs every request in every step."""
        seen = 0

        def on_output(out: Any) -> None:  # on the loop, via the library's call_soon_threadsafe
            nonlocal seen
            new = list(out.generated_tokens[seen:])
            seen += len(new)
            assert self._deliver is not None
            error = None if out.error is None else str(out.error)
            self._deliver([TokenUpdate(seq_id, new, out.is_finished() or error is not None, error)])

        self.manager.register_result_handler(seq_id, on_output)
        self.manager.add_request(
            prompt_ids,
            request_id=seq_id,
            max_new_tokens=params.max_tokens,
            streaming=True,
            eos_token_id=-1 if params.ignore_eos else None,
            **processor_kwargs(params),
        )

    def cancel(self, seq_id: str) -> None:
        self.manager.cancel_request(seq_id)
        router = self.manager.output_router  # the library drops a handler only on a finished output
        with router._lock:
            router.result_handlers.pop(seq_id, None)

    def is_running(self) -> bool:
        return bool(self.manager.is_running())

    def step_mix(self) -> dict[str, float]:
        return {}

    def kv_usage(self) -> float:
        """Share of the cache the library has in use."""
        cache = self.manager.batch_processor.cache if self.manager.batch_processor is not None else None
        return 0.0 if cache is None else 1.0 - cache.compute_free_capacity()

    def stop(self, timeout: float) -> None:
        self.manager.stop(block=True, timeout=timeout)
