"""Embeddings on the real all-MiniLM-L6-v2 weights (issue 11), one command, three parts in one run:

    python -m bench.embed_bench                  # about 8 minutes on 2 cores; prints the table
    python -m bench.embed_bench --record         # the same, and writes bench/results/embed-<time>.{md,json}
    python -m bench.embed_bench --smoke          # a quick check of the whole path (not a measurement)

1. Offline: the model alone (the `minilm` backend's own `batch`, in a child process, nothing else running) at
   batch sizes 1, 8, 32 and 64: the limit a server on this machine can approach.
2. batchserve: `batchserve serve --backend minilm --max-batch-size 64`, driven open-loop (Poisson arrivals,
   latency counted from each request's scheduled time, see bench/loadgen.py) with one input per
   `POST /v1/embeddings` request, at several rates (by default fractions of the offline peak).
3. Infinity (`infinity_emb v2`, torch engine, CPU, the same extracted model directory, batch size 64, no
   network) under the very same schedules. It is installed in its own virtualenv, because it pins other
   versions of transformers and sentence-transformers:

       python3 -m venv .venv-infinity && .venv-infinity/bin/pip install torch==2.13.0 \\
           && .venv-infinity/bin/pip install "infinity-emb[server,torch]"

   Without that venv (or with --no-infinity) this part is skipped with a note.

Per row: the sustained rate (answers with a 384-float vector per second of the measured window), p50/p95/p99,
errors (non-200 answers, client timeouts), the server's CPU (cores, from /proc), and for batchserve its mean
batch size and the goodput as a share of the offline throughput at that batch size. Both servers get the same
torch thread count (one fewer than the usable cores: the other core serves HTTP; docs/backends.md says why).
Loopback only; every server is stopped by its PID.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/embed_bench.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import asyncio
import json
import math
import os
import random
import socket
import subprocess
import time
from dataclasses import asdict, dataclass, field

import aiohttp
import numpy as np
import uvloop

from bench import common, report, servers
from bench.plot import Curves, Point
from bench.procstat import raise_fd_limit, tree_cpu_s
from bench.rawclient import drive_raw
from bench.schedule import poisson_schedule

REPO = Path(__file__).resolve().parent.parent
INFINITY_VENV = REPO / ".venv-infinity"
DIMENSIONS = 384
MAX_BATCH = 64
WORDS = (
    "the a model server batch input vector sentence fast slow queue worker request token embedding search "
    "query document answer question city river mountain music history science garden window people time "
    "light water energy market travel kitchen school letter story morning evening"
).split()


def corpus(n: int, seed: int = 7) -> list[str]:
    """Distinct sentences of 4 to 40 words (about 6 to 50 tokens), the same for every part of the run."""
    rng = random.Random(seed)
    return [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40))) for i in range(n)]


def torch_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) - 1)


# -- 1. offline ----------------------------------------------------------------------------------------------
def offline_child(batch_sizes: list[int], seconds: float, threads: int) -> None:
    """In a child process: the backend's batch call alone, per batch size; prints one JSON line."""
    from batchserve.backends.minilm import MiniLM

    model = MiniLM(["cpu"], threads=threads)
    model.setup("cpu")
    model.warm("cpu")
    texts = corpus(4096)
    out = {}
    for bs in batch_sizes:
        times: list[float] = []
        done, k, until = 0, 0, time.perf_counter() + seconds
        while time.perf_counter() < until or len(times) < 3:
            chunk = [texts[(k + j) % len(texts)] for j in range(bs)]
            k += bs
            t = time.perf_counter()
            model.batch(chunk, "cpu")
            times.append(time.perf_counter() - t)
            done += bs
        out[bs] = {
            "inputs_per_s": done / sum(times),
            "batch_ms_p50": float(np.median(times)) * 1000,
            "batches": len(times),
        }
    print(json.dumps(out))


def offline(batch_sizes: list[int], seconds: float, threads: int) -> dict[int, dict]:
    cmd = [
        sys.executable,
        "-m",
        "bench.embed_bench",
        "--offline-child",
        "--batch-sizes",
        ",".join(map(str, batch_sizes)),
        "--offline-seconds",
        str(seconds),
        "--threads",
        str(threads),
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=servers.clean_env())
    if done.returncode != 0:
        raise RuntimeError(f"offline measurement failed:\n{done.stderr[-2000:]}")
    return {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def offline_at(limits: dict[int, dict], batch: float) -> float:
    """Offline inputs/s at a (mean) batch size, linear between the measured sizes, flat outside them."""
    sizes = sorted(limits)
    rates = [limits[s]["inputs_per_s"] for s in sizes]
    return float(np.interp(batch, sizes, rates))


# -- 2./3. servers ---------------------------------------------------------------------------------------------
@dataclass
class Target:
    name: str
    server: servers.Server
    url: str  # the embeddings endpoint
    metrics: bool  # batchserve's /metrics (batch sizes)
    # where /metrics is read: each process's own port for a `serve --processes` server (its figures are per
    # process), else the server's
    metric_bases: tuple[str, ...] = ()

    def bases(self) -> tuple[str, ...]:
        return (self.metric_bases or (self.url.rsplit("/", 2)[0],)) if self.metrics else ()


def free_port(count: int = 1) -> int:
    """A free loopback port, the first of `count` free in a row (a `serve --processes` server's own ports)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + count <= 65536 and all(_free(first + k) for k in range(1, count)):
            return first


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def start_batchserve(threads: int, log_dir: Path) -> Target:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "batchserve",
        "serve",
        "--port",
        str(port),
        "--backend",
        "minilm",
        "--max-batch-size",
        str(MAX_BATCH),
        "--jobs-db",
        "",
    ]
    config = log_dir / "batchserve-minilm.toml"
    if threads != torch_threads():
        config.write_text(f'[[models]]\nname = "minilm"\nbackend = "minilm"\n[models.options]\nthreads = {threads}\n')
        cmd += ["--config", str(config)]
    server = servers.start("batchserve", cmd, log_dir, 300, port=port)
    return Target("batchserve", server, f"http://127.0.0.1:{port}/v1/embeddings", True)


def start_infinity(venv: Path, model_dir: Path, threads: int, log_dir: Path, wait_policy: str = "") -> Target:
    """Infinity on `threads` OpenMP threads; `wait_policy` sets its OMP_WAIT_POLICY (empty: OpenMP's default)."""
    port = free_port()
    cmd = [
        str(venv / "bin" / "infinity_emb"),
        "v2",
        "--model-id",
        str(model_dir),
        "--served-model-name",
        "minilm",
        "--device",
        "cpu",
        "--engine",
        "torch",
        "--batch-size",
        str(MAX_BATCH),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-bettertransformer",
        "--no-vector-disk-cache",
        "--log-level",
        "warning",
    ]
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "DO_NOT_TRACK": "1",
        "INFINITY_ANONYMOUS_USAGE_STATS": "0",
        "OMP_NUM_THREADS": str(threads),
        **({"OMP_WAIT_POLICY": wait_policy} if wait_policy else {}),
    }
    server = servers.start("infinity", cmd, log_dir, 300, env, port=port, health="/health")
    return Target("infinity", server, f"http://127.0.0.1:{port}/embeddings", False)


# -- the load -----------------------------------------------------------------------------------------------
@dataclass
class Row:
    server: str
    rate: float
    sustained_rps: float
    count: int
    ok: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    errors: dict[str, int]
    server_cores: float | None
    mean_batch: float | None = None
    offline_at_batch: float | None = None
    goodput_share: float | None = None  # sustained / offline at the same (mean) batch size
    send_lag_p99_ms: float = math.nan
    load_avg: float = 0.0
    extra: dict = field(default_factory=dict)


async def batch_metrics(base: str) -> tuple[float, float] | None:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            async with s.get(base + "/metrics") as r:
                text = await r.text()
    except (TimeoutError, aiohttp.ClientError):
        return None
    found: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("batchserve_batch_size_sum", "batchserve_batch_size_count"):
            if line.startswith(name + "{") or line.startswith(name + " "):
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found.get("batchserve_batch_size_sum", 0.0), found.get("batchserve_batch_size_count", 0.0)


def embedding_judge(text: str, status: int, answer: dict) -> str | None:
    """A right answer: a 200 carrying one vector of the model's width; a refusal is named by its status."""
    if status != 200:
        return f"{status}"
    try:
        return None if len(answer["data"][0]["embedding"]) == DIMENSIONS else "wrong length"
    except (KeyError, IndexError, TypeError):
        return "malformed"


async def drive(
    target: Target, rate: float, duration: float, warmup: float, seed: int, texts: list[str], timeout_s: float
) -> Row:
    """Open loop: request i leaves at its scheduled time whatever the answers; latency from that time. Sent by
    `bench.rawclient` (a keep-alive connection per request in flight, no per-request objects): on 2 cores the
    client shares the machine with the server, and aiohttp's client took 0.65-0.78 ms of CPU per request here
    (0.25 cores at 350/s), CPU every server measured beside it lost."""
    sched = poisson_schedule(rate, warmup + duration, seed)
    bases = target.bases()
    # the window's edges ("start", "end"): when, the server's CPU seconds, its batch-size metrics (sum, count)
    edge_at: dict[str, float] = {}
    edge_cpu: dict[str, float] = {}
    edge_batch: dict[str, tuple[float, float] | None] = {}

    async def window() -> None:
        for key, at in (("start", t0 + warmup), ("end", t0 + warmup + duration)):
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            edge_at[key] = time.monotonic()
            edge_cpu[key] = tree_cpu_s(target.server.pid)  # with its children: `serve --processes`
            if bases:
                read = [r for r in [await batch_metrics(base) for base in bases] if r is not None]
                whole = len(read) == len(bases)  # a process not read: no mean batch for this window
                edge_batch[key] = (sum(r[0] for r in read), sum(r[1] for r in read)) if whole else None

    t0 = time.monotonic() + 0.2
    watcher = asyncio.create_task(window())
    sent = await drive_raw(
        target.url,
        sched,
        np.arange(len(sched)),
        t0,
        lambda i: texts[i % len(texts)],
        timeout_s,
        connections=4096,
        extra={"model": "minilm", "encoding_format": "float"},
        judge=embedding_judge,
    )
    await watcher
    latency, lag = sent.latency_s, sent.lag_s
    errors: dict[str, int] = {}
    for i, outcome in sent.errors:
        if sched[i] >= warmup:
            errors[outcome] = errors.get(outcome, 0) + 1
    measured = sched >= warmup
    ok = latency[measured & ~np.isnan(latency)] * 1000
    wall = edge_at["end"] - edge_at["start"]
    cpu = edge_cpu["end"] - edge_cpu["start"]
    mean_batch = None
    start_batch, end_batch = edge_batch.get("start"), edge_batch.get("end")
    if bases and start_batch and end_batch:
        (s0, c0), (s1, c1) = start_batch, end_batch
        mean_batch = (s1 - s0) / (c1 - c0) if c1 > c0 else None
    return Row(
        target.name,
        rate,
        len(ok) / duration,
        int(measured.sum()),
        len(ok),
        report.pct(ok, 50),
        report.pct(ok, 95),
        report.pct(ok, 99),
        errors,
        cpu / wall if wall > 0 else None,
        mean_batch,
        send_lag_p99_ms=report.pct(lag[measured] * 1000, 99),
        load_avg=os.getloadavg()[0],
    )


# -- the run --------------------------------------------------------------------------------------------------
def markdown(rep: dict, rows: list[Row], limits: dict[int, dict]) -> str:
    prov = rep["provenance"]
    git, machine = prov["git"], prov["machine"]
    out = [
        "# Embeddings: batchserve vs Infinity on all-MiniLM-L6-v2 (CPU)",
        "",
        f"{prov['when_utc']}, commit {str(git.get('commit'))[:9]}{' (dirty)' if git.get('dirty') else ''}, "
        f"{machine.get('cpu_model')} x{machine.get('cores')}, load average at start "
        f"{machine.get('loadavg_at_start')}",
        "",
        f"Settings: {json.dumps(rep['settings'])}",
        "",
        "## Offline (the model alone, the limit)",
        "",
        report.table(
            ["batch", "inputs/s", "batch p50 ms"],
            [[bs, v["inputs_per_s"], v["batch_ms_p50"]] for bs, v in sorted(limits.items())],
        ),
        "",
        "## Open-loop load, one input per request",
        "",
        report.table(
            [
                "offered RPS",
                "server",
                "sustained RPS",
                "p50 ms",
                "p95 ms",
                "p99 ms",
                "errors",
                "server cores",
                "mean batch",
                "share of offline",
                "load avg",
            ],
            [
                [
                    r.rate,
                    r.server,
                    r.sustained_rps,
                    r.p50_ms,
                    r.p95_ms,
                    r.p99_ms,
                    sum(r.errors.values()) if r.errors else 0,
                    r.server_cores,
                    r.mean_batch,
                    r.goodput_share,
                    r.load_avg,
                ]
                for r in rows
            ],
        ),
        "",
        "## Verdict",
        "",
    ]
    out += [f"- {line}" for line in rep["verdict"]]
    return "\n".join(out)


def verdict(rows: list[Row], p95_target: float, skipped: str) -> list[str]:
    lines = []
    bs_rows = [r for r in rows if r.server == "batchserve"]
    best = max(bs_rows, key=lambda r: r.sustained_rps, default=None)
    if best is not None and best.goodput_share is not None:
        lines.append(
            f"batchserve's best sustained rate {best.sustained_rps:.1f}/s (offered {best.rate:g}/s) at mean batch "
            f"{best.mean_batch:.1f} is {best.goodput_share:.2f}x the offline rate at that batch size "
            f"({best.offline_at_batch:.1f}/s; goal >= 0.80: {'met' if best.goodput_share >= 0.8 else 'NOT met'})"
        )

    def sustained(name: str) -> float:
        good = [
            r.sustained_rps
            for r in rows
            if r.server == name and r.p95_ms <= p95_target and sum(r.errors.values()) <= 0.01 * max(1, r.count)
        ]
        return max(good, default=0.0)

    if skipped:
        lines.append(f"Infinity: {skipped}")
        return lines
    b, i = sustained("batchserve"), sustained("infinity")
    lines.append(
        f"sustained rate with p95 <= {p95_target:.0f} ms and <= 1% errors: batchserve {b:.1f}/s, "
        f"Infinity {i:.1f}/s ({'ahead' if b > i else 'NOT ahead'})"
    )
    pairs = [(r, next((x for x in rows if x.server == "infinity" and x.rate == r.rate), None)) for r in bs_rows]
    better = sum(1 for r, x in pairs if x is not None and r.p95_ms < x.p95_ms)
    lines.append(f"p95 at equal offered rate: batchserve lower at {better} of {len(pairs)} rates")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--rates",
        default="",
        help="offered RPS, comma-separated (default: fractions of the offline peak: 0.25 0.5 0.75 0.9 1.0 1.2)",
    )
    common.add_load_flags(p, seed=11)
    p.add_argument("--batch-sizes", default="1,8,32,64", help="offline batch sizes")
    p.add_argument("--offline-seconds", type=float, default=5.0, help="offline time per batch size, s")
    p.add_argument("--threads", type=int, default=torch_threads(), help="torch threads for every part")
    p.add_argument("--p95-target", type=float, default=250.0, help="p95 bound for 'sustained rate', ms")
    p.add_argument("--infinity-venv", type=Path, default=INFINITY_VENV)
    p.add_argument("--no-infinity", action="store_true", help="skip the Infinity part")
    p.add_argument("--smoke", action="store_true", help="a quick check: 2 s windows, batch sizes 1 and 8, 2 rates")
    common.add_output_flags(p)
    p.add_argument("--offline-child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.smoke:
        a.duration, a.warmup, a.offline_seconds = 2.0, 1.0, 1.0
        a.batch_sizes = "1,8"
    return a


def curves_of(rows: list[Row]) -> Curves:
    """p95 and sustained rate per offered rate, a line per server (batchserve, Infinity)."""
    curves: Curves = {}
    for r in rows:
        curves.setdefault(r.server, []).append(Point(r.rate, r.p95_ms, r.sustained_rps))
    return curves


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    sizes = [int(x) for x in a.batch_sizes.split(",") if x]
    if a.offline_child:
        offline_child(sizes, a.offline_seconds, a.threads)
        return 0
    raise_fd_limit()
    from batchserve.backends.minilm import model_dir

    model = model_dir()  # extracted once, shared by all three parts
    print(f"offline: batch sizes {sizes}, {a.offline_seconds:g} s each, {a.threads} torch thread(s)", flush=True)
    limits = offline(sizes, a.offline_seconds, a.threads)
    for bs, v in sorted(limits.items()):
        print(f"  batch {bs:>3}: {v['inputs_per_s']:8.1f} inputs/s  (batch p50 {v['batch_ms_p50']:.1f} ms)", flush=True)
    peak = max(v["inputs_per_s"] for v in limits.values())
    fractions = (0.5, 1.0) if a.smoke else (0.25, 0.5, 0.75, 0.9, 1.0, 1.2)
    rates = [float(x) for x in a.rates.split(",") if x] or [max(1.0, round(f * peak)) for f in fractions]
    texts = corpus(20000, seed=a.seed)
    out_name = common.run_name(a, "embed")
    log_dir = common.log_dir(a, out_name)
    skipped = ""
    if a.no_infinity:
        skipped = "skipped (--no-infinity)"
    elif not (a.infinity_venv / "bin" / "infinity_emb").exists():
        skipped = (
            f"skipped: no Infinity venv at {a.infinity_venv} (create it: python3 -m venv .venv-infinity && "
            f".venv-infinity/bin/pip install torch==2.13.0 && .venv-infinity/bin/pip install "
            f'"infinity-emb[server,torch]")'
        )
    rows: list[Row] = []
    with common.guarded() as stopping:
        starters = [("batchserve", lambda: start_batchserve(a.threads, log_dir))]
        if not skipped:
            starters.append(("infinity", lambda: start_infinity(a.infinity_venv, model, a.threads, log_dir)))
        for name, starter in starters:
            print(f"{name}: starting", flush=True)
            target = starter()
            try:
                for k, rate in enumerate(rates):
                    if stopping:
                        break
                    row = uvloop.run(drive(target, rate, a.duration, a.warmup, a.seed + k, texts, a.timeout))
                    if row.mean_batch is not None:
                        row.offline_at_batch = offline_at(limits, row.mean_batch)
                        row.goodput_share = row.sustained_rps / row.offline_at_batch
                    rows.append(row)
                    print(
                        f"  {name:<10} offered {rate:7.1f}/s: sustained {row.sustained_rps:7.1f}/s, p50 "
                        f"{row.p50_ms:7.1f} p95 {row.p95_ms:7.1f} p99 {row.p99_ms:7.1f} ms, errors "
                        f"{row.errors or 0}, server {report.fmt(row.server_cores, '.2f')} cores, mean batch "
                        f"{report.fmt(row.mean_batch)}, share of offline {report.fmt(row.goodput_share, '.2f')}",
                        flush=True,
                    )
            finally:
                servers.stop(target.server)
    if skipped:
        print(f"infinity: {skipped}")
    rep = {
        "provenance": report.provenance(),
        "offline": limits,
        "rows": [asdict(r) for r in rows],
        "settings": {
            "rates": rates,
            "duration_s": a.duration,
            "warmup_s": a.warmup,
            "threads": a.threads,
            "max_batch": MAX_BATCH,
            "p95_target_ms": a.p95_target,
            "seed": a.seed,
            "smoke": a.smoke,
            "model_dir": str(model),
        },
    }
    rep["verdict"] = verdict(rows, a.p95_target, skipped)
    text = markdown(rep, rows, limits)
    print()
    print(text)
    print(
        "\n"
        + report.written(
            report.write(
                out_name,
                rep,
                text,
                common.out_dir(a),
                curves=curves_of(rows),
                plot_title="embeddings: batchserve beside its peers",
            ),
            log_dir,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
