"""Whether the host keeps a GPU's continuous-batching steps fed: the real slot stepper thread and the real Engine
(event loop, detokenization, one reader per sequence), with the GPU stood in by a clock.

    python -m bench.stepper_host                 # 256 slots, 4.0 ms a step, 1,536 mixed requests; ~1 minute
    python -m bench.stepper_host --step-ms 0     # the host's own ceiling (a device that takes no time)
    python -m bench.stepper_host --http          # the same through a live server's /v1/completions
    python -m bench.stepper_host --http --real-model .gpu/smollm2 --out $OUT   # a real model (the GPU check)

Why: on a GPU a graph-replayed step of 256 sequences takes ~4 ms (the shared anchor: 260 ms for 64 steps of
256 on an H200), so 20,000+ output tokens/s is there only if the host does each step's work (launch, collect,
hand-over, the Engine's per-token work on the loop, the readers waking) within the device's time, while the
stepper thread and the loop share one interpreter lock. `engine_loop.py` measures the loop's side alone; this
runs both sides together on this machine's CPU, with no model and no GPU:

- `DeviceStandIn` has `SlotDecoder`'s interface and shapes (its bucket rules are the decoder's own); a step
  takes `--step-ms` of "device" time after the previous one ends (a GPU runs them in launch order), a prefill
  `--prefill-ms`; waiting for either sleeps (the lock released, as a CUDA event's wait does). Its per-row
  bookkeeping is numpy, about what `collect`'s two `.tolist()` cost the real one.
- The work is cb-steady's (the GPU check's steady row): `--requests` requests (80 % ask 16 tokens, 20 % 256,
  EOS ignored) over 64-token prompts, all submitted at t = 0 through `Engine.submit`; the Engine admits
  `--slots` at a time and the rest wait for a slot, as in the server.

With `--http` the same requests go through a live `batchserve serve --backend sim --generation on` (its own
process; its generation engine's stepper drives the same stand-in: `python -m bench.stepper_host serve ...`
patches the model loader and the stepper builder, nothing else) as OpenAI completions from an aiohttp client in
this process, all sent at once; streamed ones ask for the usage chunk, and every answer's completion tokens are
checked. Then host CPU is the server process's. `--real-model DIR` (`auto`: the server's default weights) serves
a real model instead of the stand-in (`--generation on --smollm2-dir DIR`, no patches): the same work end to end
on a GPU, the goal's own measure; a model may end a request early at its EOS, so there the tokens counted are the
answers' own.

Columns: output tokens/s (wall, first submit to last answer); device busy (the stand-in's busy time over the
wall: 1.0 = every step's host work hid behind the device); host CPU-ms per 1,000 tokens (both threads).
Rows: streamed (a delta per token, `stream: true`) and whole (one delta at the end), interleaved over
`--repeats`; the medians are printed. With `--record` (machine, commit and settings) it writes
bench/results/stepper-host-<time>.md/.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/stepper_host.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import asyncio
import math
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Sequence

import numpy as np

from batchserve.decoding.prefill_pieces import PREFILL_ROWS
from batchserve.decoding.slot_decoder import SlotDecoder
from batchserve.decoding.stepper import SamplingParams
from batchserve.gc_tuning import tune_gc
from bench.device_clock import DeviceClock
from batchserve.http.server import SWITCH_INTERVAL_S
from bench import common, report, servers
from bench.cb_compare import Workload, random_prompts


@dataclass(frozen=True)
class StandInTicket:
    rows: int
    due: float  # when the stood-in device finishes the step
    tokens: np.ndarray
    done: np.ndarray


class DeviceStandIn:
    """`SlotDecoder` as the stepper sees it, with the device's time stood in by a clock (see the module doc)."""

    use_graphs = True
    fixed_shapes = True
    device = "a stood-in GPU"
    # the real decoder's shape rules, run on this object's attributes
    shape = SlotDecoder.shape
    prefill_shape = SlotDecoder.prefill_shape
    prefill_fits = SlotDecoder.prefill_fits

    def __init__(
        self, slots: int, slot_tokens: int, step_s: float, prefill_s: float, prefill_tokens: int = 8192
    ) -> None:
        self.slots, self.slot_tokens, self.prefill_tokens = slots, slot_tokens, prefill_tokens
        self.chunk_tokens = min(512, prefill_tokens, slot_tokens)
        self.prefill_rows = tuple(sorted({r for r in PREFILL_ROWS if r < slots} | {min(slots, max(PREFILL_ROWS))}))
        self.step_s, self.prefill_s = step_s, prefill_s
        self.count = np.zeros(slots, dtype=np.int64)
        self.max_tokens = np.ones(slots, dtype=np.int64)
        self.done = np.ones(slots, dtype=bool)
        self.clock = DeviceClock()
        self.steps = self.prefills = 0

    @property
    def busy_s(self) -> float:
        return self.clock.busy_s

    def _advance(self, rows: np.ndarray | slice) -> None:
        live = ~self.done[rows]
        self.count[rows] += live
        self.done[rows] |= self.count[rows] >= self.max_tokens[rows]

    def _tokens(self, rows: np.ndarray | slice) -> np.ndarray:
        return 100 + (self.count[rows] * 7919) % 30000  # any valid ids; the tokenizer decodes them

    def launch(self, rows: int, span: int, sampling: bool) -> StandInTicket:
        self.steps += 1
        due = self.clock.enqueue(self.step_s)
        self._advance(slice(0, rows))
        return StandInTicket(rows, due, self._tokens(slice(0, rows)), self.done[:rows].copy())

    def collect(self, ticket: StandInTicket) -> tuple[list[int], list[bool]]:
        self.clock.wait(ticket.due)
        return ticket.tokens.tolist(), ticket.done.tolist()

    def prefill(
        self,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        starts: Sequence[int] | None = None,
        last: Sequence[bool] | None = None,
    ) -> tuple[list[int], list[bool]]:
        self.prefills += 1
        index = np.asarray(slots)
        self.count[index] = 0
        self.max_tokens[index] = [q.max_tokens for q in params]
        self.done[index] = ~np.asarray(last if last is not None else [True] * len(slots), dtype=bool)
        # a prefill's first tokens are read at once (as the real one)
        self.clock.wait(self.clock.enqueue(self.prefill_s))
        self._advance(index)
        return self._tokens(index).tolist(), self.done[index].tolist()

    def release(self, slots: Sequence[int]) -> None:
        self.done[np.asarray(slots, dtype=np.int64)] = True

    def move(self, sources: Sequence[int], targets: Sequence[int], span: int) -> None:
        src, dst = np.asarray(sources), np.asarray(targets)
        for row in (self.count, self.max_tokens, self.done):
            row[dst] = row[src]
        self.done[src] = True


def workload(requests: int, seed: int) -> Workload:
    """cb-steady's requests (cb_compare's mix: 80 % ask 16 tokens, 20 % 256), prompts of 64 random ids."""
    return Workload.mixed(random_prompts(requests, 64, 40000, seed), seed=seed)


async def one_run(tokenizer: Any, a: argparse.Namespace, streamed: bool, seed: int) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry

    from batchserve.decoding.build import EngineConfig

    from batchserve.decoding.engine import Engine
    from batchserve.decoding.slot_stepper import SlotStepper

    device = DeviceStandIn(a.slots, 2048, a.step_ms / 1000, a.prefill_ms / 1000)
    stepper = SlotStepper(device, a.step_ms / 1000)  # type: ignore[arg-type]  # the stand-in has its interface
    engine = Engine(
        EngineConfig(max_tokens=256, max_waiting=a.requests, queue_timeout_s=3600),
        tokenizer,
        stepper,
        CollectorRegistry(),
        8192,
        49152,
    )
    stepper.start(asyncio.get_running_loop(), engine._on_updates)
    work = workload(a.requests, seed)

    async def read(seq: Any) -> int:
        return sum([1 async for d in engine.stream(seq) if d.text or d.finish_reason])

    wall, cpu = time.perf_counter(), time.process_time()
    try:
        seqs = [
            engine.submit(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), streamed=streamed)
            for p, n in zip(work.prompts, work.max_tokens)
        ]
        await asyncio.gather(*(read(s) for s in seqs))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        await asyncio.to_thread(stepper.stop, 10)
    tokens = sum(s.tokens for s in seqs)
    assert tokens == sum(s.params.max_tokens for s in seqs) and all(s.finish_reason == "length" for s in seqs)
    return {
        "mode": "streamed" if streamed else "whole",
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall),
        "device_busy": round(device.busy_s / wall, 3),
        "host_cpu_ms_per_1k_tokens": round(cpu / tokens * 1e6, 1),
        "steps": device.steps,
        "prefills": device.prefills,
        "moved": stepper.moved,
    }


def serve_stand_in(argv: list[str]) -> int:
    """`serve STEP_MS PREFILL_MS -- <batchserve serve flags>`: a server whose generation engine drives a
    DeviceStandIn (slots: --generation-max-seqs) instead of loading a model."""
    from types import SimpleNamespace

    import batchserve.backends.smollm2 as smollm2
    import batchserve.decoding.build as build_module
    from batchserve.cli import main as cli_main
    from batchserve.decoding.slot_stepper import SlotStepper

    step_s, prefill_s = float(argv[0]) / 1000, float(argv[1]) / 1000
    rest = argv[argv.index("--") + 1 :]

    def stand_in_stepper(model: Any, tokenizer: Any, cfg: Any) -> SlotStepper:
        device = DeviceStandIn(cfg.max_seqs or 256, cfg.max_context, step_s, prefill_s)
        return SlotStepper(device, step_s)  # type: ignore[arg-type]  # the stand-in has its interface

    def stand_in_model(device: str, model_dir: str = "") -> SimpleNamespace:  # no weights: the shape it reports
        return SimpleNamespace(config=SimpleNamespace(max_position_embeddings=8192, vocab_size=49152))

    smollm2.load_model = stand_in_model
    build_module.build_stepper = stand_in_stepper
    return cli_main(["serve", *rest])


async def http_run(base: str, server_pid: int, a: argparse.Namespace, streamed: bool, seed: int) -> dict[str, Any]:
    """The workload as OpenAI completions against a live server, all sent at once."""
    import aiohttp
    import orjson

    from bench.procstat import process_cpu_s

    work = workload(a.requests, seed)
    lengths = work.max_tokens
    bodies = [
        {
            "prompt": p,
            "max_tokens": n,
            "temperature": 0,
            "stream": streamed,
            **({"stream_options": {"include_usage": True}} if streamed else {}),
        }
        for p, n in zip(work.prompts, lengths)
    ]

    async def one(session: aiohttp.ClientSession, body: dict[str, Any]) -> int:
        async with session.post(base + "/v1/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"{r.status}: {(await r.text())[:300]}")
            if not streamed:
                return int((await r.json())["usage"]["completion_tokens"])
            usage = 0
            async for line in r.content:
                if line.startswith(b"data: {") and b'"usage"' in line:
                    usage = int(orjson.loads(line[6:])["usage"]["completion_tokens"])
            return usage

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        cpu, wall = process_cpu_s(server_pid), time.perf_counter()
        tokens = await asyncio.gather(*(one(session, b) for b in bodies))
        wall, cpu = time.perf_counter() - wall, process_cpu_s(server_pid) - cpu
    if a.real_model:  # a model's EOS may end an answer early; never late
        assert all(0 < t <= n for t, n in zip(tokens, lengths)), "an answer's completion tokens are off"
    else:
        assert tokens == lengths, "an answer's completion tokens differ from its max_tokens"
    total = sum(tokens)
    return {
        "mode": "streamed" if streamed else "whole",
        "tokens": total,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(total / wall),
        "device_busy": float("nan"),
        "host_cpu_ms_per_1k_tokens": round(cpu / total * 1e6, 1),
        "steps": None,
        "prefills": None,
        "moved": None,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=4.0, help="device time of one decode step (0: none)")
    ap.add_argument("--prefill-ms", type=float, default=5.0, help="device time of one prefill")
    ap.add_argument("--requests", type=int, default=1536)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--http", action="store_true", help="through a live server's /v1/completions")
    ap.add_argument(
        "--real-model",
        default="",
        metavar="DIR",
        help="with --http: serve a real model from DIR (auto: the server's default), not the stand-in",
    )
    ap.add_argument("--start-timeout-s", type=float, default=60.0, help="--http: how long the server may take to start")
    common.add_output_flags(ap, name="stepper-host")
    a = ap.parse_args(argv)
    if a.real_model and not a.http:
        ap.error("--real-model serves the model: it goes with --http")
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve_stand_in(argv[1:])
    a = parse_args(argv)
    from batchserve.backends.smollm2 import load_tokenizer, source_dir
    from batchserve.config import Settings

    tokenizer = None if a.http else load_tokenizer(source_dir(Settings(backend="smollm2")))
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # as `batchserve serve` runs: the stepper thread gets the lock back soon
    tune_gc()  # and its collector: what start-up built frozen, young collections every 50,000 allocations
    runs = []
    with common.guarded() as stopping:
        server = None
        if a.http:
            flags = [
                "--port",
                "0",
                "--backend",
                "sim",
                "--generation",
                "on",
                "--generation-max-seqs",
                str(a.slots),
                "--generation-max-tokens",
                "256",
                "--max-queue",
                str(a.requests * 2),
                "--generation-queue-timeout-ms",
                "600000",
                "--jobs-db",
                "",
                "--drain-grace-s",
                "0",
            ]
            if a.real_model:
                model = [] if a.real_model == "auto" else ["--smollm2-dir", a.real_model]
                cmd = [sys.executable, "-m", "batchserve", "serve", *flags, *model]
            else:
                cmd = [
                    sys.executable,
                    "-m",
                    "bench.stepper_host",
                    "serve",
                    str(a.step_ms),
                    str(a.prefill_ms),
                    "--",
                    *flags,
                ]
            server = servers.start(
                "stepper-host", cmd, Path(tempfile.mkdtemp(prefix="stepper-host-")), timeout_s=a.start_timeout_s
            )
        try:
            for i in range(a.repeats):  # the two modes interleaved: this machine's noise falls on both alike
                for streamed in (True, False):
                    if stopping:
                        break
                    run = (
                        http_run(server.base, server.pid, a, streamed, seed=i)
                        if server is not None
                        else one_run(tokenizer, a, streamed, seed=i)
                    )
                    runs.append(asyncio.run(run))
                    print(runs[-1], flush=True)
        finally:
            if server is not None:
                servers.stop(server)
    median = {
        mode: {
            k: statistics.median(r[k] for r in runs if r["mode"] == mode)
            for k in ("tokens_per_s", "device_busy", "host_cpu_ms_per_1k_tokens")
        }
        for mode in ("streamed", "whole")
    }
    ceiling = a.slots / (a.step_ms / 1000) if a.step_ms and not a.real_model else float("nan")
    where = "through a live server's /v1/completions" if a.http else "in process"
    device = (
        f"the real model ({a.real_model})"
        if a.real_model
        else f"the device stood in ({a.step_ms:g} ms a step, {a.prefill_ms:g} ms a prefill)"
    )
    title = (
        f"# Continuous batching, {device}, {where}: {a.slots} slots, {a.requests} requests (80 % x 16 tokens, "
        f"20 % x 256)\n\nMedians of {a.repeats} runs a mode: "
        + ", ".join(
            f"{mode} {m['tokens_per_s']:,.0f} output tokens/s"
            + ("" if a.http else f" (device busy {m['device_busy']:.2f})")
            for mode, m in median.items()
        )
        + ("" if math.isnan(ceiling) else f"; a full step's ceiling {ceiling:,.0f} tokens/s")
        + "\n"
    )
    table = report.table(
        [
            "run",
            "mode",
            "tokens",
            "wall s",
            "output tokens/s",
            "device busy",
            "host CPU-ms / 1k tokens",
            "steps",
            "prefills",
            "moved",
        ],
        [
            [
                i // 2 + 1,
                r["mode"],
                r["tokens"],
                r["wall_s"],
                r["tokens_per_s"],
                report.fmt(r["device_busy"], ".2f"),
                r["host_cpu_ms_per_1k_tokens"],
                r["steps"],
                r["prefills"],
                r["moved"],
            ]
            for i, r in enumerate(runs)
        ],
    )
    print("\n" + title + "\n" + table, flush=True)
    prov = report.provenance()
    md = title + "\n" + table + "\n\nmachine: " + str(prov["machine"]) + "\n\ngit: " + str(prov["git"]) + "\n"
    paths = report.write(
        common.run_name(a, "stepper-host"),
        {**prov, "settings": vars(a), "runs": runs, "medians": median},
        md,
        common.out_dir(a),
    )
    print("\n" + report.written(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
