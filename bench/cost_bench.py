"""Predictions that hold on a real model (issue 22): minilm under overload, batchserve and Infinity side by side.

    python -m bench.cost_bench                 # about 6 minutes on 2 cores; prints the table
    python -m bench.cost_bench --record        # the same, and writes bench/results/cost-<time>.{md,json}
    python -m bench.cost_bench --smoke         # a quick check of the whole path (not a measurement)
    python -m bench.cost_bench --capacity 112 --fractions 1.3 --no-infinity   # one row, ~30 s: a quick look

One run, all-MiniLM-L6-v2 on the CPU (`--backend minilm`), one input of 8 to 40 words per `POST /v1/embeddings`:

1. Capacity, closed loop (`--concurrency` callers, each sending its next request when answered, timeout 60 s; a
   503 waits its retry_after_ms, at least 50 ms): answered inputs per second, twice —
   - "count": length classes off (`group_by_length = false`) and no cost budget (`--slo-ms` so large that no
     batch is lowered to fit it): batches fill by count, as before issue 22;
   - "cost": the defaults (length classes, the budget fitted to the latency objective).
   The ratio is what sorting plus the budget change in capacity.
2. Open loop (Poisson arrivals, latency from each request's scheduled time) at 0.6x, 1x, 1.3x and 2x the "cost"
   capacity, each against batchserve (defaults) and Infinity (`infinity_emb v2`, torch engine, the same model
   directory, batch size 64; its own venv, see bench/embed_bench.py; skipped with a note when it is missing).
   Per row: answered/s, goodput/s (answers within the request's deadline — batchserve's default timeout, the
   same bound applied to Infinity's answers), p50/p95 of the answers, 503 at the door, 504 after admission,
   other errors.

The verdict checks issue 22's bar: at 1.3x and 2x batchserve answers >= 0.9 x its capacity per second with 0 x
504 and an answered p95 <= SLO x slack; its goodput >= Infinity's at every rate. Loopback only; every server is
stopped by its PID.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/cost_bench.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import asyncio
import json
import random
import time
import urllib.request
from dataclasses import asdict, dataclass, field

import aiohttp
import numpy as np
import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench import common, report, servers
from bench.embed_bench import INFINITY_VENV, WORDS, Target, free_port, start_infinity, torch_threads
from bench.model_load import bins, histogram_counts
from bench.procstat import raise_fd_limit
from bench.schedule import poisson_schedule

FRACTIONS = (0.6, 1.0, 1.3, 2.0)
SLACK = 1.25  # the server's --admission-slack (its default): the p95 bound is SLO x this


def corpus(n: int, seed: int) -> list[str]:
    """Distinct inputs of 8 to 40 words."""
    rng = random.Random(seed)
    return [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) for i in range(n)]


def start_batchserve(mode: str, threads: int, log_dir: Path) -> Target:
    """batchserve on minilm: "cost" (the defaults) or "count" (no length classes, no budget)."""
    port = free_port()
    options = [f"threads = {threads}"]
    cmd = [sys.executable, "-m", "batchserve", "serve", "--port", str(port), "--jobs-db", "", "--log-level", "info"]
    if mode == "count":
        options.append("group_by_length = false")
        cmd += ["--slo-ms", "60000", "--timeout-ms", "2000"]
    config = log_dir / f"batchserve-{mode}.toml"
    log_dir.mkdir(parents=True, exist_ok=True)
    config.write_text('[[models]]\nname = "minilm"\nbackend = "minilm"\n[models.options]\n' + "\n".join(options) + "\n")
    cmd += ["--config", str(config)]
    server = servers.start(f"batchserve-{mode}", cmd, log_dir, 300, port=port)
    return Target(f"batchserve-{mode}", server, f"http://127.0.0.1:{port}/v1/embeddings", True)


def health(target: Target) -> dict:
    base = target.url.rsplit("/", 2)[0]
    import urllib.request

    with urllib.request.urlopen(base + "/internal/health", timeout=5) as r:
        return json.loads(r.read())


async def capacity(target: Target, seconds: float, concurrency: int, texts: list[str]) -> dict:
    """Closed loop: answered inputs per second with `concurrency` callers."""
    done = {"ok": 0, "refused": 0, "other": 0}
    stop_at = time.monotonic() + seconds
    counting_from = time.monotonic() + min(3.0, seconds / 4)  # the first seconds fill the queue: not counted
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as session:

        async def caller(k: int) -> None:
            i = k
            while time.monotonic() < stop_at:
                body = orjson.dumps({"input": texts[i % len(texts)], "model": "minilm", "timeout_ms": 60000})
                i += concurrency
                async with session.post(target.url, data=body, headers={"Content-Type": "application/json"}) as r:
                    raw = await r.read()
                counted = time.monotonic() >= counting_from
                if r.status == 200:
                    done["ok"] += counted
                elif r.status == 503:
                    done["refused"] += counted
                    retry = orjson.loads(raw).get("error", {}).get("retry_after_ms") or 0
                    await asyncio.sleep(min(1.0, max(0.05, float(retry) / 1000)))
                else:
                    done["other"] += counted

        await asyncio.gather(*(caller(k) for k in range(concurrency)))
    window = seconds - (counting_from - (stop_at - seconds))
    return {"inputs_per_s": done["ok"] / window, **done, "window_s": window}


@dataclass
class Row:
    server: str
    fraction: float
    rate: float
    count: int
    answered_per_s: float
    goodput_per_s: float
    p50_ms: float
    p95_ms: float
    refused_503: int
    late_504: int
    other_errors: dict[str, int] = field(default_factory=dict)
    # batchserve's own view over the row, from its /metrics histograms (the bucket holding the 95th percentile,
    # as its upper bound): arrival to answer, and queue wait. Beside the client's p95 they split the time the
    # server knows of from the time spent before it reads a request or after it writes the answer.
    server_p95_ms: float = float("nan")
    server_queue_p95_ms: float = float("nan")
    # Admission's own check (batchserve_admission_*_wait_seconds_total over the row): the queue wait of requests
    # admitted under pressure, observed over predicted (before its calibration), and the factor it applied at
    # the end. Less sensitive to a busy machine than the latencies: both sides see the same slowdown.
    wait_ratio: float = float("nan")
    calibrated: int = 0
    wait_factor: float = float("nan")
    wait_margin_ms: float = float("nan")
    rows_per_batch: float = float("nan")  # inputs per batch over the row (batchserve_batch_size): what it runs at


async def drive(
    target: Target,
    fraction: float,
    rate: float,
    duration: float,
    warmup: float,
    seed: int,
    texts: list[str],
    deadline_s: float,
    client_timeout_s: float,
) -> Row:
    """Open loop: request i leaves at its scheduled time whatever the answers; latency from that time."""
    sched = poisson_schedule(rate, warmup + duration, seed)
    n = len(sched)
    latency = np.full(n, np.nan)
    status = np.zeros(n, dtype=np.int32)
    other: dict[str, int] = {}
    connector = aiohttp.TCPConnector(limit=4096, limit_per_host=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=client_timeout_s)
    ) as session:

        async def send(i: int, due: float) -> None:
            body = orjson.dumps({"input": texts[i % len(texts)], "model": "minilm", "encoding_format": "float"})
            try:
                async with session.post(target.url, data=body, headers={"Content-Type": "application/json"}) as r:
                    raw = await r.read()
                status[i] = r.status
                if r.status == 200:
                    if len(orjson.loads(raw)["data"][0]["embedding"]) == 384:
                        latency[i] = time.monotonic() - due
                    else:
                        status[i] = -1
            except (TimeoutError, aiohttp.ClientError, OSError, KeyError, orjson.JSONDecodeError) as exc:
                status[i] = -1
                if sched[i] >= warmup:
                    other[type(exc).__name__] = other.get(type(exc).__name__, 0) + 1

        t0 = time.monotonic() + 0.2
        tasks = []
        for i, offset in enumerate(sched):
            due = t0 + float(offset)
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tasks.append(asyncio.create_task(send(i, due)))
        await asyncio.gather(*tasks)
    measured = sched >= warmup
    ok = latency[measured & (status == 200)]
    for code in set(status[measured].tolist()) - {200, 503, 504, -1, 0}:
        other[str(code)] = int((status[measured] == code).sum())
    return Row(
        target.name.replace("-cost", ""),
        fraction,
        rate,
        int(measured.sum()),
        len(ok) / duration,
        int((ok <= deadline_s).sum()) / duration,
        report.pct(ok * 1000, 50),
        report.pct(ok * 1000, 95),
        int((status[measured] == 503).sum()),
        int((status[measured] == 504).sum()),
        other,
    )


def verdict(rows: list[Row], cap: float, caps: dict[str, dict], slo_ms: float, skipped: str) -> list[str]:
    lines = []
    count, cost = caps["count"]["inputs_per_s"], caps["cost"]["inputs_per_s"]
    lines.append(
        f"capacity: {cost:.1f} inputs/s with length classes and the cost budget, {count:.1f}/s by count "
        f"alone: x{cost / count:.2f}"
        if count
        else "capacity by count: not measured"
    )
    bound = slo_ms * SLACK
    for r in rows:
        if r.server != "batchserve" or r.fraction < 1.3:
            continue
        ok = r.answered_per_s >= 0.9 * cap and r.late_504 == 0 and r.p95_ms <= bound
        lines.append(
            f"{r.fraction:g}x ({r.rate:.0f}/s): answered {r.answered_per_s:.1f}/s (>= {0.9 * cap:.1f}), "
            f"{r.late_504} x 504, p95 {r.p95_ms:.0f} ms (<= {bound:.0f}): {'met' if ok else 'NOT met'}"
        )
    if skipped:
        lines.append(f"Infinity: {skipped}")
        return lines
    for r in rows:
        if r.server != "batchserve":
            continue
        inf = next((x for x in rows if x.server == "infinity" and x.fraction == r.fraction), None)
        if inf is not None:
            lines.append(
                f"{r.fraction:g}x goodput: batchserve {r.goodput_per_s:.1f}/s, Infinity "
                f"{inf.goodput_per_s:.1f}/s ({'>=' if r.goodput_per_s >= inf.goodput_per_s else 'BELOW'})"
            )
    return lines


def markdown(rep: dict, rows: list[Row]) -> str:
    prov = rep["provenance"]
    git, machine = prov["git"], prov["machine"]
    caps = rep["capacity"]
    out = [
        "# Cost, not count: minilm under overload, batchserve vs Infinity (CPU)",
        "",
        f"{prov['when_utc']}, commit {str(git.get('commit'))[:9]}{' (dirty)' if git.get('dirty') else ''}, "
        f"{machine.get('cpu_model')} x{machine.get('cores')}, load average at start "
        f"{machine.get('loadavg_at_start')}",
        "",
        f"Settings: {json.dumps(rep['settings'])}",
        "",
        "## Capacity (closed loop)",
        "",
        report.table(
            ["batchserve", "inputs/s", "answered", "503 (waited retry_after)", "window s"],
            [[k, v["inputs_per_s"], v["ok"], v["refused"], v["window_s"]] for k, v in caps.items()],
        ),
        "",
        f"## Open loop, one input per request (deadline {rep['settings']['deadline_ms']:.0f} ms, "
        f"SLO {rep['settings']['slo_ms']:.0f} ms)",
        "",
        report.table(
            [
                "x capacity",
                "offered/s",
                "server",
                "answered/s",
                "goodput/s",
                "p50 ms",
                "p95 ms",
                "server's p95 ms (bucket)",
                "server's queue p95 ms (bucket)",
                "503",
                "504",
                "other errors",
                "rows/batch",
                "wait observed/predicted",
                "compared",
                "factor",
                "margin ms",
            ],
            [
                [
                    r.fraction,
                    r.rate,
                    r.server,
                    r.answered_per_s,
                    r.goodput_per_s,
                    r.p50_ms,
                    r.p95_ms,
                    r.server_p95_ms,
                    r.server_queue_p95_ms,
                    r.refused_503,
                    r.late_504,
                    sum(r.other_errors.values()),
                    r.rows_per_batch,
                    r.wait_ratio,
                    r.calibrated,
                    r.wait_factor,
                    r.wait_margin_ms,
                ]
                for r in rows
            ],
        ),
        "",
        "The server's columns are batchserve's own histograms over the row (upper bound of the bucket "
        "holding the 95th percentile): arrival at the route to answer, and arrival to dispatch in a batch; "
        "the client's p95 adds what happens before the server reads a request and after it writes the answer. "
        "'wait observed/predicted': for the requests admitted under pressure in the row, their queue waits "
        "(admission to their first batch) summed over what admission predicted before calibration; "
        "'factor' and 'margin': the calibration admission applied at the end of the row "
        "(core/wait_calibration.py).",
        "",
        "## Verdict",
        "",
    ]
    out += [f"- {line}" for line in rep["verdict"]]
    return "\n".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    common.add_load_flags(p, duration=20.0, warmup=3.0, seed=22, timeout=15.0)
    p.add_argument("--capacity-seconds", type=float, default=15.0, help="closed-loop window per mode, s")
    p.add_argument("--concurrency", type=int, default=16, help="closed-loop callers")
    p.add_argument("--threads", type=int, default=torch_threads(), help="torch threads for both servers")
    p.add_argument("--infinity-venv", type=Path, default=INFINITY_VENV)
    p.add_argument("--no-infinity", action="store_true", help="skip the Infinity rows")
    p.add_argument("--smoke", action="store_true", help="a quick check: short windows, no count mode")
    p.add_argument(
        "--fractions",
        type=lambda v: tuple(float(x) for x in v.split(",")),
        default=FRACTIONS,
        help="open-loop rates as fractions of capacity, comma-separated (default %(default)s)",
    )
    p.add_argument(
        "--capacity",
        type=float,
        default=0.0,
        help="inputs/s to take as the capacity instead of measuring it (skips both closed loops)",
    )
    common.add_output_flags(p)
    a = p.parse_args(argv)
    if a.smoke:
        a.duration, a.warmup, a.capacity_seconds = 3.0, 1.0, 4.0
    return a


def scrape(target: Target) -> str:
    """batchserve's /metrics text ("" for a server without it)."""
    if not target.metrics:
        return ""
    base = target.url.rsplit("/v1/", 1)[0]
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        return r.read().decode()


def bucket_p95_ms(before: str, after: str, name: str) -> float:
    """The upper bound (ms) of the histogram bucket that holds the 95th percentile of what was observed between
    two scrapes; nan when nothing was."""
    counts = bins(histogram_counts(before, name), histogram_counts(after, name))
    total = sum(counts.values())
    seen = 0
    for bound in sorted(counts):
        seen += counts[bound]
        if total and seen >= 0.95 * total:
            return bound * 1000
    return float("nan")


def samples(text: str, prefix: str = "batchserve_admission_") -> dict[str, float]:
    """The samples of /metrics whose name starts with `prefix`, summed over their labels."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def with_server_view(row: Row, before: str, after: str) -> Row:
    if before and after:
        row.server_p95_ms = bucket_p95_ms(before, after, "batchserve_request_duration_seconds")
        row.server_queue_p95_ms = bucket_p95_ms(before, after, "batchserve_queue_wait_seconds")
        a, b = samples(after), samples(before)
        size_a, size_b = samples(after, "batchserve_batch_size_"), samples(before, "batchserve_batch_size_")
        batches = size_a.get("batchserve_batch_size_count", 0.0) - size_b.get("batchserve_batch_size_count", 0.0)
        if batches > 0:
            row.rows_per_batch = (
                size_a.get("batchserve_batch_size_sum", 0.0) - size_b.get("batchserve_batch_size_sum", 0.0)
            ) / batches
        delta = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in a}
        predicted = delta.get("batchserve_admission_predicted_wait_seconds_total", 0.0)
        row.calibrated = int(delta.get("batchserve_admission_calibrated_requests_total", 0.0))
        if predicted > 0:
            row.wait_ratio = delta.get("batchserve_admission_actual_wait_seconds_total", 0.0) / predicted
        row.wait_factor = a.get("batchserve_admission_wait_factor", float("nan"))
        row.wait_margin_ms = a.get("batchserve_admission_wait_margin_seconds", float("nan")) * 1000
    return row


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    raise_fd_limit()
    from batchserve.backends.minilm import model_dir

    model = model_dir()
    texts = corpus(20000, a.seed)
    out_name = common.run_name(a, "cost")
    log_dir = common.log_dir(a, out_name)
    skipped = ""
    if a.no_infinity:
        skipped = "skipped (--no-infinity)"
    elif not (a.infinity_venv / "bin" / "infinity_emb").exists():
        skipped = f"skipped: no Infinity venv at {a.infinity_venv} (see bench/embed_bench.py)"
    caps: dict[str, dict] = {}
    rows: list[Row] = []
    rep: dict = {}
    with common.guarded(rep) as stopping:
        for mode in ("count", "cost") if not (a.smoke or a.capacity) else ("cost",):
            print(f"batchserve ({mode}): starting", flush=True)
            target = start_batchserve(mode, a.threads, log_dir)
            try:
                if a.capacity:
                    caps[mode] = {"inputs_per_s": a.capacity, "ok": 0, "refused": 0, "window_s": 0.0}
                else:
                    caps[mode] = asyncio.run(capacity(target, a.capacity_seconds, a.concurrency, texts))
                print(
                    f"  capacity ({mode}): {caps[mode]['inputs_per_s']:.1f} inputs/s "
                    f"({caps[mode]['refused']} x 503 waited out)",
                    flush=True,
                )
                if mode != "cost":
                    continue
                h = health(target)
                slo_ms, deadline_ms = float(h["slo_ms"]["minilm@v1"]), float(h["timeout_ms"]["minilm@v1"])  # its own
                cap = caps["cost"]["inputs_per_s"]
                rates = [round(f * cap, 1) for f in a.fractions]
                for k, (f, rate) in enumerate(zip(a.fractions, rates)):
                    if stopping:
                        break
                    before = scrape(target)
                    row = asyncio.run(
                        drive(target, f, rate, a.duration, a.warmup, a.seed + k, texts, deadline_ms / 1000, a.timeout)
                    )
                    rows.append(with_server_view(row, before, scrape(target)))
                    print_row(rows[-1])
                after = health(target)
            finally:
                servers.stop(target.server)
        if not skipped and not stopping:
            print("infinity: starting", flush=True)
            target = start_infinity(a.infinity_venv, model, a.threads, log_dir)
            try:
                for k, (f, rate) in enumerate(zip(a.fractions, rates)):
                    if stopping:
                        break
                    rows.append(
                        asyncio.run(
                            drive(
                                target, f, rate, a.duration, a.warmup, a.seed + k, texts, deadline_ms / 1000, a.timeout
                            )
                        )
                    )
                    print_row(rows[-1])
            finally:
                servers.stop(target.server)
    if "count" not in caps:
        caps["count"] = {"inputs_per_s": 0.0, "ok": 0, "refused": 0, "window_s": 0.0}
    rep.update(
        {
            "provenance": report.provenance(),
            "capacity": caps,
            "rows": [asdict(r) for r in rows],
            "batch_ms_by_size_after": after.get("batch_ms_by_size"),
            "settings": {
                "fractions": a.fractions,
                "capacity_given": a.capacity,
                "rates": rates,
                "duration_s": a.duration,
                "warmup_s": a.warmup,
                "capacity_seconds": a.capacity_seconds,
                "concurrency": a.concurrency,
                "threads": a.threads,
                "seed": a.seed,
                "smoke": a.smoke,
                "slo_ms": slo_ms,
                "deadline_ms": deadline_ms,
                "slack": SLACK,
                "words": "8-40",
                "batchserve": "--backend minilm (config file), defaults",
                "infinity": "infinity_emb v2 --engine torch --batch-size 64, CPU",
            },
        }
    )
    rep["verdict"] = verdict(rows, caps["cost"]["inputs_per_s"], caps, slo_ms, skipped)
    text = markdown(rep, rows)
    print()
    print(text)
    print("\n" + report.written(report.write(out_name, rep, text, common.out_dir(a)), log_dir))
    return 0


def print_row(r: Row) -> None:
    print(
        f"  {r.server:<10} {r.fraction:g}x = {r.rate:6.1f}/s: answered {r.answered_per_s:6.1f}/s, goodput "
        f"{r.goodput_per_s:6.1f}/s, p50 {r.p50_ms:7.1f} p95 {r.p95_ms:7.1f} ms (server's {r.server_p95_ms:g}, "
        f"queue {r.server_queue_p95_ms:g}), 503 {r.refused_503}, 504 "
        f"{r.late_504}, other {r.other_errors or 0}; {r.rows_per_batch:.1f} rows/batch; wait observed/predicted "
        f"{r.wait_ratio:.2f} over "
        f"{r.calibrated}, factor {r.wait_factor:.2f}, margin {r.wait_margin_ms:.0f} ms",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
