"""In-server batch time against offline batch time, and the event loop's responsiveness, for the real model
under open-loop load, with each executor (issue 13, item 2).

Why: the worker thread that runs a batch shares the server's interpreter lock (and, on a CPU, its cores) with
the event loop. If they slow each other, a batch takes longer in the server than alone (the learned S and every
deadline and admission decision built on it get worse), and the loop answers late while batches run. This puts
numbers on both, for `--executor thread` and `--executor process`:

1. offline: the smollm2 backend in this process, no server, `run()` on batches of each `--sizes`, median of
   `--repeats` (after one warm-up run per size);
2. for each executor, a fresh `batchserve serve --backend smollm2` (generation off), and for each rate an
   open-loop Poisson load (`model_load.py`): achieved rate, p50/p95, mean batch size, the mean in-server batch
   time (`batchserve_batch_compute_seconds`) beside the offline time at that mean size, server CPU (device
   processes included), and GET /healthz latency sampled every 50 ms during the load.

    python -m bench.executor_bench                                   # CPU, real weights, ~10 minutes
    python -m bench.executor_bench --duration 10 --rates 1 --sizes 1,2 --max-new-tokens 4   # a smoke run
    python -m bench.executor_bench --smollm2-dir .gpu/smollm2 --rates 100,200,300 --sizes 1,8,32,64,100 \\
        --max-new-tokens 64 --out $OUT/server.md                   # on a GPU (gpu_check.sh does this)

Writes results to bench/results/ only with --record (or to --out).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchserve import metrics
from bench import common, servers
from bench.model_load import LoadRow, inputs, interpolate, run_load


@dataclass
class Offline:
    seconds: dict[int, float]  # median seconds of a batch, by size
    padded_to: tuple[int, ...]  # the sizes a batch is padded up to (CUDA graphs), or () when it runs at its own


def offline(a: argparse.Namespace) -> Offline:
    """Median seconds of `backend.run` per batch size, in this process (no server), and the backend's padding."""
    from batchserve.backends import resolve_backend
    from batchserve.backends.smollm2 import SmolLM2Backend
    from batchserve.config import ModelSpec, Settings

    settings = Settings(
        backend=a.backend,
        max_new_tokens=a.max_new_tokens,
        smollm2_dir=a.smollm2_dir,
        decode=a.decode,
        max_batch_size=max(a.sizes),
    )
    backend_class = resolve_backend(a.backend).target  # smollm2, or a SmolLM2Backend subclass (static_host)
    assert isinstance(backend_class, type) and issubclass(backend_class, SmolLM2Backend), a.backend
    backend = backend_class.from_settings(ModelSpec("smollm2", backend=a.backend), settings)
    device = backend.devices[0]
    backend.warm(device)
    decoder = backend.decoders[0] if backend.decoders else None
    padded_to = tuple(decoder.batch_buckets) if decoder is not None and decoder.fixed_shapes else ()
    times = {}
    for size in a.sizes:
        batch = inputs(size)
        backend.batch(batch, device)
        runs = []
        for _ in range(a.repeats):
            started = time.perf_counter()
            backend.batch(batch, device)
            runs.append(time.perf_counter() - started)
        times[size] = statistics.median(runs)
        print(f"offline batch of {size}: {times[size] * 1000:.1f} ms", flush=True)
    del backend, decoder
    gc.collect()
    return Offline(times, padded_to)


def offline_reference_s(off: Offline, batch_sizes: dict[str, int], mean_batch: float) -> tuple[float, str]:
    """The offline time of the batches the server ran, and how it was read. A padding backend runs a batch at
    the padded size, so the offline time at the mean size (between two padded sizes) understates what those
    batches cost alone: each size bin of the server's histogram is read at the padded size of its upper bound
    (a bin holds one padded size when no padding size falls strictly inside it: true of the static decoder's
    1/8/16/32/64/100 and the histogram's bounds). Otherwise, or without padding: the time at the mean size."""
    counts = {float(bound): n for bound, n in batch_sizes.items()}
    if off.padded_to and counts:
        bounds = sorted(float(b) for b in metrics.BATCH_SIZE_BUCKETS)
        lower = {b: max([x for x in bounds if x < b], default=0.0) for b in counts}
        if all(not any(lower[b] < p < b for p in off.padded_to) for b in counts):
            total = 0.0
            for bound, n in counts.items():
                padded = next((p for p in off.padded_to if p >= bound), off.padded_to[-1])
                total += n * interpolate(off.seconds, padded)
            return total / sum(counts.values()), "padded"
    return interpolate(off.seconds, mean_batch), "mean size"


def server_cmd(a: argparse.Namespace, executor: str) -> list[str]:
    cmd = servers.serve_cmd(
        a.backend,
        "--generation",
        a.generation,
        "--executor",
        executor,
        "--decode",
        a.decode,
        "--max-new-tokens",
        str(a.max_new_tokens),
        "--max-batch-size",
        str(max(a.sizes)),
        "--slo-ms",
        str(a.slo_ms),
        "--timeout-ms",
        str(a.timeout_s * 1000),
        "--max-timeout-ms",
        str(a.timeout_s * 1000),
        "--jobs-db",
        "",
    )
    return cmd + (["--smollm2-dir", a.smollm2_dir] if a.smollm2_dir else [])


def table(rows: list[dict[str, Any]]) -> str:
    head = [
        "executor",
        "rate",
        "achieved/s",
        "ok/sent",
        "errors",
        "p50 ms",
        "p95 ms",
        "server p95 ms",
        "mean batch",
        "batch ms in server",
        "batch ms offline",
        "in/off",
        "offline at mean size",
        "server cores",
        "healthz p50/p99/max ms",
        "ready s",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        errors = ", ".join(f"{k}: {v}" for k, v in r["errors"].items()) or "0"
        lines.append(
            f"| {r['executor']} | {r['rate']:g} | {r['achieved_rps']} | {r['ok']}/{r['sent']} | {errors} | "
            f"{r['p50_ms']} | {r['p95_ms']} | {r['server_p95_ms']} | {r['mean_batch']} | {r['batch_ms']} | "
            f"{r['offline_ms']} | {r['ratio']} | {r.get('offline_mean_size_ms', '')} | "
            f"{r['server_cores']} | "
            f"{r['healthz_p50_ms']}/{r['healthz_p99_ms']}/{r['healthz_max_ms']} | {r.get('ready_s', '')} |"
        )
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "load_avg": os.getloadavg(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        info["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=common.RESULTS.parent,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    info["commit"] = info.get("commit") or os.environ.get("COMMIT", "")  # the GPU machine's copy has no .git
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--executors", default="thread,process")
    p.add_argument("--rates", default="1,2", help="offered requests per second, one row each")
    p.add_argument("--process-rates", default="", help="rates for --executor process (default: --rates)")
    common.add_load_flags(p, duration=30.0, warmup=None, seed=None, timeout=None)
    p.add_argument("--sizes", default="1,2,4,8", help="offline batch sizes; the largest is the server's max batch")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--decode", default="static", choices=("static", "generate"))
    p.add_argument(
        "--backend",
        default="smollm2",
        help="smollm2, or package.module:Class for a SmolLM2Backend subclass (bench/static_host.py's stood-in device)",
    )
    p.add_argument(
        "--generation",
        default="off",
        choices=("off", "on"),
        help="the server's generation engine (on: /v1/inference may run on the slot stepper, issue 25)",
    )
    p.add_argument(
        "--smollm2-dir", default="", help="transformers-format SmolLM2 (random weights when it has no weight files)"
    )
    p.add_argument("--slo-ms", type=float, default=10000.0)
    p.add_argument("--timeout-s", type=int, default=120)
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--record", action="store_true", help="write bench/results/executor-<time>.{md,json}")
    p.add_argument("--out", default="", help="write the table (markdown) here and a .json beside it")
    a = p.parse_args(argv)
    a.sizes = [int(s) for s in a.sizes.split(",")]
    started = common.stamp()
    settings = {k: v for k, v in vars(a).items() if k not in ("record", "out")}
    if a.backend != "smollm2":
        settings["STATIC_STAND_IN"] = os.environ.get("STATIC_STAND_IN", "")  # bench/static_host.py's device
    off = offline(a)
    rows: list[dict[str, Any]] = []
    out = a.out or (str(common.RESULTS / f"executor-{started}.md") if a.record else "")
    # Server logs beside the table when it is written, else in a temporary folder: never the checkout unasked.
    logs = Path(out).parent / "logs" / f"executor-{started}" if out else Path(tempfile.mkdtemp(prefix="executor-"))
    with common.guarded() as stopping:
        for executor in a.executors.split(","):
            if stopping:
                break
            server = servers.start(f"executor-{executor}", server_cmd(a, executor), logs, timeout_s=a.start_timeout_s)
            try:
                rates = a.process_rates if executor == "process" and a.process_rates else a.rates
                for k, rate in enumerate(float(r) for r in rates.split(",")):
                    row: LoadRow = asyncio.run(
                        run_load(server.base, rate, a.duration, server.pid, seed=k, timeout_s=a.timeout_s)
                    )
                    d = row.as_dict()
                    d["executor"] = executor
                    d["ready_s"] = round(server.ready_s, 1)  # start to /readyz: a spawned child loads and warms
                    try:  # no static batches (/v1/inference on the stepper): no offline reference
                        reference, d["offline_read"] = offline_reference_s(off, row.batch_sizes, row.mean_batch)
                        d["offline_mean_size_ms"] = round(interpolate(off.seconds, row.mean_batch) * 1000, 1)
                    except (TypeError, ValueError, ZeroDivisionError):
                        reference, d["offline_read"] = 0.0, "none"
                    d["offline_ms"] = round(reference * 1000, 1)
                    d["ratio"] = round(d["batch_ms"] / d["offline_ms"], 2) if d["offline_ms"] else math.nan
                    rows.append(d)
                    print(table(rows[-1:]), flush=True)
            finally:
                servers.stop(server)
    offline_rows = "\n".join(f"| {n} | {s * 1000:.1f} |" for n, s in off.seconds.items())
    padding = (
        f"each read at the size it is padded to ({', '.join(map(str, off.padded_to))}), from the server's "
        "batch-size histogram"
        if off.padded_to
        else "the offline time at the mean size"
    )
    text = (
        f"# In-server vs offline batch time, {a.backend} ({a.decode}, {a.max_new_tokens} new tokens)\n\n"
        f"Offline (no server, median of {a.repeats}):\n\n| batch size | ms |\n|---|---|\n{offline_rows}\n\n"
        f"Under open-loop load, {a.duration:g} s a row (batch ms in server = mean backend time of a batch; "
        f"offline = the offline time of the same batches: {padding}; healthz = GET /healthz latency during "
        "the load; ready s = from the server's start to /readyz 200):\n\n"
        f"{table(rows)}\n\n```\n{json.dumps({'machine': machine(), 'settings': settings}, indent=1)}\n```\n"
    )
    print("\n" + text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
        Path(out).with_suffix(".json").write_text(
            json.dumps(
                {
                    "machine": machine(),
                    "settings": settings,
                    "offline_s": off.seconds,
                    "padded_to": off.padded_to,
                    "rows": rows,
                },
                indent=1,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
