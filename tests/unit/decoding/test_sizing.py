"""Rows to the memory (issue 25) without a device or a model: the slot count and KV budget from made-up free-memory
figures, the row buckets up to it (the per-step prefill plan: test_prefill_share.py). The decoder prefilling in
pieces, on a 2-layer random Llama, is tests/integration/decoding/test_sizing.py."""

from __future__ import annotations

from batchserve.decoding.build import EngineConfig, slot_plan
from batchserve.decoding.sizing import GPU_MAX_SEQS, auto_gpu_slots, kv_tokens_for, row_buckets

GB = 10**9
SMOLLM2_TOKEN = 30 * 2 * 3 * 64 * 2  # bytes of K and V a token: 30 layers x K,V x 3 heads x 64 x bf16 = 23,040


def test_slots_follow_the_free_memory() -> None:
    """SmolLM2 at 2,048 tokens a slot: an H200 (~138 GB free) gets over 1,024 rows, an H100 (~79 GB) over
    800, a small card what half its memory holds; never more than GPU_MAX_SEQS."""
    gpu = True
    h200 = slot_plan(EngineConfig(), gpu, 138 * GB, SMOLLM2_TOKEN, 8192)
    # 138e9 / 2 / 23,040 = 2,994,791 tokens = 1,462 slots of 2,048, rounded down to a multiple of 64
    assert h200 == (1408, 2048)
    assert slot_plan(EngineConfig(), gpu, 79 * GB, SMOLLM2_TOKEN, 8192) == (832, 2048)
    assert slot_plan(EngineConfig(), gpu, 4 * GB, SMOLLM2_TOKEN, 8192) == (42, 2048)  # under 64: as many as fit
    assert slot_plan(EngineConfig(), gpu, 10_000 * GB, SMOLLM2_TOKEN, 8192)[0] == GPU_MAX_SEQS
    # shorter contexts, more slots from the same memory
    assert slot_plan(EngineConfig(max_context=1024), gpu, 79 * GB, SMOLLM2_TOKEN, 8192) == (1664, 1024)
    # asked for: kept when the memory holds them, cut to what it holds when not
    assert slot_plan(EngineConfig(max_seqs=1024), gpu, 138 * GB, SMOLLM2_TOKEN, 8192) == (1024, 2048)
    assert slot_plan(EngineConfig(max_seqs=1024), gpu, 79 * GB, SMOLLM2_TOKEN, 8192) == (837, 2048)
    # an explicit KV budget wins over the free memory
    assert slot_plan(EngineConfig(kv_tokens=2048 * 300), gpu, 138 * GB, SMOLLM2_TOKEN, 8192) == (256, 2048)


def test_auto_slots_round_down_and_cap() -> None:
    assert [auto_gpu_slots(n) for n in (0, 1, 63, 64, 127, 1462, 5000)] == [1, 1, 63, 64, 64, 1408, GPU_MAX_SEQS]
    assert kv_tokens_for(138 * GB, 0.5, SMOLLM2_TOKEN) == 2_994_791
    assert kv_tokens_for(GB, 0.5, 0) == GB // 2  # no division by zero on a degenerate model config


def test_row_buckets_reach_the_slots() -> None:
    assert row_buckets(1408) == [1, 8, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 1408]
    assert row_buckets(20) == [1, 8, 16, 20]
    assert row_buckets(2048)[-3:] == [1024, 1536, 2048]
