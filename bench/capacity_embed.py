"""Embedding capacity on all-MiniLM-L6-v2 (issue 36), one command:

    python -m bench.capacity_embed                 # ~10 minutes on 2 cores; prints the table
    python -m bench.capacity_embed --record        # the same, and writes bench/results/capacity-embed-<time>.{md,json}
    python -m bench.capacity_embed --smoke         # a quick check of the whole path (not a measurement)

Capacity = the highest offered rate answered in full (no refusal, no 504, no client timeout) with p95 <= 1 s,
single-input `POST /v1/embeddings` requests of 8-40 random words, open loop (Poisson arrivals, latency from each
request's scheduled time: bench/embed_bench.drive), a ramp of offered rates per server.

1. Offline: `SentenceTransformer(folder).encode(texts, batch_size=B)` alone in a child process, at several B: its
   best is the ceiling a server on these cores can approach.
2. batchserve "after" (this tree): `batchserve serve --model minilm=<the package's folder> --slo-ms 1000` (the
   tokenizer stage, each input tokenized once off the loop).
3. batchserve "before" (`--before COMMIT`, default the commit before issue 36's work): the same flags with
   `--backend minilm` from `git archive COMMIT` unpacked in a temporary directory (each input tokenized on the
   loop to cost it, and again on the device thread).
4. Infinity 0.0.78, when `.venv-infinity` exists (python3 -m venv .venv-infinity &&
   .venv-infinity/bin/pip install 'infinity-emb[server,torch]==0.0.78'), with the same folder and batch size.

The machine is shared (about 8 engineers on 2 cores): the load average is recorded per row, and figures move by
tens of percent between runs. Loopback only; every server is stopped by its PID.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict  # noqa: E402

from bench import common, report, servers  # noqa: E402
from bench.embed_bench import INFINITY_VENV, Row, Target, drive, free_port, start, start_infinity  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BEFORE = "b6ba887"  # the branch point of issue 36's work: minilm tokenizing on the loop and again on the device
WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river mountain music history science garden window "
         "people light water energy market travel kitchen school letter story morning evening search query "
         "document answer question model vector server batch token fast slow green quiet bright").split()
P95_LIMIT_MS = 1000.0


def corpus(n: int, seed: int) -> list[str]:
    """Distinct inputs of 8 to 40 random words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) + f" {i}" for i in range(n)]


def offline_child(folder: str, sizes: list[int], seconds: float, seed: int) -> None:
    """In a child process: sentence-transformers' encode alone per batch size; one JSON line."""
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(folder, device="cpu")
    texts = corpus(8192, seed)
    model.encode(texts[:256], batch_size=32)  # warm
    out = {}
    for bs in sizes:
        done, k, started = 0, 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            chunk = texts[k:k + bs * 4] if k + bs * 4 <= len(texts) else texts[:bs * 4]
            k = (k + bs * 4) % len(texts)
            model.encode(chunk, batch_size=bs, show_progress_bar=False)
            done += len(chunk)
        out[bs] = done / (time.perf_counter() - started)
    # What tokenizing costs beside the model, in CPU time of this thread (steadier than wall time on a shared
    # machine): one input at a time, as the loop did per request before the tokenizer stage.
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    tok.enable_truncation(256)
    started = time.thread_time()
    for text in texts[:2048]:
        tok.encode(text)
    tokenize_us = (time.thread_time() - started) / 2048 * 1e6
    started = time.thread_time()
    model.encode(texts[:512], batch_size=64, show_progress_bar=False)
    encode_us = (time.thread_time() - started) / 512 * 1e6  # this thread's share (torch's other threads apart)
    print(json.dumps({"rates": out, "threads": torch.get_num_threads(), "tokenize_cpu_us": tokenize_us,
                      "encode_cpu_us_this_thread": encode_us}))


def offline(folder: Path, sizes: list[int], seconds: float, seed: int) -> dict:
    cmd = [sys.executable, "-m", "bench.capacity_embed", "--offline-child", str(folder), "--batch-sizes",
           ",".join(map(str, sizes)), "--offline-seconds", str(seconds), "--seed", str(seed)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=servers.clean_env(),
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"offline measurement failed:\n{done.stderr[-2000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return {**got, "rates": {int(k): v for k, v in got["rates"].items()}}


def before_tree(commit: str) -> Path:
    """`git archive COMMIT` unpacked into a temporary directory (no git state touched)."""
    target = Path(tempfile.mkdtemp(prefix=f"batchserve-{commit[:9]}-"))
    archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target


def start_batchserve(name: str, tree: Path, model_args: list[str], extra: list[str], log_dir: Path,
                     profile: Path | None = None) -> Target:
    port = free_port()
    launcher = [sys.executable] + (["-m", "cProfile", "-o", str(profile)] if profile else [])
    cmd = [*launcher, "-m", "batchserve", "serve", "--port", str(port), *model_args, "--slo-ms", "1000",
           "--max-batch-size", "64", "--jobs-db", "", "--log-level", "warning", *extra]
    env = {**servers.clean_env(), "PYTHONPATH": str(tree)}
    server = servers.Server(name, cmd, log_dir / f"{name}.log", port=port)
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(server.log_path, "wb") as log:
        server.proc = subprocess.Popen(cmd, cwd=tree, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    import urllib.request

    give_up = time.monotonic() + 300
    while time.monotonic() < give_up:
        if server.proc.poll() is not None:
            raise servers.ServerFailed(f"{name} exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                if r.status == 200:
                    return Target(name, server, f"http://127.0.0.1:{port}/v1/embeddings", True)
        except OSError:
            pass
        time.sleep(0.25)
    servers.stop(server)
    raise servers.ServerFailed(f"{name} was not ready in 300 s:\n{server.log_tail()}")


def answered_in_full(row: Row) -> bool:
    return not row.errors and row.ok == row.count and row.p95_ms <= P95_LIMIT_MS


def ramp(target: Target, rates: list[float], a: argparse.Namespace, texts: list[str], stopping: list[int]) -> list[Row]:
    """Offered rates in order until two in a row are not answered in full."""
    rows: list[Row] = []
    misses = 0
    for k, rate in enumerate(rates):
        if stopping or misses >= 2:
            break
        row = asyncio.run(drive(target, rate, a.duration, a.warmup, a.seed + k, texts, a.timeout))
        rows.append(row)
        full = answered_in_full(row)
        misses = 0 if full else misses + 1
        print(f"  {target.name:<10} offered {rate:6.1f}/s: answered {row.sustained_rps:6.1f}/s, p50 {row.p50_ms:7.1f} "
              f"p95 {row.p95_ms:7.1f} ms, errors {row.errors or 0}, mean batch {report.fmt(row.mean_batch)}, "
              f"server {report.fmt(row.server_cores, '.2f')} cores, load {row.load_avg:.1f}"
              f"{'' if full else '  (not in full)'}", flush=True)
    return rows


def capacity(rows: list[Row], name: str) -> float:
    return max((r.rate for r in rows if r.server == name and answered_in_full(r)), default=0.0)


def markdown(rep: dict, rows: list[Row]) -> str:
    prov = rep["provenance"]
    git, machine = prov["git"], prov["machine"]
    off = rep["offline"]
    out = ["# Embedding capacity: all-MiniLM-L6-v2, single-input requests of 8-40 words (CPU)", "",
           f"{prov['when_utc']}, commit {str(git.get('commit'))[:9]}{' (dirty)' if git.get('dirty') else ''}, "
           f"{machine.get('cpu_model')} x{machine.get('cores')}, load average at start "
           f"{machine.get('loadavg_at_start')} (a machine shared by ~8 engineers: noisy)", "",
           f"Settings: {json.dumps(rep['settings'])}", "",
           f"## Offline: SentenceTransformer.encode ({off['threads']} torch threads)", "",
           report.table(["batch size", "inputs/s"], [[bs, v] for bs, v in sorted(off["rates"].items())]), "",
           "## Open loop, one input per request (capacity: answered in full at p95 <= 1 s)", "",
           report.table(["server", "offered/s", "answered/s", "p50 ms", "p95 ms", "p99 ms", "errors", "mean batch",
                         "server cores", "load avg"],
                        [[r.server, r.rate, r.sustained_rps, r.p50_ms, r.p95_ms, r.p99_ms,
                          json.dumps(r.errors) if r.errors else 0, r.mean_batch, r.server_cores, r.load_avg]
                         for r in rows]),
           "", "## Capacity", ""]
    out += [f"- {line}" for line in rep["verdict"]]
    if rep.get("profile"):
        out += ["", "## Where the event loop's time goes (cProfile of the server's main thread at capacity)", "",
                "```", rep["profile"], "```"]
    return "\n".join(out)


def profile_text(path: Path, lines: int = 25) -> str:
    import io
    import pstats

    buf = io.StringIO()
    pstats.Stats(str(path), stream=buf).sort_stats("tottime").print_stats(lines)
    text = buf.getvalue()
    return text[text.find("ncalls"):] if "ncalls" in text else text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rates", default="80,110,140,170,200,230,260", help="offered rates, ascending (per second)")
    common.add_load_flags(p, duration=12.0, warmup=3.0, seed=5, timeout=10.0)
    p.add_argument("--batch-sizes", default="16,32,64,128", help="offline batch sizes")
    p.add_argument("--offline-seconds", type=float, default=8.0)
    p.add_argument("--before", default=BEFORE, help="commit measured as 'before' (empty: skip)")
    p.add_argument("--servers", default="after,before,infinity", help="which servers, in order")
    p.add_argument("--profile", action="store_true", help="also profile 'after' (cProfile) at its capacity")
    p.add_argument("--infinity-venv", type=Path, default=INFINITY_VENV)
    p.add_argument("--smoke", action="store_true", help="2 s windows, two rates, one offline batch size")
    common.add_output_flags(p)
    p.add_argument("--offline-child", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.smoke:
        a.duration, a.warmup, a.offline_seconds, a.rates, a.batch_sizes = 2.0, 1.0, 1.0, "20,40", "32"
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    sizes = [int(x) for x in a.batch_sizes.split(",") if x]
    if a.offline_child:
        offline_child(a.offline_child, sizes, a.offline_seconds, a.seed)
        return 0
    from batchserve.backends.minilm import model_dir

    folder = model_dir()
    print(f"offline: SentenceTransformer.encode at batch sizes {sizes}, {a.offline_seconds:g} s each", flush=True)
    off = offline(folder, sizes, a.offline_seconds, a.seed)
    best_bs, best = max(off["rates"].items(), key=lambda kv: kv[1])
    print(f"  best {best:.1f} inputs/s at batch {best_bs} ({off['threads']} torch threads)", flush=True)
    rates = [float(x) for x in a.rates.split(",") if x]
    texts = corpus(20000, a.seed + 1)
    name = common.run_name(a, "capacity-embed")
    logs = common.log_dir(a, name)
    rows: list[Row] = []
    notes: list[str] = []
    wanted = [s for s in a.servers.split(",") if s]
    with common.guarded() as stopping:
        for which in wanted:
            if which == "after":
                starter = lambda: start_batchserve("after", REPO, ["--model", f"minilm={folder}"], [], logs)  # noqa: E731
            elif which == "before":
                if not a.before:
                    continue
                tree = before_tree(a.before)
                starter = lambda tree=tree: start_batchserve("before", tree, ["--backend", "minilm"], [], logs)  # noqa: E731
            elif which == "infinity":
                if not (a.infinity_venv / "bin" / "infinity_emb").exists():
                    notes.append(f"Infinity skipped: no venv at {a.infinity_venv} (pip install "
                                 f"'infinity-emb[server,torch]==0.0.78' there)")
                    continue
                starter = lambda: start_infinity(a.infinity_venv, folder, max(1, len(os.sched_getaffinity(0)) - 1),  # noqa: E731
                                                 logs)
            else:
                raise SystemExit(f"unknown server {which!r}")
            print(f"{which}: starting", flush=True)
            target = starter()
            try:
                rows += ramp(target, rates, a, texts, stopping)
            finally:
                servers.stop(target.server)
        profile = ""
        cap_after = capacity(rows, "after")
        if a.profile and cap_after and not stopping:
            path = logs / "after.prof"
            target = start_batchserve("after-profiled", REPO, ["--model", f"minilm={folder}"], [], logs, profile=path)
            try:
                asyncio.run(drive(target, cap_after, a.duration, a.warmup, a.seed, texts, a.timeout))
            finally:
                servers.stop(target.server)
            if path.exists():
                profile = profile_text(path)
    verdict = [f"offline SentenceTransformer.encode: {best:.1f} inputs/s at its best batch size {best_bs}"]
    for which in ("after", "before", "infinity"):
        if any(r.server == which for r in rows):
            cap = capacity(rows, which)
            verdict.append(f"{which}: capacity {cap:g}/s = {cap / best:.2f}x offline")
    inf = capacity(rows, "infinity")
    if any(r.server == "infinity" for r in rows):
        verdict.append(f"after / Infinity: {cap_after / inf:.2f}x (goal >= 1.2)" if inf else
                       "after / Infinity: no ratio (Infinity answered no offered rate in full)")
    verdict.append(f"tokenizing one input alone: {off['tokenize_cpu_us']:.0f} us of CPU; sentence-transformers' "
                   f"encode at batch 64: {off['encode_cpu_us_this_thread']:.0f} us of its calling thread's CPU per "
                   f"input (torch's other threads not counted)")
    verdict.append(f"goal after >= 0.8x offline: {'met' if cap_after >= 0.8 * best else 'NOT met'}")
    verdict += notes
    rep = {"provenance": report.provenance(), "offline": off, "rows": [asdict(r) for r in rows],
           "settings": {"rates": rates, "duration_s": a.duration, "warmup_s": a.warmup, "seed": a.seed,
                        "before": a.before, "servers": wanted, "max_batch": 64, "slo_ms": 1000,
                        "p95_limit_ms": P95_LIMIT_MS, "words": "8-40", "smoke": a.smoke},
           "verdict": verdict, "profile": profile}
    text = markdown(rep, rows)
    print()
    print(text)
    print("\n" + report.written(report.write(name, rep, text, common.out_dir(a)), logs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
