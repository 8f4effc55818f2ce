"""The slot decoder's arithmetic without a model (issue 13): bucket sizes, the slot plan, when joins gather, the
device's step key. The decoder itself, on a 2-layer random Llama and on the real weights, is
tests/integration/decoding/test_slot_decoder.py."""

from __future__ import annotations

import random

import torch

from batchserve.decoding.build import EngineConfig, slot_plan
from batchserve.decoding.sampling import step_key
from batchserve.decoding.slot_decoder import bucket_up, device_step_key
from batchserve.decoding.slot_stepper import join_now


def test_device_step_key_is_the_hosts() -> None:
    rng = random.Random(3)
    pairs = [(rng.randrange(0, 2**31), rng.randrange(0, 5000)) for _ in range(200)] + [(2**31 - 1, 4999), (0, 0)]
    seeds = torch.tensor([s for s, _ in pairs])
    steps = torch.tensor([t for _, t in pairs])
    assert device_step_key(seeds, steps).tolist() == [step_key(s, t) for s, t in pairs]


def test_buckets_and_slot_plan() -> None:
    assert bucket_up(5, (1, 8, 16), 256) == 8 and bucket_up(17, (1, 8, 16), 12) == 12
    assert bucket_up(300, (128, 256, 512), 2048) == 512 and bucket_up(3000, (128, 256), 2048) == 2048
    mb = 1 << 20
    gpu, cpu = True, False
    # CPU, auto: what 16384 tokens hold at 2048 each
    assert slot_plan(EngineConfig(), cpu, 0, 100, 8192) == (8, 2048)
    # GPU, auto: what half the free memory holds, a multiple of 64 (the H200's and H100's:
    # tests/unit/decoding/test_sizing.py)
    assert slot_plan(EngineConfig(), gpu, 80_000 * mb, 23040, 8192) == (832, 2048)
    assert slot_plan(EngineConfig(), gpu, 2_000 * mb, 23040, 8192) == (22, 2048)
    # asked for: the model's positions and kv_tokens bound them
    assert slot_plan(EngineConfig(max_seqs=64, max_context=4096), gpu, 80_000 * mb, 23040, 1024) == (64, 1024)
    assert slot_plan(EngineConfig(max_seqs=64, kv_tokens=10_000, max_context=1000), cpu, 0, 1, 8192) == (10, 1000)


def test_joins_gather_while_others_run_and_start_at_once_when_none_do() -> None:
    # (waiting, room, live, waited steps, join batch, delay steps) -> how many to prefill now
    assert join_now(3, 10, 0, 0, 16, 8) == 3  # nothing running: at once
    assert join_now(3, 10, 50, 0, 16, 8) == 0  # others running: gather...
    assert join_now(3, 10, 50, 8, 16, 8) == 3  # ...until the oldest has waited 8 steps
    assert join_now(20, 30, 50, 0, 16, 8) == 20  # or a batch's worth waits and has room
    assert join_now(20, 10, 50, 0, 16, 8) == 0  # room for fewer than a batch: wait for more room...
    assert join_now(20, 10, 50, 9, 16, 8) == 10  # ...or the delay
    assert join_now(20, 0, 50, 99, 16, 8) == 0  # no room
    assert join_now(1, 4, 3, 0, 1, 8) == 1  # a join batch of 1 (few slots): never held back
