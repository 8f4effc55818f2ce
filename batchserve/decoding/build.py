"""What the decoding engine is built from: its configuration (from the server's settings), the sampling defaults
a model's generation_config.json sets, and the stepper it runs on, sized to the device.

Why apart from `engine.py`: this is read once at start (and by the benches and tests that build a stepper
alone); the engine's loop never calls it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchserve.config import Settings
from batchserve.decoding.shares import BATCH_BESIDE_INTERACTIVE
from batchserve.decoding.sizing import auto_gpu_slots, kv_tokens_for
from batchserve.decoding.stepper import GPU_MEMORY_SHARE, Stepper

UNKNOWN_TOKEN_CHARS = 1 << 30  # a tokenizer without a vocabulary to measure: no bound from characters
CPU_KV_TOKENS = 16384  # KV capacity on a CPU when none is configured (~720 MB for SmolLM2 in float32)
# Prompt tokens per prefill forward on a CPU: bounds what decodes and a newly arriving chat wait on it (a forward
# is never cut); 256 rather than 512 made short chats beside long prompts much faster, long prompts no slower.
CPU_MAX_BATCH_TOKENS = 256
GPU_MAX_BATCH_TOKENS = 8192  # the same on a GPU
MANAGER_GPU_SEQS = 256  # transformers' manager on a GPU when none is configured (host-bound past that)


def enabled(settings: Settings) -> bool:
    """Generation runs with the real model, or when asked for: the sim server stays light."""
    if settings.generation != "auto":
        return settings.generation == "on"
    return any(spec.generates for spec in settings.models)


@dataclass
class EngineConfig:
    model_id: str = "SmolLM2-135M-Instruct"
    backend: str = "smollm2"  # the served model's backend: smollm2, or hf for a causal LM folder (`--model`)
    max_tokens: int = 512  # cap on a request's max_tokens, and its default
    kv_tokens: int = 0  # KV capacity in tokens; 0 = auto (GPU: from free memory, CPU: CPU_KV_TOKENS)
    max_seqs: int = 0  # sequences decoding at once; 0 = auto (what the KV budget holds: slot_plan)
    max_context: int = 2048  # slot stepper: tokens of one sequence (prompt + max_tokens)
    max_batch_tokens: int = 0  # prompt tokens per prefill forward; 0 = auto
    page_size: int = 32  # manager stepper: tokens per KV block, the granularity of reservations
    queue_timeout_s: float = 30.0  # longest wait for KV capacity before a sequence starts
    max_waiting: int = 1000  # sequences waiting for capacity before 503
    cuda_graphs: bool = True  # on CUDA, decode steps are replayed as CUDA graphs
    stepper: str = "slots"  # slots (batchserve's) or manager (transformers')
    batch_beside_interactive: float = BATCH_BESIDE_INTERACTIVE  # of the places, batch lines' beside interactive work
    batch_slowdown: float = 1.25  # the most batch rows may lengthen an interactive decode step (with / without)
    defaults: SamplingDefaults = field(default_factory=lambda: SamplingDefaults())  # the model's own

    @classmethod
    def from_settings(cls, s: Settings) -> EngineConfig:
        return cls(
            model_id=s.generation_model,
            # As `generation_folder` picks what to load: a causal LM folder, else smollm2's weights.
            backend=next((m.backend for m in s.models if m.generates), "smollm2"),
            max_tokens=s.generation_max_tokens,
            kv_tokens=s.generation_kv_tokens,
            max_seqs=s.generation_max_seqs,
            max_context=s.generation_max_context,
            queue_timeout_s=s.generation_queue_timeout_ms / 1000,
            max_waiting=s.max_queue,
            cuda_graphs=s.generation_cuda_graphs,
            stepper=s.generation_engine,
            batch_beside_interactive=s.generation_batch_beside_interactive,
            batch_slowdown=s.generation_batch_slowdown,
        )


@dataclass(frozen=True)
class SamplingDefaults:
    """A request's temperature / top_p if left out: the model's generation_config.json (as vLLM), else OpenAI's 1."""

    temperature: float = 1.0
    top_p: float = 1.0
    source: str = "OpenAI's (the model's generation_config.json sets none)"
    ignored: tuple[str, ...] = ()  # what the config sets that the steppers cannot apply (top_k, ...)

    def describe(self) -> str:
        ignored = f"; ignored: {', '.join(self.ignored)}" if self.ignored else ""
        return f"temperature={self.temperature:g} top_p={self.top_p:g} from {self.source}{ignored}"


def sampling_defaults(model: Any) -> SamplingDefaults:
    """generation_config.json as request defaults, read as vLLM does (not do_sample); top_k & co logged as ignored."""
    try:
        diff = model.generation_config.to_diff_dict()
    except Exception:  # noqa: BLE001 - none, or an odd config: OpenAI's defaults
        diff = {}
    ignored = tuple(f"{k}={diff[k]}" for k in ("top_k", "min_p", "repetition_penalty") if k in diff)
    if "temperature" not in diff and "top_p" not in diff:
        return SamplingDefaults(ignored=ignored)
    return SamplingDefaults(
        float(diff.get("temperature", 1.0)),
        float(diff.get("top_p", 1.0)),
        "the model's generation_config.json",
        ignored,
    )


def slot_plan(
    cfg: EngineConfig, on_gpu: bool, free_bytes: int, bytes_per_token: int, max_position: int
) -> tuple[int, int]:
    """(slots, tokens per slot): `max_context` within the model's positions, and as many slots as asked, else as
    the KV budget holds (`kv_tokens`, else GPU_MEMORY_SHARE of free memory or CPU_KV_TOKENS; on a GPU capped by
    `sizing.auto_gpu_slots`)."""
    slot_tokens = max(16, min(cfg.max_context, max_position))
    kv_tokens = cfg.kv_tokens or (
        kv_tokens_for(free_bytes, GPU_MEMORY_SHARE, bytes_per_token) if on_gpu else CPU_KV_TOKENS
    )
    fit = kv_tokens // slot_tokens
    slots = min(cfg.max_seqs, fit) if cfg.max_seqs else auto_gpu_slots(fit) if on_gpu else fit
    return max(1, slots), slot_tokens


def end_tokens(model: Any, tokenizer: Any) -> list[int]:
    """The tokens that end a sequence: the tokenizer's end of sequence and the model's generation config's
    (a list for some models: Llama 3 ends a turn with <|eot_id|>)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    found = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    return sorted({t for t in (tokenizer.eos_token_id, *found) if isinstance(t, int)})


def build_stepper(model: Any, tokenizer: Any, cfg: EngineConfig) -> Stepper:
    """The configured stepper on `model`, warmed (CUDA graphs captured) and ready to start."""
    on_gpu = model.device.type == "cuda"
    max_batch_tokens = cfg.max_batch_tokens or (GPU_MAX_BATCH_TOKENS if on_gpu else CPU_MAX_BATCH_TOKENS)
    if cfg.stepper == "manager":
        from batchserve.decoding.manager_stepper import ManagerStepper, build_manager, warm

        max_seqs = cfg.max_seqs or (MANAGER_GPU_SEQS if on_gpu else 64)
        manager = build_manager(
            model,
            tokenizer,
            cfg.max_tokens,
            cfg.kv_tokens or (0 if on_gpu else CPU_KV_TOKENS),
            cfg.page_size,
            max_seqs,
            max_batch_tokens,
            cfg.cuda_graphs,
        )
        manager.start()
        return ManagerStepper(manager, cfg.page_size, max_seqs, warm(manager, tokenizer))
    import torch

    from batchserve.decoding.slot_decoder import SlotDecoder
    from batchserve.decoding.slot_stepper import SlotStepper

    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * model.dtype.itemsize
    free = torch.cuda.mem_get_info(model.device)[0] if on_gpu else 0
    slots, slot_tokens = slot_plan(cfg, on_gpu, free, per_token, int(getattr(c, "max_position_embeddings", 8192)))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = end_tokens(model, tokenizer)
    decoder = SlotDecoder(
        model, slots, slot_tokens, eos, pad, use_graphs=cfg.cuda_graphs and on_gpu, prefill_tokens=max_batch_tokens
    )
    return SlotStepper(decoder, decoder.warm(), slowdown=cfg.batch_slowdown)


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of this tokenizer stands for (byte-level BPE: one per byte at most)."""
    try:
        return max(1, max(map(len, tokenizer.get_vocab()), default=UNKNOWN_TOKEN_CHARS))
    except Exception:  # noqa: BLE001 - a tokenizer that cannot list its vocabulary: no bound from characters
        return UNKNOWN_TOKEN_CHARS
