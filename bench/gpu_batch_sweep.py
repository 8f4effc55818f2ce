"""Batch time vs batch size for the static batchstring path (what `/v1/inference` runs on the real model).

Why: the batcher learns S (the batch time) from the batches it runs and paces dispatch S/G apart; on a GPU,
S grows with batch size, and this sweep shows by how much. One greedy `generate` of `--new-tokens` tokens per
batch over prompts of `--prompt-len` random ids, with SmolLM2-135M's architecture and random weights (the real
weights cannot travel to the GPU machine). Needs only torch and transformers (reuses bench/cb_compare.py).

    python bench/gpu_batch_sweep.py --device cuda --out sweep.md
    python bench/gpu_batch_sweep.py --device cpu --tiny --sizes 1,4     # a smoke test
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cb_compare import random_model, random_prompts, sync  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--sizes", default="1,8,32,64,100")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="")
    a = p.parse_args()
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    model = random_model(a.device, dtype, tiny=a.tiny)
    vocab = model.config.vocab_size
    rows = ["| batch size | batch time ms (median of %d) | ms per input | inputs/s | output tokens/s |" % a.repeats,
            "|---|---|---|---|---|"]
    for size in [int(s) for s in a.sizes.split(",")]:
        ids = torch.tensor(random_prompts(size, a.prompt_len, vocab), device=a.device)
        mask = torch.ones_like(ids)
        times = []
        for i in range(a.repeats + 1):  # the first run warms the kernels for this shape
            sync(a.device)
            t = time.perf_counter()
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=a.new_tokens,
                               min_new_tokens=a.new_tokens, do_sample=False, pad_token_id=2)
            sync(a.device)
            if i:
                times.append(time.perf_counter() - t)
        s = statistics.median(times)
        rows.append(f"| {size} | {s * 1000:.1f} | {s * 1000 / size:.2f} | {size / s:.0f} | "
                    f"{size * a.new_tokens / s:.0f} |")
    device_name = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu"
    text = (f"Static batch time vs batch size: greedy generate, {a.new_tokens} new tokens, prompts of "
            f"{a.prompt_len} ids, SmolLM2-135M architecture{' (tiny)' if a.tiny else ''}, random weights, "
            f"{device_name}, {dtype}\n\n" + "\n".join(rows) + "\n")
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
