"""How many generated tokens a second the event loop's side of generation can take, without a model:

    python -m bench.engine_loop                      # 256 sequences x 200 steps, 5 repeats, about 15 s

On a GPU the slot stepper makes a step of 256 tokens every ~4-5 ms (50,000+ tokens/s); every one of them goes
through the Engine on the event loop (ITL and TTFT metrics, incremental detokenization with stop strings, a
delta on the sequence's queue, the caller's coroutine waking to take it). If the loop could not keep up, the
GPU's speed would not reach the callers. This feeds the real Engine (SmolLM2's tokenizer, random token ids) from
a stand-in stepper, one step's updates per loop turn, with one consumer per sequence reading its deltas, and
reports tokens per CPU-second of the loop (median of the repeats) two ways: streamed (a delta per token, as for
`stream: true`) and whole (one delta at the end, as for a plain answer).
With `--record` (machine, commit and settings too) it writes bench/results/engine-loop-<time>.md/.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/engine_loop.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

from bench import common, report


class FeedStepper:
    """A stepper that runs nothing: whoever holds it hands the engine each step's tokens (`deliver`) itself.
    The engine's unit tests use it too."""

    description = "none (fed by hand)"
    resumable = True  # the engine may preempt: a dropped sequence is simply added again
    row_growth = 0.0  # rows cost nothing here
    shares_steps = False  # every sequence in every step

    def __init__(self, capacity: Any, step_s: float = 0.005) -> None:
        self.capacity = capacity
        self.step_s = step_s
        self.deliver: Any = None

    def start(self, loop: Any, deliver: Any) -> None:
        self.deliver = deliver

    def add(self, *a: Any, **kw: Any) -> None:
        pass

    def cancel(self, seq_id: str) -> None:
        pass

    def is_running(self) -> bool:
        return True

    def kv_usage(self) -> float:
        return 0.0

    def step_mix(self) -> dict[str, float]:
        return {}

    def stop(self, timeout: float) -> None:
        pass


async def one_run(tokenizer: Any, sequences: int, steps: int, seed: int, streamed: bool) -> tuple[float, float]:
    """(wall s, loop CPU s) to take sequences x steps tokens."""
    from prometheus_client import CollectorRegistry

    from batchserve.decoding.build import EngineConfig

    from batchserve.decoding.engine import Engine

    from batchserve.decoding.stepper import SamplingParams
    from batchserve.decoding.stepper import TokenUpdate

    from batchserve.decoding.stepper import KvCapacity

    stepper = FeedStepper(KvCapacity(blocks=sequences, page_size=4096, max_seqs=sequences, max_sequence_tokens=4096))
    engine = Engine(EngineConfig(max_tokens=steps), tokenizer, stepper, CollectorRegistry(), 8192, 49152)
    stepper.start(None, engine._on_updates)
    seqs = [
        engine.submit([1, 2, 3], SamplingParams(max_tokens=steps, temperature=0), streamed=streamed)
        for _ in range(sequences)
    ]

    async def consume(seq: Any) -> str:
        return "".join([d.text async for d in engine.stream(seq)])

    readers = [asyncio.create_task(consume(s)) for s in seqs]
    rng = random.Random(seed)
    wall, cpu = time.perf_counter(), time.process_time()
    for step in range(steps):
        last = step == steps - 1
        stepper.deliver([TokenUpdate(s.id, [rng.randrange(100, 40000)], last) for s in seqs])
        await asyncio.sleep(0)  # the readers run between steps, as they would between a stepper's hand-overs
    texts = await asyncio.gather(*readers)
    assert all(texts) and engine.generated_tokens == sequences * steps
    return time.perf_counter() - wall, time.process_time() - cpu


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    common.add_output_flags(ap, name="engine-loop")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from batchserve.backends.smollm2 import load_tokenizer, source_dir
    from batchserve.config import Settings

    tokenizer = load_tokenizer(source_dir(Settings(backend="smollm2")))
    tokens = a.sequences * a.steps
    runs = []
    for i in range(a.repeats):  # the two modes interleaved: this machine's noise falls on both alike
        for mode in ("streamed", "whole"):
            wall, cpu = asyncio.run(one_run(tokenizer, a.sequences, a.steps, seed=i, streamed=mode == "streamed"))
            runs.append(
                {
                    "mode": mode,
                    "wall_s": round(wall, 3),
                    "cpu_s": round(cpu, 3),
                    "tokens_per_cpu_s": round(tokens / cpu),
                }
            )
            print(runs[-1], flush=True)
    median = {
        mode: statistics.median(r["tokens_per_cpu_s"] for r in runs if r["mode"] == mode)
        for mode in ("streamed", "whole")
    }
    title = (
        f"# Generation's loop side: {a.sequences} sequences x {a.steps} steps ({tokens} tokens), "
        f"{a.repeats} runs a mode\n\nmedian tokens per CPU-second of the event loop: "
        f"{median['streamed']:,.0f} streamed (a delta per token), {median['whole']:,.0f} whole (one delta)\n"
    )
    table = report.table(
        ["run", "mode", "wall s", "loop CPU s", "tokens per CPU-second"],
        [[i // 2 + 1, r["mode"], r["wall_s"], r["cpu_s"], r["tokens_per_cpu_s"]] for i, r in enumerate(runs)],
    )
    print("\n" + title + "\n" + table, flush=True)
    prov = report.provenance()
    md = title + "\n" + table + "\n\nmachine: " + str(prov["machine"]) + "\n\ngit: " + str(prov["git"]) + "\n"
    paths = report.write(
        common.run_name(a, "engine-loop"),
        {**prov, "settings": vars(a), "runs": runs, "median_tokens_per_cpu_s": median},
        md,
        common.out_dir(a),
    )
    print("\n" + report.written(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
