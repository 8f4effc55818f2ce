"""Do the CUDA-graph paths give the tokens the eager code gives? (issue 13's GPU check, part `agree`)

Why: the GPU check measured speed only. What runs on a GPU and nowhere else (graph capture and replay, the
static buffers a graph reads, pinned host copies behind events, one step in flight while the host reads the
last) can give wrong tokens silently, and the CPU tests cannot see it. This runs the same requests through
- the reference: the same decoders on the CPU, eager, at the GPU's padded shapes (synchronous: nothing in
  flight, no graphs), and
- each candidate: on CUDA the decoders with graphs, and eagerly at the same shapes (on a CPU, as a smoke test:
  the decoders at their exact, unpadded shapes),
then compares every request's tokens. Two paths:
- static: `StaticDecoder.generate` (the `/v1/inference` batch path) on batches of 100, 37 and 5 prompts of
  mixed lengths (padded to the 100 / 64 / 8 buckets, filler rows included), an end-of-sequence token chosen so
  that many rows end part-way (the finished flags, the pads after an end, the lagged stop check);
- slots: `SlotStepper` over a `SlotDecoder` (continuous batching), more requests than slots, mixed prompt and
  output lengths, greedy and seeded top_p sampling, EOS on and off (joins, slot reuse, moves to lower slots,
  the double-buffered token copies; prompts longer than 48 tokens prefilled in pieces, the later ones on
  their own graphs).

The model is SmolLM2-135M's width with 4 layers (what a graph captures does not depend on the depth; the CPU
reference stays fast), float32 with TF32 off, its weights spread (std 0.5) so greedy picks are far from ties: a
greedy request that differs is a defect, not rounding (a seeded draw may sit on a boundary: see `verdict`).
Exit status 1 when the verdict fails.

    python bench/gpu_agree.py --out $OUT/agree.md        # on a GPU (gpu_check.sh runs it first)
    python bench/gpu_agree.py --device cpu --tiny        # a CPU smoke test, under a minute
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from batchserve.backends.static_decode import StaticDecoder
from batchserve.decoding.slot_decoder import SlotDecoder
from batchserve.decoding.slot_stepper import SlotStepper
from batchserve.decoding.stepper import SamplingParams, TokenUpdate
from bench.cb_compare import TINY_VOCAB, machine, random_model

PAD = 0
STATIC_NEW = 32  # new tokens a row in the static batches
STATIC_BATCHES = (100, 37, 5)  # padded to 100, 64 and 8 rows
SLOTS, SLOT_TOKENS = 64, 512
CHUNK = 48  # prompt tokens in one prefill piece: prompts of 49-120 tokens are prefilled in 2-3 pieces (issue 25)
SLOT_REQUESTS = 96


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Diff:
    """One request whose tokens differ from the reference: where they part, and both lengths."""

    index: int
    first: int  # the first token index that differs
    reference_len: int
    candidate_len: int


def differences(reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]) -> list[Diff]:
    """Every request whose candidate tokens are not exactly the reference's."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(candidate)} answers for {len(reference)} requests")
    out = []
    for i, (ref, cand) in enumerate(zip(reference, candidate)):
        if list(ref) != list(cand):
            first = next((k for k, (a, b) in enumerate(zip(ref, cand)) if a != b), min(len(ref), len(cand)))
            out.append(Diff(i, first, len(ref), len(cand)))
    return out


def spread_model(device: str, tiny: bool, layers: int) -> Any:
    """SmolLM2's width and vocabulary (or the tiny ones) with `layers` layers, float32, weights of std 0.5 (far
    from ties)."""
    model = random_model("cpu", torch.float32, tiny=tiny, layers=layers, vocab=TINY_VOCAB if tiny else None)
    model.generation_config.eos_token_id = None
    torch.manual_seed(1)
    for p in model.parameters():
        p.data.normal_(0, 0.5)
    return model if device == "cpu" else copy.deepcopy(model).to(device)


def mixed_prompts(n: int, vocab: int, longest: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, longest))] for _ in range(n)]


def ending_tokens(rows: Sequence[Sequence[int]], lo: int, hi: int) -> list[int]:
    """End-of-sequence ids that end rows part-way: from row i, its token at index lo + i % (hi - lo) (when
    that is the token's first appearance in the row)."""
    ids = set()
    for i, row in enumerate(rows):
        at = lo + i % (hi - lo)
        if at < len(row) and row[at] not in row[:at]:
            ids.add(row[at])
    return sorted(ids) or [-1]


# -- static -------------------------------------------------------------------------------------------------
def static_decoder(model: Any, eos: list[int], graphs: bool, fixed: bool) -> StaticDecoder:
    d = StaticDecoder(
        model,
        STATIC_NEW,
        eos,
        PAD,
        max_batch=max(STATIC_BATCHES),
        use_graphs=graphs,
        fixed_shapes=fixed,
        prompt_buckets=(64,),
    )
    d.warm()
    return d


def static_tokens(decoder: StaticDecoder, batches: list[list[list[int]]]) -> list[list[int]]:
    return [row for batch in batches for row in decoder.generate(batch)]


# -- slots --------------------------------------------------------------------------------------------------
def slot_requests(vocab: int, n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for prompt in mixed_prompts(n, vocab, 120, seed):
        max_tokens = rng.choice((1, 4, 16, 48, 96))
        ignore_eos = rng.random() < 0.3
        if rng.random() < 0.35:  # seeded sampling: a reproducible draw among the nucleus (see verdict)
            params = SamplingParams(
                max_tokens,
                temperature=0.8,
                top_p=rng.choice((0.5, 0.8)),
                seed=rng.randrange(1 << 30),
                ignore_eos=ignore_eos,
            )
        else:
            params = SamplingParams(max_tokens, temperature=0, ignore_eos=ignore_eos)
        out.append(Request(prompt, params))
    return out


def slot_decoder(model: Any, eos: list[int], graphs: bool, fixed: bool, slots: int = SLOTS) -> SlotDecoder:
    d = SlotDecoder(
        model,
        slots,
        SLOT_TOKENS,
        eos,
        PAD,
        use_graphs=graphs,
        fixed_shapes=fixed,
        prefill_tokens=4096,
        chunk_tokens=CHUNK,
    )
    d.warm()
    return d


def slot_tokens(decoder: SlotDecoder, requests: list[Request], timeout_s: float = 120) -> list[list[int]]:
    """Every request's tokens from a `SlotStepper` on its own thread, delivered to an event loop as the server's
    engine receives them; all requests handed over at once (more than the slots: some wait for a free one)."""
    stepper = SlotStepper(decoder, step_s=0.001)
    got: list[list[int]] = [[] for _ in requests]

    failed: list[str] = []

    async def main() -> None:
        finished = asyncio.Event()
        left = [len(requests)]

        def deliver(updates: list[TokenUpdate]) -> None:
            for u in updates:
                if u.error:  # raised after the loop: an exception here would only be logged
                    failed.append(f"request {u.seq_id} failed: {u.error}")
                got[int(u.seq_id)].extend(u.tokens)
                if u.finished:
                    left[0] -= 1
            if not left[0] or failed:
                finished.set()

        stepper.start(asyncio.get_running_loop(), deliver)
        for i, r in enumerate(requests):
            stepper.add(str(i), r.prompt, r.params)
        await asyncio.wait_for(finished.wait(), timeout_s)

    try:
        asyncio.run(main())
    finally:
        stepper.stop(30)
    if failed:
        raise RuntimeError(failed[0])
    return got


# -- the run ------------------------------------------------------------------------------------------------
SAMPLED_AGREE = 0.9  # share of seeded sampled requests that must be identical (see verdict)


def verdict(row: dict[str, Any]) -> bool:
    """Every greedy request identical, and nearly every seeded sampled one. A seeded draw is reproducible, but
    one that lands within rounding of a boundary between two tokens' shares of the CDF goes either way when the
    logits differ by rounding, as they do between a CPU and a GPU kernel (`sampling.py` says so). Over the whole
    vocabulary (top_p 1, a flat random model) that was ~1 % of draws on this CPU, padded against exact shapes,
    so the sampled requests draw from a nucleus (top_p 0.5 or 0.8: a few tokens, wide shares) where it is rare;
    the tolerance covers the rest. A broken path differs nearly everywhere."""
    greedy_ok = row["greedy_identical"] == row["greedy"]
    return greedy_ok and row["sampled_identical"] >= SAMPLED_AGREE * row["sampled"]


def compare(
    path: str, name: str, reference: list[list[int]], tokens: list[list[int]], sampled: set[int], eos: list[int]
) -> dict[str, Any]:
    """One candidate's row: identical requests, greedy and sampled apart, and the first few differences."""
    diffs = differences(reference, tokens)
    differ = {d.index for d in diffs}
    greedy = [i for i in range(len(reference)) if i not in sampled]
    row = {
        "path": path,
        "candidate": name,
        "eos": eos,
        "requests": len(reference),
        "tokens": sum(map(len, reference)),
        "ended_at_eos": sum(1 for r in reference if r and r[-1] in eos),
        "greedy": len(greedy),
        "greedy_identical": sum(1 for i in greedy if i not in differ),
        "sampled": len(sampled),
        "sampled_identical": sum(1 for i in sampled if i not in differ),
        "first_diffs": [vars(d) for d in diffs[:5]],
    }
    row["agree"] = verdict(row)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a 64-wide model of 4,096 tokens: a smoke test")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--paths", default="static,slots")
    p.add_argument("--slots", type=int, default=SLOTS)
    p.add_argument("--requests", type=int, default=SLOT_REQUESTS, help="continuous batching requests")
    p.add_argument("--out", default="", help="write the table (markdown) here, and a .json beside it")
    a = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cuda = a.device.startswith("cuda")
    ref_model = spread_model("cpu", a.tiny, a.layers)
    model = spread_model(a.device, a.tiny, a.layers) if cuda else ref_model
    vocab = ref_model.config.vocab_size
    # (name, use_graphs, fixed_shapes) of each candidate; the reference is always the CPU at fixed shapes.
    candidates = [("graphs", True, True), ("eager", False, True)] if cuda else [("exact shapes", False, False)]
    rows: list[dict[str, Any]] = []
    for path in a.paths.split(","):
        started = time.perf_counter()
        sampled: set[int] = set()
        if path == "static":
            prompts = mixed_prompts(sum(STATIC_BATCHES), vocab, 60, seed=2)
            probe = static_tokens(static_decoder(ref_model, [], False, False), [prompts[::8]])
            eos = ending_tokens(probe, 2, STATIC_NEW - 2)
            batches, at = [], 0
            for n in STATIC_BATCHES:
                batches.append(prompts[at : at + n])
                at += n
            reference = static_tokens(static_decoder(ref_model, eos, False, True), batches)
            answers = {name: static_tokens(static_decoder(model, eos, g, f), batches) for name, g, f in candidates}
        elif path == "slots":
            requests = slot_requests(vocab, a.requests, seed=4)
            probe = static_tokens(static_decoder(ref_model, [], False, False), [[r.prompt for r in requests[::3]]])
            eos = ending_tokens(probe, 1, 12)
            sampled = {i for i, r in enumerate(requests) if not r.params.greedy}
            reference = slot_tokens(slot_decoder(ref_model, eos, False, True, a.slots), requests)
            answers = {
                name: slot_tokens(slot_decoder(model, eos, g, f, a.slots), requests) for name, g, f in candidates
            }
        else:
            raise SystemExit(f"unknown path {path!r} (static, slots)")
        for name, tokens in answers.items():
            rows.append(compare(path, f"{name} on {a.device}", reference, tokens, sampled, eos))
            rows[-1]["seconds"] = round(time.perf_counter() - started, 1)
            print(json.dumps(rows[-1]), flush=True)
        save(a, rows)
    print("\n" + markdown(a, rows))
    return 0 if all(r["agree"] for r in rows) else 1


def markdown(a: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    head = [
        "path",
        "candidate",
        "requests",
        "tokens",
        "ended at EOS",
        "greedy identical",
        "sampled identical",
        "first differences (request: token index)",
        "agree",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        diffs = ", ".join(f"{d['index']}: {d['first']}" for d in r["first_diffs"]) or "-"
        lines.append(
            f"| {r['path']} | {r['candidate']} | {r['requests']} | {r['tokens']} | {r['ended_at_eos']} | "
            f"{r['greedy_identical']} / {r['greedy']} | {r['sampled_identical']} / {r['sampled']} | "
            f"{diffs} | **{'yes' if r['agree'] else 'NO'}** |"
        )
    name = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu"
    return (
        f"Each path's tokens against the same decoder eager on the CPU at the GPU's padded shapes "
        f"({'64 wide, 4,096 tokens' if a.tiny else '576 wide'}, {a.layers} layers, float32, TF32 off, weights of "
        f"std 0.5), {name}. "
        f"static: batches of {'/'.join(map(str, STATIC_BATCHES))} prompts of 1-60 tokens, {STATIC_NEW} new "
        f"tokens, greedy. slots: {a.requests} requests over {a.slots} slots, prompts of 1-120 tokens, "
        f"max_tokens 1-96, about a third sampled with a seed (temperature 0.8, top_p 0.5 or 0.8). Agree: every "
        f"greedy request identical and {SAMPLED_AGREE:.0%} of the sampled ones.\n\n" + "\n".join(lines) + "\n"
    )


def save(a: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """After every path, so a timeout still leaves the rows so far."""
    if not a.out:
        return
    with open(a.out, "w") as f:
        f.write(
            markdown(a, rows)
            + "\n```\n"
            + json.dumps({"machine": machine(), "settings": vars(a)}, indent=1, default=str)
            + "\n```\n"
        )
    with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
        json.dump({"machine": machine(), "settings": vars(a), "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
