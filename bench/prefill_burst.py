"""Does a burst of new sequences stall the ones already running? (issue 25: prefill under a per-step budget)

    python -m bench.prefill_burst              # CPU, SmolLM2's architecture at 2 layers, random weights: ~1 minute
    python -m bench.prefill_burst --record     # the same, and writes bench/results/prefill-burst-<time>.{md,json}

`--running` sequences decode (long outputs, EOS ignored) on the real slot stepper thread; once each has a few
tokens, `--burst` sequences with `--prompt-len`-token prompts join at once. Per prefill budget a row:
`none` is the old behaviour (every join prefilled before the running sequences' next step, in forwards of at
most `--prefill-tokens`), the others the most prompt tokens prefilled between two steps. Reported: the
running sequences' gaps between tokens while the burst joins (median, p99, max) against their gap before it,
and the burst's time to first token (p50, p95) and until its last first token. Wall-clock on this machine's
CPU: the ratios between rows are the point, not the milliseconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/prefill_burst.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import asyncio
import statistics
import time
from typing import Any

import numpy as np
import torch

from bench import common, report
from bench.cb_compare import random_model
from batchserve.decoding.slot_decoder import SlotDecoder
from batchserve.decoding.slot_stepper import SlotStepper
from batchserve.decoding.stepper import SamplingParams, TokenUpdate

NO_BUDGET = 10**9


def one_row(model: Any, a: argparse.Namespace, budget: int) -> dict[str, Any]:
    rng = np.random.default_rng(a.seed)
    vocab = model.config.vocab_size
    running = [rng.integers(3, vocab, 16).tolist() for _ in range(a.running)]
    burst = [rng.integers(3, vocab, a.prompt_len).tolist() for _ in range(a.burst)]
    slot_tokens = a.prompt_len + a.running_tokens + 16
    decoder = SlotDecoder(
        model,
        a.running + a.burst,
        slot_tokens,
        eos_ids=[],
        pad_id=0,
        prefill_tokens=a.prefill_tokens,
        chunk_tokens=a.chunk,
    )
    stepper = SlotStepper(decoder, decoder.warm(), prefill_step_tokens=budget)
    times: dict[str, list[float]] = {}

    async def main() -> float:
        started_burst = asyncio.Event()
        ready = asyncio.Event()
        done = asyncio.Event()

        def deliver(updates: list[TokenUpdate]) -> None:
            now = time.perf_counter()
            for u in updates:
                if u.error:
                    raise RuntimeError(u.error)
                if u.tokens:
                    times.setdefault(u.seq_id, []).append(now)
            if not started_burst.is_set() and all(len(times.get(f"r{i}", [])) >= 4 for i in range(a.running)):
                ready.set()
            if started_burst.is_set() and all(f"b{i}" in times for i in range(a.burst)):
                done.set()

        stepper.start(asyncio.get_running_loop(), deliver)
        for i, p in enumerate(running):
            stepper.add(f"r{i}", p, SamplingParams(max_tokens=a.running_tokens, temperature=0, ignore_eos=True))
        await asyncio.wait_for(ready.wait(), 120)
        t0 = time.perf_counter()
        started_burst.set()
        for i, p in enumerate(burst):
            stepper.add(f"b{i}", p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        await asyncio.wait_for(done.wait(), 300)
        await asyncio.to_thread(stepper.stop, 30)
        return t0

    t0 = asyncio.run(main())
    t_end = max(times[f"b{i}"][0] for i in range(a.burst))
    before: list[float] = []
    during: list[float] = []
    for i in range(a.running):
        ts = times[f"r{i}"]
        for x, y in zip(ts, ts[1:]):
            (during if t0 <= y and x <= t_end else before if y < t0 else []).append(y - x)
    ttft = [times[f"b{i}"][0] - t0 for i in range(a.burst)]
    ms = 1000.0
    return {
        "budget": "none" if budget >= NO_BUDGET else budget,
        "prefills": stepper.prefills,
        "pieces": stepper.pieces,
        "gap_before_ms": statistics.median(before) * ms if before else float("nan"),
        "gap_during_p50_ms": statistics.median(during) * ms if during else float("nan"),
        "gap_during_p99_ms": report.pct(np.array(during) * ms, 99) if during else float("nan"),
        "gap_during_max_ms": max(during) * ms if during else float("nan"),
        "ttft_p50_ms": statistics.median(ttft) * ms,
        "ttft_p95_ms": report.pct(np.array(ttft) * ms, 95),
        "burst_in_ms": (t_end - t0) * ms,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2, help="SmolLM2's architecture at this many layers")
    p.add_argument("--running", type=int, default=8, help="sequences decoding when the burst arrives")
    p.add_argument("--running-tokens", type=int, default=400, help="their max_tokens (EOS ignored)")
    p.add_argument("--burst", type=int, default=64, help="sequences joining at once")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=512, help="padded tokens in one prefill forward at most")
    p.add_argument("--chunk", type=int, default=0, help="tokens of one prompt in one piece (0 = the decoder's)")
    p.add_argument("--budgets", default="0,512,128", help="prompt tokens prefilled between two steps (0 = none)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--seed", type=int, default=3)
    common.add_output_flags(p, name="prefill-burst")
    return p.parse_args(argv)


def main() -> int:
    a = parse_args()
    torch.set_num_threads(a.threads)
    model = random_model("cpu", torch.float32, layers=a.layers)
    rows = [one_row(model, a, int(b) or NO_BUDGET) for b in a.budgets.split(",")]
    head = [
        "budget",
        "prefills",
        "pieces",
        "gap_before_ms",
        "gap_during_p50_ms",
        "gap_during_p99_ms",
        "gap_during_max_ms",
        "ttft_p50_ms",
        "ttft_p95_ms",
        "burst_in_ms",
    ]
    md = (
        f"Prefill under a per-step budget, CPU ({a.threads} thread), SmolLM2's architecture at {a.layers} layers, "
        f"random weights: {a.running} sequences decoding, then {a.burst} joining with {a.prompt_len}-token "
        f"prompts; prefill forwards of at most {a.prefill_tokens} padded tokens\n\n"
        + report.table(head, [[r[h] for h in head] for r in rows])
    )
    print(md)
    rep = {**report.provenance(), "settings": {k: v for k, v in vars(a).items() if k != "out_dir"}, "rows": rows}
    print(report.written(report.write(common.run_name(a, "prefill-burst"), rep, md, common.out_dir(a))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
