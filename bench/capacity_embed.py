"""Embedding capacity on all-MiniLM-L6-v2 (issue 36), one command:

    python -m bench.capacity_embed                 # ~10 minutes on 2 cores; prints the table
    python -m bench.capacity_embed --record        # the same, and writes bench/results/capacity-embed-<time>.{md,json}
    python -m bench.capacity_embed --smoke         # a quick check of the whole path (not a measurement)

Capacity = the highest offered rate served with p95 <= 1 s and at most 1 % refused (503/429), every other request
answered (issue 48's definition, which its ratios use; "answered in full", none refused, is given beside it),
single-input `POST /v1/embeddings` requests of 8-40 random words, open loop (Poisson arrivals, latency from each
request's scheduled time: bench/embed_bench.drive), a ramp of offered rates per server (a server leaves it after two
rates in a row past 1 % refused or p95 1 s).

1. Offline: `SentenceTransformer(folder).encode(texts, batch_size=B)` alone in a child process, at several B: its
   best is the ceiling a server on these cores can approach.
2. batchserve "after" (this tree): `batchserve serve --model minilm=<the package's folder> --slo-ms 1000` (the
   tokenizer stage, each input tokenized once off the loop).
3. batchserve "before" (`--before COMMIT`, default the commit before issue 36's work): the same flags with
   `--backend minilm` from `git archive COMMIT` unpacked in a temporary directory (each input tokenized on the
   loop to cost it, and again on the device thread).
4. batchserve "int8" (this tree, issue 48): after's flags with `--runtime onnx --quantize int8` (the graph
   exported once into a weights cache of this run), beside "offline int8": the same int8 graph alone, in a child
   process, through the embedder's own batch path (`hf.FolderEmbedder.batch`: tokenizer, graph, pooling) at
   several batch sizes.
5. Infinity 0.0.78, when `.venv-infinity` exists (python3 -m venv .venv-infinity &&
   .venv-infinity/bin/pip install 'infinity-emb[server,torch]==0.0.78'), with the same folder and batch size.

The machine is shared (about 8 engineers on 2 cores): the load average is recorded per row, and figures move by
tens of percent between runs. Loopback only; every server is stopped by its PID.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import json
import math
import os
import random
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict

import uvloop

from bench import common, report, servers, thread_profile
from bench.procstat import process_cpu_s, tree_pids
from bench.embed_bench import INFINITY_VENV, Row, Target, drive, free_port, start_infinity

REPO = Path(__file__).resolve().parent.parent
BEFORE = "b6ba887"  # the branch point of issue 36's work: minilm tokenizing on the loop and again on the device
WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact river mountain music history science garden window "
    "people light water energy market travel kitchen school letter story morning evening search query "
    "document answer question model vector server batch token fast slow green quiet bright"
).split()
P95_LIMIT_MS = 1000.0


def corpus(n: int, seed: int) -> list[str]:
    """Distinct inputs of 8 to 40 random words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) + f" {i}" for i in range(n)]


def rates_by_batch(run: Callable[[list[str]], object], texts: list[str], sizes: list[int], seconds: float) -> dict:
    """Inputs per second `run` gets through at each batch size, one batch a call for about `seconds` each (a slow
    configuration, such as two spinning threads, still ends near `seconds`)."""
    out = {}
    for bs in sizes:
        done, k, started = 0, 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            chunk = texts[k : k + bs] if k + bs <= len(texts) else texts[:bs]
            k = (k + bs) % len(texts)
            run(chunk)
            done += len(chunk)
        out[bs] = done / (time.perf_counter() - started)
    return out


def int8_child(folder: str, sizes: list[int], seconds: float, seed: int, cache: str) -> None:
    """In a child process: the int8 ONNX graph alone (exported into `cache` as the int8 server does) through
    the embedder's batch path, per batch size, on ONNX Runtime's default threads (every core); one JSON line."""
    import logging

    from batchserve.backends import onnx_runtime
    from batchserve.backends.folder import inspect_folder
    from batchserve.backends.hf import FolderEmbedder
    from batchserve.backends.token_cache import TokenCache

    said: list[str] = []  # the floor check's own line (onnx_runtime.check_int8)

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("batchserve.onnx").addHandler(Said(logging.INFO))
    logging.getLogger("batchserve.onnx").setLevel(logging.INFO)
    model = FolderEmbedder(inspect_folder(folder), ["cpu"], onnx=onnx_runtime.OnnxPlan("int8", cache=Path(cache)))
    model.setup("cpu")
    texts = corpus(8192, seed)
    model.batch(texts[:32], "cpu")  # warm

    def run(chunk: list[str]) -> object:
        model.kept = TokenCache(model.cache_bytes)  # each batch tokenized in one call, as encode does
        model.tokenize(chunk)
        return model.batch(chunk, "cpu")

    out = rates_by_batch(run, texts, sizes, seconds)
    floor = next((line for line in said if line.startswith("int8 of")), "")
    print(json.dumps({"rates": out, "threads": 0, "floor": floor}))


def offline_child(folder: str, sizes: list[int], seconds: float, seed: int, threads: int) -> None:
    """In a child process: sentence-transformers' encode alone per batch size, on `threads` torch threads (0:
    torch's own count); one JSON line."""
    import torch
    from sentence_transformers import SentenceTransformer

    if threads:
        torch.set_num_threads(threads)
    model = SentenceTransformer(folder, device="cpu")
    texts = corpus(8192, seed)
    model.encode(texts[:32], batch_size=32, show_progress_bar=False)  # warm
    out = rates_by_batch(
        lambda chunk: model.encode(chunk, batch_size=len(chunk), show_progress_bar=False), texts, sizes, seconds
    )
    if threads != 1:  # the CPU figures below are per thread: measured once, on one thread
        print(json.dumps({"rates": out, "threads": torch.get_num_threads()}))
        return
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
    print(
        json.dumps(
            {
                "rates": out,
                "threads": torch.get_num_threads(),
                "tokenize_cpu_us": tokenize_us,
                "encode_cpu_us_this_thread": encode_us,
            }
        )
    )


def offline_once(folder: Path, sizes: list[int], seconds: float, seed: int, threads: int, int8_cache: str = "") -> dict:
    cmd = [
        sys.executable,
        "-m",
        "bench.capacity_embed",
        "--offline-child",
        str(folder),
        "--batch-sizes",
        ",".join(map(str, sizes)),
        "--offline-seconds",
        str(seconds),
        "--seed",
        str(seed),
        "--offline-threads",
        str(threads),
        *(["--int8-child", int8_cache] if int8_cache else []),
    ]
    # A session of its own, as every server's (start_new_session): with the kernel's autogroup scheduling
    # (sched_autogroup_enabled) the CPU is shared by session first, so an offline child left in this process's
    # session would share one session's share with the load generator (and whatever else runs in it) while
    # each server had a whole one.
    done = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env=servers.clean_env(),
        check=False,
        start_new_session=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"offline measurement failed:\n{done.stderr[-2000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return {**got, "rates": {int(k): v for k, v in got["rates"].items()}}


def offline(folder: Path, sizes: list[int], seconds: float, seed: int, when: str, int8_cache: str = "") -> dict:
    """sentence-transformers' encode at each batch size on 1 torch thread and on torch's own count (every core):
    on a shared machine two threads that spin at each barrier while the other waits for a core can be several
    times slower than one, so its best is taken over both (the ceiling a server could approach here)."""
    cores = len(os.sched_getaffinity(0))
    runs = {}
    for threads in dict.fromkeys((1, cores)):
        got = offline_once(folder, sizes, seconds, seed, threads)
        runs[got["threads"]] = got
        print(
            f"  offline ({when}), {got['threads']} torch thread(s): "
            + ", ".join(f"batch {bs} {v:.1f}/s" for bs, v in sorted(got["rates"].items())),
            flush=True,
        )
    (threads, bs), best = max(
        (((t, bs), v) for t, got in runs.items() for bs, v in got["rates"].items()), key=lambda kv: kv[1]
    )
    first = runs[1] if 1 in runs else next(iter(runs.values()))
    int8: dict = {}
    if int8_cache:
        int8 = offline_once(folder, sizes, seconds, seed, 0, int8_cache)
        print(
            f"  offline int8 ONNX ({when}): "
            + ", ".join(f"batch {bs} {v:.1f}/s" for bs, v in sorted(int8["rates"].items())),
            flush=True,
        )
    return {
        "int8_runs": int8.get("rates", {}),
        "int8_best": max(int8["rates"].values()) if int8 else math.nan,
        "int8_floor": int8.get("floor", ""),
        "runs": {str(t): got["rates"] for t, got in runs.items()},
        "best": best,
        "best_batch": bs,
        "best_threads": threads,
        "tokenize_cpu_us": first["tokenize_cpu_us"],
        "encode_cpu_us_this_thread": first["encode_cpu_us_this_thread"],
    }


def before_tree(commit: str) -> Path:
    """`git archive COMMIT` unpacked into a temporary directory (no git state touched)."""
    target = Path(tempfile.mkdtemp(prefix=f"batchserve-{commit[:9]}-"))
    archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target


def start_batchserve(
    name: str, tree: Path, model_args: list[str], extra: list[str], log_dir: Path, profile: Path | None = None
) -> Target:
    port = free_port()
    launcher = [sys.executable] + (["-m", "cProfile", "-o", str(profile)] if profile else [])
    cmd = [
        *launcher,
        "-m",
        "batchserve",
        "serve",
        "--port",
        str(port),
        *model_args,
        "--slo-ms",
        "1000",
        "--max-batch-size",
        "64",
        "--jobs-db",
        "",
        "--log-level",
        "warning",
        *extra,
    ]
    own: tuple[str, ...] = ()  # with --processes: each process's own port, where its /metrics is read
    if "--processes" in extra:
        processes = int(extra[extra.index("--processes") + 1])
        first = free_port(processes)
        cmd += ["--process-port-base", str(first)]
        own = tuple(f"http://127.0.0.1:{first + k}" for k in range(processes))
    # cwd too: `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH
    server = servers.start(name, cmd, log_dir, 300, {"PYTHONPATH": str(tree)}, port=port, cwd=tree)
    return Target(name, server, f"http://127.0.0.1:{port}/v1/embeddings", True, own)


def answered_in_full(row: Row) -> bool:
    return not row.errors and row.ok == row.count and row.p95_ms <= P95_LIMIT_MS


REFUSED_SHARE = 0.01  # issue 48's capacity: at most 1 % refused (503/429), no 504, no other failure, p95 <= 1 s


def within_refusals(row: Row) -> bool:
    """Issue 48's definition of a rate served: at most REFUSED_SHARE of its requests refused at the door, every
    other one answered, p95 within the limit (`answered_in_full` allows no refusal at all)."""
    refused = sum(n for what, n in row.errors.items() if what in ("503", "429"))
    return refused <= REFUSED_SHARE * row.count and row.ok + refused == row.count and row.p95_ms <= P95_LIMIT_MS


def ramp(
    targets: list[Target], rates: list[float], a: argparse.Namespace, texts: list[str], stopping: list[int]
) -> list[Row]:
    """Offered rates in order, each server in turn at each rate (interleaved: the machine's load moves by the
    minute, and servers measured minutes apart would not share it), a server leaving the ramp after two rates in
    a row not answered in full."""
    rows: list[Row] = []
    misses = {t.name: 0 for t in targets}
    for k, rate in enumerate(rates):
        for target in targets:
            if stopping or misses[target.name] >= 2:
                continue
            row = uvloop.run(drive(target, rate, a.duration, a.warmup, a.seed + k, texts, a.timeout))
            rows.append(row)
            full = answered_in_full(row)
            misses[target.name] = 0 if within_refusals(row) else misses[target.name] + 1
            print(
                f"  {target.name:<10} offered {rate:6.1f}/s: answered {row.sustained_rps:6.1f}/s, p50 "
                f"{row.p50_ms:7.1f} p95 {row.p95_ms:7.1f} ms, errors {row.errors or 0}, mean batch "
                f"{report.fmt(row.mean_batch)}, server {report.fmt(row.server_cores, '.2f')} cores, load "
                f"{row.load_avg:.1f}{'' if full else '  (not in full)'}",
                flush=True,
            )
    return rows


def capacity(rows: list[Row], name: str, served: Callable[[Row], bool] = answered_in_full) -> float:
    return max((r.rate for r in rows if r.server == name and served(r)), default=0.0)


def profile_at(target: Target, rate: float, a: argparse.Namespace, texts: list[str]) -> tuple[Row, str]:
    """One more window at `rate` with the server's threads recorded (bench/thread_profile.py): each thread's
    CPU, and py-spy's busy samples by function where py-spy is installed."""
    import threading

    # a `serve --processes` server: the serving process that has used the most CPU (they share the load; the
    # parent only supervises, and multiprocessing's fork server only forks)
    busiest = max(tree_pids(target.server.pid), key=process_cpu_s)
    recorder = thread_profile.Recorder(busiest, a.duration)
    got: dict[str, thread_profile.ThreadProfile] = {}

    def record() -> None:
        time.sleep(a.warmup)
        recorder.start()
        time.sleep(a.duration)
        got["profile"] = recorder.stop()

    watcher = threading.Thread(target=record, daemon=True)
    watcher.start()
    row = uvloop.run(drive(target, rate, a.duration, a.warmup, a.seed, texts, a.timeout))
    watcher.join(a.duration + 60)
    prof = got.get("profile")
    return row, (prof.text() if prof is not None else "(no profile: the recorder did not finish)")


def markdown(rep: dict, rows: list[Row]) -> str:
    prov = rep["provenance"]
    git, machine = prov["git"], prov["machine"]
    offs = rep["offline"]
    out = [
        "# Embedding capacity: all-MiniLM-L6-v2, single-input requests of 8-40 words (CPU)",
        "",
        f"{prov['when_utc']}, commit {str(git.get('commit'))[:9]}{' (dirty)' if git.get('dirty') else ''}, "
        f"{machine.get('cpu_model')} x{machine.get('cores')}, load average at start "
        f"{machine.get('loadavg_at_start')} (a machine shared by ~8 engineers: noisy)",
        "",
        f"Settings: {json.dumps(rep['settings'])}",
        "",
        "## Offline: SentenceTransformer.encode and the int8 graph alone (inputs/s), before and after the ramp",
        "",
    ]
    sizes = sorted({int(bs) for off in offs for run in off["runs"].values() for bs in run})
    table_rows = [
        [off["when"], f"{threads} thread(s)", *[run.get(bs, run.get(str(bs))) for bs in sizes]]
        for off in offs
        for threads, run in off["runs"].items()
    ]
    table_rows += [
        [off["when"], "int8 ONNX, the embedder's batch path", *[off["int8_runs"].get(bs) for bs in sizes]]
        for off in offs
        if off.get("int8_runs")
    ]
    out += [
        report.table(["measured", "torch threads", *[f"batch {bs}" for bs in sizes]], table_rows),
        "",
        "## Open loop, one input per request (capacity: answered in full at p95 <= 1 s), servers interleaved",
        "",
        report.table(
            [
                "server",
                "offered/s",
                "answered/s",
                "p50 ms",
                "p95 ms",
                "p99 ms",
                "errors",
                "mean batch",
                "server cores",
                "load avg",
            ],
            [
                [
                    r.server,
                    r.rate,
                    r.sustained_rps,
                    r.p50_ms,
                    r.p95_ms,
                    r.p99_ms,
                    json.dumps(r.errors) if r.errors else 0,
                    r.mean_batch,
                    r.server_cores,
                    r.load_avg,
                ]
                for r in sorted(rows, key=lambda r: (r.server, r.rate))
            ],
        ),
        "",
        "## Capacity",
        "",
    ]
    out += [f"- {line}" for line in rep["verdict"]]
    if rep.get("profile"):
        out += [
            "",
            "## Where the time goes (the server's threads at after's capacity)",
            "",
            "```",
            rep["profile"],
            "```",
        ]
    return "\n".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--rates",
        default="30,45,60,65,70,75,80,85,90,100,110,120,130,140,150,160,170,180,190,200,220,240",
        help="offered rates, ascending (per second; a server leaves after two rates in a row not "
        "answered in full, so the top only costs time on a machine that reaches it: quiet, this "
        "one served 115-130/s in the issue's first measurement)",
    )
    common.add_load_flags(p, duration=10.0, warmup=3.0, seed=5, timeout=10.0)
    p.add_argument("--batch-sizes", default="16,32,64,128", help="offline batch sizes")
    p.add_argument("--offline-seconds", type=float, default=6.0)
    p.add_argument("--before", default=BEFORE, help="commit measured as 'before' (empty: skip)")
    p.add_argument(
        "--servers",
        default="after,int8,infinity",
        help="which servers (interleaved at each rate): after, int8, before, infinity, base (--base)",
    )
    p.add_argument(
        "--base",
        type=Path,
        default=None,
        help="another checkout (e.g. `git archive main | tar -x -C DIR`) run as 'base' with after's flags "
        "(--model): a change measured against it in one run (add base to --servers)",
    )
    p.add_argument(
        "--after-flags",
        default=f"--processes {len(os.sched_getaffinity(0))}",
        help="more `batchserve serve` flags for 'after' alone (split on spaces; default: one process per core, "
        "as docs/backends.md advises for an encoder on a CPU)",
    )
    p.add_argument(
        "--int8-flags",
        default=f"--max-batch-size 128 --processes {len(os.sched_getaffinity(0))}",
        help="more `batchserve serve` flags for 'int8' alone (split on spaces; default: batches up to the largest "
        "offline batch size, where the int8 graph alone is fastest, so the server may form what offline measures, "
        "and one process per core, as docs/backends.md advises for an int8 encoder on a CPU)",
    )
    p.add_argument(
        "--infinity-threads",
        type=int,
        default=0,
        help="Infinity's OMP_NUM_THREADS (default 0: every core, as batchserve's default; "
        "its idle threads sleep, OMP_WAIT_POLICY=PASSIVE, as batchserve sets them)",
    )
    p.add_argument(
        "--no-offline",
        dest="offline",
        action="store_false",
        help="skip the offline encode measurements (an A/B of servers alone; no ratio to offline)",
    )
    p.add_argument(
        "--no-profile", dest="profile", action="store_false", help="skip the thread profile of 'after' at its capacity"
    )
    p.add_argument("--infinity-venv", type=Path, default=INFINITY_VENV)
    p.add_argument("--smoke", action="store_true", help="2 s windows, two rates, one offline batch size")
    common.add_output_flags(p)
    p.add_argument("--offline-child", default="", help=argparse.SUPPRESS)
    p.add_argument("--offline-threads", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--int8-child", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.smoke:
        a.duration, a.warmup, a.offline_seconds, a.rates, a.batch_sizes = 2.0, 1.0, 1.0, "20,40", "32"
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    sizes = [int(x) for x in a.batch_sizes.split(",") if x]
    if a.offline_child and a.int8_child:
        int8_child(a.offline_child, sizes, a.offline_seconds, a.seed, a.int8_child)
        return 0
    if a.offline_child:
        offline_child(a.offline_child, sizes, a.offline_seconds, a.seed, a.offline_threads)
        return 0
    from batchserve.backends.minilm import model_dir

    folder = model_dir()
    provenance = report.provenance()  # at the start: its load average is the one before the run
    wanted = [s for s in a.servers.split(",") if s]
    int8_cache = tempfile.mkdtemp(prefix="capacity-embed-int8-") if "int8" in wanted else ""
    offs = []
    if a.offline:
        print(f"offline: SentenceTransformer.encode at batch sizes {sizes}, {a.offline_seconds:g} s each", flush=True)
        offs.append({"when": "before", **offline(folder, sizes, a.offline_seconds, a.seed, "before", int8_cache)})
    rates = [float(x) for x in a.rates.split(",") if x]
    texts = corpus(20000, a.seed + 1)
    name = common.run_name(a, "capacity-embed")
    logs = common.log_dir(a, name)
    rows: list[Row] = []
    notes: list[str] = []
    profile = ""
    with common.guarded() as stopping:
        targets: list[Target] = []
        try:
            for which in wanted:
                if which == "after":
                    targets.append(
                        start_batchserve("after", REPO, ["--model", f"minilm={folder}"], a.after_flags.split(), logs)
                    )
                elif which == "int8":
                    flags = ["--runtime", "onnx", "--quantize", "int8", "--weights-cache", int8_cache]
                    flags += a.int8_flags.split()
                    targets.append(start_batchserve("int8", REPO, ["--model", f"minilm={folder}"], flags, logs))
                elif which == "before":
                    if a.before:
                        targets.append(
                            start_batchserve("before", before_tree(a.before), ["--backend", "minilm"], [], logs)
                        )
                elif which == "base":
                    if a.base is None:
                        raise SystemExit("--servers base needs --base DIR")
                    targets.append(
                        start_batchserve("base", a.base.resolve(), ["--model", f"minilm={folder}"], [], logs)
                    )
                elif which == "infinity":
                    if not (a.infinity_venv / "bin" / "infinity_emb").exists():
                        notes.append(
                            f"Infinity skipped: no venv at {a.infinity_venv} (bench/README.md says how to make it)"
                        )
                        continue
                    threads = a.infinity_threads or len(os.sched_getaffinity(0))
                    # the threading batchserve serve sets for itself by default, so both run on the same terms
                    targets.append(start_infinity(a.infinity_venv, folder, threads, logs, "PASSIVE"))
                else:
                    raise SystemExit(f"unknown server {which!r}")
                print(f"{which}: started", flush=True)
            rows += ramp(targets, rates, a, texts, stopping)
            after = next((t for t in targets if t.name == "after"), None)
            if a.profile and after is not None and not stopping:
                at = capacity(rows, "after") or rates[0]
                print(f"after: thread profile at {at:g}/s", flush=True)
                _, profile = profile_at(after, at, a, texts)
                print(profile, flush=True)
        finally:
            for target in targets:
                servers.stop(target.server)
    if a.offline and not stopping:
        offs.append({"when": "after", **offline(folder, sizes, a.offline_seconds, a.seed, "after", int8_cache)})
    verdict = []
    best = math.nan
    if offs:
        top = max(offs, key=lambda off: off["best"])
        best = top["best"]
        verdict.append(
            f"offline SentenceTransformer.encode: {best:.1f} inputs/s at its best (batch "
            f"{top['best_batch']}, {top['best_threads']} torch thread(s), measured {top['when']} the ramp; "
            f"the higher of the two measurements is the ceiling)"
        )
    for which in ("after", "int8", "base", "before", "infinity"):
        if any(r.server == which for r in rows):
            full, cap = capacity(rows, which), capacity(rows, which, within_refusals)
            verdict.append(
                f"{which}: capacity {cap:g}/s with at most 1 % refused (issue 48's definition; the ratios below)"
                + (f" = {cap / best:.2f}x offline torch" if offs else "")
                + f"; answered in full (none refused) {full:g}/s"
            )
            early = [r.rate for r in rows if r.server == which and r.rate < 0.8 * cap and r.errors]
            verdict.append(
                f"{which}: refusals or failures below 0.8x its capacity: "
                + (f"at {', '.join(f'{x:g}' for x in early)}/s (goal: none)" if early else "none (goal met)")
            )
    int8_best = max((off["int8_best"] for off in offs if not math.isnan(off["int8_best"])), default=math.nan)
    if any(r.server == "int8" for r in rows) and not math.isnan(int8_best):
        cap = capacity(rows, "int8", within_refusals)
        verdict.append(
            f"int8 through HTTP: {cap / int8_best:.2f}x offline int8 ({int8_best:.1f}/s at its best; goal >= 0.8: "
            f"{'met' if cap >= 0.8 * int8_best else 'NOT met'}), {cap / best:.2f}x offline torch fp32 (goal >= 1.6: "
            f"{'met' if cap >= 1.6 * best else 'NOT met'}); offline int8 / offline torch {int8_best / best:.2f}x"
        )
        floors = [off["int8_floor"] for off in offs if off.get("int8_floor")]
        verdict.append(
            "the cosine floor: the int8 server started, so its probe set passed --quantize-cosine-floor 0.98; "
            + (f"measured: {floors[0]}" if floors else "the value was not captured")
        )
    cap_after = capacity(rows, "after", within_refusals)
    if any(r.server == "base" for r in rows):
        cap_base = capacity(rows, "base", within_refusals)
        verdict.append(
            f"after / base: {cap_after / cap_base:.2f}x"
            if cap_base
            else "after / base: no ratio (base answered no offered rate in full)"
        )
    inf = capacity(rows, "infinity", within_refusals)
    if any(r.server == "infinity" for r in rows):
        for which in ("after", "int8"):
            if any(r.server == which for r in rows):
                verdict.append(
                    f"{which} / Infinity: {capacity(rows, which, within_refusals) / inf:.2f}x (goal >= 1.5)"
                    if inf
                    else f"{which} / Infinity: no ratio (Infinity answered no offered rate in full)"
                )
    if offs:
        off0 = offs[0]
        verdict.append(
            f"tokenizing one input alone: {off0['tokenize_cpu_us']:.0f} us of CPU; sentence-transformers' "
            f"encode at batch 64 on 1 torch thread: {off0['encode_cpu_us_this_thread']:.0f} us of CPU per "
            f"input"
        )
        if any(r.server == "after" for r in rows):  # else there is nothing to judge (--servers without after)
            verdict.append(f"goal after >= 0.85x offline torch: {'met' if cap_after >= 0.85 * best else 'NOT met'}")
    verdict += notes
    rep = {
        "provenance": provenance,
        "offline": offs,
        "rows": [asdict(r) for r in rows],
        "settings": {
            "rates": rates,
            "duration_s": a.duration,
            "warmup_s": a.warmup,
            "seed": a.seed,
            "before": a.before,
            "base": str(a.base) if a.base else None,
            "servers": wanted,
            "max_batch": 64,
            "slo_ms": 1000,
            "p95_limit_ms": P95_LIMIT_MS,
            "words": "8-40",
            "smoke": a.smoke,
            "after_flags": a.after_flags,
            "int8_flags": a.int8_flags,
            "infinity_threads": a.infinity_threads,
        },
        "verdict": verdict,
        "profile": profile,
    }
    text = markdown(rep, rows)
    print()
    print(text)
    print("\n" + report.written(report.write(name, rep, text, common.out_dir(a)), logs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
