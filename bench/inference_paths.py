"""/v1/inference of SmolLM2 on its two paths (issue 25, item 1), in one command:

    python -m bench.inference_paths                          # CPU, the real weights: ~4 minutes
    python -m bench.inference_paths --rates 1,2 --duration 10 # shorter
    python bench/inference_paths.py --device cuda --smollm2-dir .gpu/smollm2 --rates 200,500,1000 --out $OUT/x

For each path (`--inference-path static`: static batches through the batcher; `stepper`: each input joins the
generation engine's continuous batch) a server is started and offered open-loop Poisson load of `/v1/inference`
at each rate, with prompts of mixed lengths (short questions and long instructions, drawn with a fixed seed),
`--max-new-tokens` new tokens at most, greedy. Per rate it reports answered/s (200s of the measured window per
second), p50 / p95 latency from the scheduled send, the refusals (503) and other errors, the mean `batch_size`
and `queue_ms` the answers carry; at the end, how many prompts both paths answered with the same text. It prints
a table; `--record` writes markdown and JSON (machine, commit, settings) to bench/results/, `--out DIR`
elsewhere; a plain run writes nothing into the checkout.

`bench/gpu_check.sh` can call it as its "static vs stepper for /v1/inference" table with `--device cuda`.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/inference_paths.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import numpy as np
import orjson

from bench import common, report, servers
from bench.report import fmt, pct, table
from bench.schedule import poisson_schedule

SHORT = [
    "Hi",
    "What is the capital of France?",
    "What is 2 + 2?",
    "Name a colour.",
    "Say hello in Spanish.",
    "Is the sea salty?",
    "What day comes after Monday?",
    "Spell cat.",
]
LONG = [
    "Write a short story about a dragon who learns to fly, with a beginning, a middle and an end.",
    "Explain why the sky is blue, in a few sentences a child would follow, and then say why sunsets are red.",
    "List the planets of the solar system in order from the sun, with one fact about each of them.",
    "Describe how bread is made, from the flour and the water to the loaf, step by step.",
]


def prompts(n: int, seed: int) -> list[str]:
    """n prompts, 2 in 3 short and 1 in 3 long, drawn with `seed` (both paths get the same ones)."""
    rng = np.random.default_rng(seed)
    return [
        (LONG[rng.integers(len(LONG))] if rng.random() < 1 / 3 else SHORT[rng.integers(len(SHORT))]) for _ in range(n)
    ]


@dataclass
class Outcome:
    latency_ms: np.ndarray  # NaN unless 200
    status: list[int]
    code: list[str]
    batch: list[int] = field(default_factory=list)
    queue_ms: list[float] = field(default_factory=list)
    outputs: dict[str, str] = field(default_factory=dict)


async def offer(
    base: str,
    sched: np.ndarray,
    texts: list[str],
    timeout_ms: float,
    client_timeout_s: float,
) -> Outcome:
    """Send request i at sched[i] whatever the answers (open loop)."""
    n = len(sched)
    out = Outcome(np.full(n, np.nan), [0] * n, [""] * n)
    connector = aiohttp.TCPConnector(limit=4096, limit_per_host=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=client_timeout_s)
    ) as session:
        t0 = time.monotonic() + 0.2

        async def send(i: int) -> None:
            due = t0 + float(sched[i])
            body = orjson.dumps({"input": texts[i], "timeout_ms": timeout_ms})
            try:
                async with session.post(
                    base + "/v1/inference", data=body, headers={"Content-Type": "application/json"}
                ) as resp:
                    raw = await resp.read()
                    out.status[i] = resp.status
                answer = orjson.loads(raw)
                if resp.status == 200:
                    out.latency_ms[i] = (time.monotonic() - due) * 1000
                    out.batch.append(int(answer["batch_size"]))
                    out.queue_ms.append(float(answer["queue_ms"]))
                    out.outputs.setdefault(texts[i], answer["output"])
                else:
                    out.code[i] = str(answer.get("error", "?"))
            except TimeoutError:
                out.code[i] = "client_timeout"
            except (aiohttp.ClientError, OSError, orjson.JSONDecodeError) as exc:
                out.code[i] = type(exc).__name__

        tasks = []
        for i in range(n):
            delay = t0 + float(sched[i]) - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(i)))
        await asyncio.gather(*tasks)
    return out


def row(path: str, rate: float, a: argparse.Namespace, sched: np.ndarray, o: Outcome) -> dict:
    window = sched >= a.warmup
    ok = window & (np.array(o.status) == 200)
    refused = window & (np.array(o.status) == 503)
    errors = Counter(f"{s} {c}" if s else c for s, c, w in zip(o.status, o.code, window) if w and s != 200)
    lat = o.latency_ms[window]
    return {
        "path": path,
        "rate": rate,
        "offered": int(window.sum()),
        "answered": int(ok.sum()),
        "answered_per_s": float(ok.sum()) / a.duration,
        "p50_ms": pct(lat, 50),
        "p95_ms": pct(lat, 95),
        "refused_503": int(refused.sum()),
        "errors": dict(errors),
        "mean_batch": float(np.mean(o.batch)) if o.batch else None,
        "mean_queue_ms": float(np.mean(o.queue_ms)) if o.queue_ms else None,
    }


TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def tiny_model_dir(source: str) -> str:
    """A folder with SmolLM2's tokenizer and a 2-layer, 64-wide config of its architecture and no weights: the
    server loads it with random weights (`smollm2.load_model`), in seconds. In a temporary folder, never the
    checkout. `source`: a transformers-format SmolLM2 folder (default: the GGUF's converted copy)."""
    import json
    import shutil
    import tempfile

    if not source:
        from batchserve.backends.smollm2 import converted_dir
        from batchserve.config import Settings

        source = converted_dir(Settings().weights_cache)
    target = tempfile.mkdtemp(prefix="inference-paths-tiny-")
    for f in Path(source).iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".gguf")):
            shutil.copy(f, target)
    config_path = Path(target) / "config.json"
    config = json.loads(config_path.read_text())
    config.update(TINY)
    config_path.write_text(json.dumps(config))
    return target


def server_cmd(a: argparse.Namespace, path: str) -> list[str]:
    """The server of one path. The static one runs without the generation engine (it is not used there, and
    its start, CUDA graphs included, would only lengthen the run); the stepper one decodes its (unused) batch
    path with `generate`, which warms without capturing the static decoder's graphs."""
    cmd = servers.serve_cmd(
        "smollm2",
        "--inference-path",
        path,
        "--max-new-tokens",
        str(a.max_new_tokens),
        "--timeout-ms",
        f"{a.timeout_ms:g}",
        "--max-timeout-ms",
        f"{max(a.timeout_ms, 60000):g}",
        "--jobs-db",
        "",
    )
    if a.model_dir:
        cmd += ["--smollm2-dir", a.model_dir]
    cmd += ["--generation", "off"] if path == "static" else ["--decode", "generate"]
    if a.slots:
        cmd += ["--generation-max-seqs", str(a.slots)]
    if a.device == "cpu":
        cmd += ["--devices", "1", "--generation-max-context", "512"]
    return cmd + a.server_arg


def markdown(rep: dict) -> str:
    s = rep["settings"]
    rows = [
        [
            r["path"],
            r["rate"],
            r["offered"],
            r["answered"],
            r["answered_per_s"],
            r["p50_ms"],
            r["p95_ms"],
            r["refused_503"],
            sum(r["errors"].values()) - r["refused_503"],
            r["mean_batch"],
            r["mean_queue_ms"],
        ]
        for r in rep["rows"]
    ]
    weights = (
        "tiny random (2 layers, 64 wide)" if s["tiny"] else s["smollm2_dir"] or "SmolLM2-135M-Instruct (GGUF, real)"
    )
    return "\n".join(
        [
            f"# /v1/inference: static batches vs the slot stepper — {rep['when_utc']}",
            f"`{s['command']}`  ",
            f"commit `{rep['git']['commit'][:12]}`{' (dirty)' if rep['git']['dirty'] else ''}, "
            f"{rep['machine']['cpu_model']} × {rep['machine']['cores_usable']} usable cores, load average at start "
            f"{rep['machine']['loadavg_at_start']}; device {s['device']}, weights {weights}, "
            f"{s['max_new_tokens']} new tokens at most, "
            f"timeout_ms {s['timeout_ms']:g}, {s['duration']:g} s measured after {s['warmup']:g} s per rate, "
            f"open-loop Poisson, prompts 2/3 short 1/3 long (seed {s['seed']}); stepper slots "
            f"{s['slots'] or 'auto'}; ready in {rep['ready_s']}",
            "",
            table(
                [
                    "path",
                    "offered /s",
                    "offered",
                    "answered",
                    "answered /s",
                    "p50 ms",
                    "p95 ms",
                    "503",
                    "other errors",
                    "mean batch_size",
                    "mean queue_ms",
                ],
                rows,
            ),
            "",
            f"Same text from both paths: {rep['same_text']}. Other errors: "
            f"{ {r['path'] + ' @ ' + fmt(r['rate'], 'g'): r['errors'] for r in rep['rows'] if r['errors']} }",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="/v1/inference of SmolLM2: static batches vs the slot stepper")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--smollm2-dir", default="", help="transformers-format weights (a config alone: random weights)")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="a 2-layer, 64-wide SmolLM2 with random weights (a smoke test: rates 2,4, 4 s each, 8 new tokens)",
    )
    p.add_argument("--paths", default="static,stepper", help="which paths, in order (default %(default)s)")
    p.add_argument(
        "--rates",
        default=None,
        help="offered requests per second, comma-separated (default 1,2,4 on a CPU, 300,1000 on CUDA, 2,4 with --tiny)",
    )
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 16 on a CPU, 64 on CUDA, 8 with --tiny")
    p.add_argument("--slots", type=int, default=0, help="the stepper's --generation-max-seqs (0 = the server's auto)")
    p.add_argument("--timeout-ms", type=float, default=20000.0, help="each request's timeout_ms")
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for `batchserve serve`")
    common.add_load_flags(p, duration=None, warmup=None, seed=1, timeout=None)
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds measured per rate (default 20 on a CPU, 5 on CUDA, 4 with --tiny)",
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds of load before each measured window (default 3; 1 on CUDA and with --tiny)",
    )
    common.add_output_flags(p, name="inference-paths")
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    a.rates = a.rates or ("2,4" if a.tiny else "300,1000" if cuda else "1,2,4")
    a.max_new_tokens = a.max_new_tokens or (8 if a.tiny else 64 if cuda else 16)
    a.duration = a.duration or (4.0 if a.tiny else 5.0 if cuda else 20.0)
    a.warmup = a.warmup if a.warmup is not None else (1.0 if a.tiny or cuda else 3.0)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    rates = [float(r) for r in a.rates.split(",")]
    paths = a.paths.split(",")
    name = common.run_name(a, f"inference-paths-{a.device}{'-tiny' if a.tiny else ''}")
    logs = common.log_dir(a, name)
    a.model_dir = tiny_model_dir(a.smollm2_dir) if a.tiny else a.smollm2_dir
    rep: dict = {
        **report.provenance(),
        "settings": {
            **vars(a),
            "out_dir": str(a.out_dir) if a.out_dir else None,
            "command": " ".join(["python -m bench.inference_paths", *(argv if argv is not None else sys.argv[1:])]),
        },
        "rows": [],
        "ready_s": {},
    }
    outputs: dict[str, dict[str, str]] = {}
    with common.guarded(rep) as stopping:
        for path in paths:
            server = servers.start(f"{name}-{path}", server_cmd(a, path), logs, timeout_s=a.start_timeout_s)
            rep["ready_s"][path] = round(server.ready_s, 1)
            outputs[path] = {}
            for k, rate in enumerate(rates):
                if stopping:
                    break
                sched = poisson_schedule(rate, a.warmup + a.duration, a.seed + k)
                texts = prompts(len(sched), a.seed + k)
                o = asyncio.run(offer(server.base, sched, texts, a.timeout_ms, a.timeout_ms / 1000 + 30))
                r = row(path, rate, a, sched, o)
                rep["rows"].append(r)
                outputs[path].update(o.outputs)
                print(
                    f"{path:8s} {rate:7g}/s: answered {r['answered_per_s']:.2f}/s, p95 {fmt(r['p95_ms'])} ms, "
                    f"503 {r['refused_503']}, errors {r['errors']}",
                    flush=True,
                )
            rep.setdefault("server_log", {})[path] = report.log_lines(server.log_path)
            servers.stop(server)
    if len(outputs) == 2:
        x, y = outputs.values()
        both = set(x) & set(y)
        rep["same_text"] = f"{sum(x[t] == y[t] for t in both)} of {len(both)} prompts"
    else:
        rep["same_text"] = "(one path only)"
    md = markdown(rep)
    print(md)
    print(report.written(report.write(name, rep, md, common.out_dir(a)), logs if common.out_dir(a) else None))
    if a.tiny:
        import shutil

        shutil.rmtree(a.model_dir, ignore_errors=True)
    return 1 if rep.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
