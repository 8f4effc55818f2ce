"""Static vs continuous batching on the real SmolLM2-135M-Instruct weights (issue 6), one command:

    python -m bench.generation_bench                    # CPU: 20 requests, batch 8, about 4 minutes
    python -m bench.generation_bench --requests 8 --batch 4 --long 64 --no-http   # a quick check

Workload (bench/cb_compare.py): all requests arrive at t = 0, 80 % ask for 16 tokens and 20 % for 256 (EOS
ignored, so every row generates exactly the same tokens), over the same chat prompts. Rows:
- static: batches of --batch in arrival order, each a greedy `generate` to its longest member: the call the
  smollm2 backend (the /v1/inference batchstring path) makes;
- manager: transformers' ContinuousBatchingManager alone, at most --batch sequences at once;
- slots: batchserve's slot stepper alone (the server's default generation engine), --batch slots;
- continuous, engine: batchserve's Engine in-process (admission, text streams, asyncio bridge) on the stepper
  --generation-engine names (slots by default);
- continuous, HTTP: a live `batchserve serve --backend smollm2` through the OpenAI API (AsyncOpenAI,
  non-streaming), the whole server path.
Output tokens/s and the short requests' p50 latency for each, and their ratio to static, go to stdout and, with
`--record` (machine, commit and settings too), to bench/results/generation-<time>.md/.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/generation_bench.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import asyncio
import time
from typing import Any

from bench import cb_compare, common, report, servers
from bench.cb_compare import Result, Workload

QUESTIONS = [
    "What is the capital of France?",
    "Write a short story about a robot who learns to paint.",
    "Explain how photosynthesis works.",
    "Give me three tips for learning a new language.",
    "What causes the seasons on Earth?",
    "Describe a sunset over the ocean.",
    "How do vaccines train the immune system?",
    "Write a poem about autumn leaves.",
]


def chat_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        enc = tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
    return out


def engine_settings(a: argparse.Namespace) -> list[str]:
    return [
        "--generation-max-seqs",
        str(a.batch),
        "--generation-max-tokens",
        str(max(a.long, a.short)),
        "--generation-queue-timeout-ms",
        "600000",
        "--generation-engine",
        a.generation_engine,
    ]


async def run_engine(model: Any, tokenizer: Any, work: Workload, a: argparse.Namespace) -> Result:
    """batchserve's Engine in-process, sharing the loaded model."""
    from prometheus_client import CollectorRegistry

    from batchserve.cli import add_settings_flags, settings_from
    from batchserve.decoding.engine import Engine
    from batchserve.decoding.stepper import SamplingParams

    parser = argparse.ArgumentParser()
    add_settings_flags(parser)
    settings = settings_from(parser.parse_args(["--backend", "smollm2", *engine_settings(a)]), environ={})
    engine = await Engine.start(settings, CollectorRegistry(), model, tokenizer)
    latencies = [0.0] * len(work.prompts)
    try:
        started = time.perf_counter()

        async def one(i: int) -> int:
            seq = engine.submit(
                work.prompts[i], SamplingParams(max_tokens=work.max_tokens[i], temperature=0, ignore_eos=True)
            )
            async for delta in engine.stream(seq):
                if delta.error:
                    raise RuntimeError(str(delta.error))
            latencies[i] = time.perf_counter() - started
            return seq.tokens

        tokens = sum(await asyncio.gather(*(one(i) for i in range(len(work.prompts)))))
        seconds = time.perf_counter() - started
    finally:
        await engine.stop()
    return Result(
        "continuous, engine", a.batch, len(work.prompts), tokens, seconds, latencies, work.max_tokens, work.short
    )


async def run_http(base: str, work: Workload, a: argparse.Namespace) -> Result:
    """The live server through the OpenAI API; prompts sent as token ids to /v1/completions."""
    import openai

    latencies = [0.0] * len(work.prompts)
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="bench", max_retries=0, timeout=1200) as client:
        started = time.perf_counter()

        async def one(i: int) -> int:
            r = await client.completions.create(
                model="SmolLM2-135M-Instruct",
                prompt=work.prompts[i],
                max_tokens=work.max_tokens[i],
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            latencies[i] = time.perf_counter() - started
            assert r.usage is not None, "the server reports usage on every completion"
            return r.usage.completion_tokens

        tokens = sum(await asyncio.gather(*(one(i) for i in range(len(work.prompts)))))
        seconds = time.perf_counter() - started
    return Result(
        "continuous, HTTP", a.batch, len(work.prompts), tokens, seconds, latencies, work.max_tokens, work.short
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8, help="static batch size = continuous max sequences")
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--long", type=int, default=256)
    ap.add_argument("--device", default="", help="default: the first CUDA device, else cpu")
    ap.add_argument("--no-http", action="store_true", help="skip the live-server row")
    ap.add_argument(
        "--generation-engine",
        default="slots",
        choices=("slots", "manager"),
        help="the stepper of the engine and HTTP rows",
    )
    common.add_output_flags(ap, name="generation")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from batchserve.backends import pick_devices
    from batchserve.backends.smollm2 import load_model, load_tokenizer

    device = a.device or pick_devices(1)[0]
    tokenizer, model = load_tokenizer(), load_model(device)
    work = Workload.mixed(chat_prompts(tokenizer, a.requests), a.short, a.long)
    print(
        f"{a.requests} requests ({work.max_tokens.count(a.long)} x {a.long} tokens, the rest x {a.short}), "
        f"{work.tokens} output tokens, batch {a.batch}, {device}",
        flush=True,
    )
    cb_compare.run_static(model, Workload.mixed(work.prompts[:2], 2, 2), 2, tokenizer.pad_token_id)  # warm-up
    results = [cb_compare.run_static(model, work, a.batch, tokenizer.pad_token_id)]
    print(results[-1].row(), flush=True)
    results.append(
        cb_compare.run_continuous(
            model, work, a.batch, page_size=32, kv_tokens=16384, max_batch_tokens=512 if device == "cpu" else None
        )
    )
    print(results[-1].row(), flush=True)
    results.append(cb_compare.run_slots(model, work, a.batch))
    print(results[-1].row(), flush=True)
    results.append(asyncio.run(run_engine(model, tokenizer, work, a)))
    print(results[-1].row(), flush=True)
    del model
    name = common.run_name(a, "generation")
    log_dir = common.log_dir(a, name)
    if not a.no_http:
        with common.guarded():
            server = servers.start(
                "generation-bench",
                servers.serve_cmd(
                    "smollm2",
                    *engine_settings(a),
                ),
                log_dir,
            )
            results.append(asyncio.run(run_http(server.base, work, a)))
            print(results[-1].row(), flush=True)
    rows = [r.row() for r in results]
    table = cb_compare.markdown(rows, rows[0])
    title = (
        f"# Generation: static vs continuous batching, SmolLM2-135M-Instruct on {device}\n\n"
        f"{a.requests} requests at t = 0: {work.max_tokens.count(a.long)} x {a.long} tokens, the rest x "
        f"{a.short} (EOS ignored), chat prompts of {min(map(len, work.prompts))}-"
        f"{max(map(len, work.prompts))} tokens; static batch = continuous max sequences = {a.batch}.\n"
    )
    print("\n" + title + "\n" + table, flush=True)
    prov = report.provenance()
    md = (
        title
        + "\n"
        + table
        + "\n\nmachine: "
        + str(prov["machine"])
        + "\n\ngit: "
        + str(prov["git"])
        + "\n\nsettings: "
        + str(vars(a))
        + "\n"
    )
    paths = report.write(name, {**prov, "settings": vars(a), "device": device, "rows": rows}, md, common.out_dir(a))
    print("\n" + report.written(paths, log_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
