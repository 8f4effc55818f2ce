"""Offline batch time by batch size: transformers `generate` (the old smollm2 path), our static decoder eager and
with CUDA graphs (the new path), and the shared anchor's graph loop, on one machine in one run (issue 13).

Every row decodes B prompts of `--prompt-len` random ids x `--new-tokens` tokens, end-of-sequence ignored so all
paths do the same work, SmolLM2-135M's architecture with random weights (bf16 on CUDA). The goal of issue 13:
a batch of 100 x 64 new tokens with graphs within 1.3 x the anchor's graph time. Needs torch and transformers
only (plus this repository's batchserve package).

    python bench/gpu_static_bench.py --out $OUT/static.md                  # on a GPU (gpu_check.sh runs it)
    python bench/gpu_static_bench.py --device cpu --tiny --sizes 1,4       # a CPU smoke test, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from functools import partial
from typing import Any
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from batchserve.backends.static_decode import StaticDecoder
from bench.cb_compare import machine, random_model, random_prompts, sync

NO_EOS = [-1]  # every row runs to the end


def timed(fn: Callable[[], Any], device: str, repeats: int) -> float:
    """Median seconds of fn() after one warm-up call."""
    fn()
    sync(device)
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        sync(device)
        runs.append(time.perf_counter() - started)
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model: a smoke test")
    p.add_argument("--sizes", default="1,8,32,64,100")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-generate", action="store_true")
    p.add_argument("--out", default="", help="write the table (markdown) here, and a .json beside it")
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    cuda = a.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = random_model(a.device, dtype, tiny=a.tiny)
    vocab = model.config.vocab_size
    new = a.new_tokens
    eager = StaticDecoder(model, new, NO_EOS, pad_id=0, max_batch=max(sizes), use_graphs=False)
    graphs = None
    if cuda:
        started = time.perf_counter()
        graphs = StaticDecoder(
            model, new, NO_EOS, pad_id=0, max_batch=max(sizes), prompt_buckets=(max(64, a.prompt_len),)
        )
        graphs.warm()
        print(f"captured {len(graphs.runners)} graphs in {time.perf_counter() - started:.1f} s", flush=True)
    anchor = None
    if cuda:
        from bench.anchor.gpu_anchor_decode import run_mini

        anchor = run_mini
    rows = []
    for size in sizes:
        prompts = random_prompts(size, a.prompt_len, vocab, seed=size)
        row: dict[str, Any] = {"batch": size}
        if not a.skip_generate:
            ids = torch.tensor(prompts, device=a.device)
            mask = torch.ones_like(ids)

            def gen(ids: torch.Tensor = ids, mask: torch.Tensor = mask) -> None:  # this size's tensors, bound now
                with torch.inference_mode():
                    model.generate(
                        input_ids=ids,
                        attention_mask=mask,
                        max_new_tokens=new,
                        min_new_tokens=new,
                        do_sample=False,
                        pad_token_id=0,
                    )

            row["generate_ms"] = timed(gen, a.device, a.repeats) * 1000
        row["static_eager_ms"] = timed(partial(eager.generate, prompts, min_tokens=new), a.device, a.repeats) * 1000
        if graphs is not None:
            row["static_graph_ms"] = (
                timed(partial(graphs.generate, prompts, min_tokens=new), a.device, a.repeats) * 1000
            )
        if anchor is not None:
            row["anchor_graph_ms"] = anchor(a.device, dtype, size, a.prompt_len, new, True, a.repeats) * 1000
        rows.append(row)
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        save(a, rows, model)
    print("\n" + markdown(a, rows, model))
    return 0


def markdown(a: argparse.Namespace, rows: list[dict[str, Any]], model: Any) -> str:
    head = [
        "batch",
        "generate ms",
        "static eager ms",
        "static graph ms",
        "anchor graph ms",
        "graph / anchor",
        "generate / graph",
        "graph output tokens/s",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        g, an, gen = (
            r.get("static_graph_ms", math.nan),
            r.get("anchor_graph_ms", math.nan),
            r.get("generate_ms", math.nan),
        )
        lines.append(
            f"| {r['batch']} | {gen:.1f} | {r['static_eager_ms']:.1f} | {g:.1f} | {an:.1f} | {g / an:.2f} | "
            f"{gen / g:.1f} | {r['batch'] * a.new_tokens / g * 1000:.0f} |"
        )
    name = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu"
    return (
        f"Offline batch time, {a.prompt_len}-id prompts x {a.new_tokens} new tokens (EOS ignored), SmolLM2-135M "
        f"architecture{' (tiny)' if a.tiny else ''}, random weights, {name}, median of {a.repeats}. Goal: graph "
        f"/ anchor <= 1.3 at batch 100.\n\n" + "\n".join(lines) + "\n"
    )


def save(a: argparse.Namespace, rows: list[dict[str, Any]], model: Any) -> None:
    """After every row, so a timeout still leaves the rows so far."""
    if not a.out:
        return
    with open(a.out, "w") as f:
        f.write(
            markdown(a, rows, model)
            + "\n```\n"
            + json.dumps({"machine": machine(), "settings": vars(a)}, indent=1, default=str)
            + "\n```\n"
        )
    with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
        json.dump({"machine": machine(), "settings": vars(a), "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
