"""minilm served by batchserve against sentence-transformers offline, on the same device (issue 25).

    python -m bench.gpu_embed --device cuda --minilm-dir DIR --out $OUT   # the GPU check's embeddings part
    python -m bench.gpu_embed --device cpu --tiny                          # the same path on a CPU, ~1 minute

1. Offline, the reference: sentence-transformers' `encode` on the same weights folder (fp16 on CUDA, as the
   server runs it), `--batch-size` texts a call; then the `minilm` backend's own `batch` (no server) at the
   server's batch size, which separates the model's speed from the server's cost.
2. In the server: `batchserve serve --backend minilm` on that folder ($BATCHSERVE_MINILM_DIR), its batch size
   and token budget left to their defaults (on CUDA sized for the device), driven closed-loop by
   `--concurrency` clients for `--seconds` each row, each request `POST /v1/embeddings` with k inputs
   (`--inputs`: 1 is the per-request HTTP cost at its worst; more is how bulk callers send).

The same deterministic texts (4-40 words) go to every row. A row's texts/s is answered inputs per second; its
ratio is against sentence-transformers offline (goal: >= 0.9). The first answer's vectors are compared with
the offline ones (cosine). Loopback only; the server is stopped by its PID. Writes nothing unless --out or
--record.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/gpu_embed.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import asyncio
import os
import random
import time
from typing import Any

import aiohttp
import numpy as np

from bench import common, report, servers

WORDS = (
    "the a of to and in is it that for on with as was by batch server model vector token graph device "
    "queue latency memory request answer small large quick brown fox jumps over lazy dog river city "
    "library station guitar music paris france embedding compare cosine sentence"
).split()


def texts(n: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40))) + "." for _ in range(n)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def offline_st(folder: Path, device: str, data: list[str], batch: int) -> tuple[float, np.ndarray]:
    """sentence-transformers' texts/s over `data`, and its vectors of the first 8."""
    import torch
    from sentence_transformers import SentenceTransformer

    cuda = device.startswith("cuda")  # fp16 on CUDA, as the server; fp32 on a CPU (its fp16 is slow)
    model = SentenceTransformer(
        str(folder), device=device, model_kwargs={"dtype": torch.float16 if cuda else torch.float32}
    )
    model.encode(data[:batch], batch_size=batch, normalize_embeddings=True)  # warm
    sync(device)
    started = time.perf_counter()
    model.encode(data, batch_size=batch, normalize_embeddings=True, convert_to_numpy=True)
    sync(device)
    took = time.perf_counter() - started
    first = model.encode(data[:8], normalize_embeddings=True, convert_to_numpy=True)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return len(data) / took, np.asarray(first, dtype=np.float32)


def offline_backend(folder: Path, device: str, data: list[str], batch: int) -> float:
    """The minilm backend's own `batch` (what a worker runs), `batch` texts a call: texts/s."""
    import torch

    from batchserve.backends.minilm import MiniLM

    model = MiniLM([device], path=folder)
    model.setup(device)
    model.batch(data[:batch], device)
    sync(device)
    started = time.perf_counter()
    for i in range(0, len(data), batch):
        model.batch(data[i : i + batch], device)
    sync(device)
    took = time.perf_counter() - started
    model.models.clear()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return len(data) / took


async def load(base: str, data: list[str], per_request: int, concurrency: int, seconds: float) -> dict[str, Any]:
    """Closed loop: `concurrency` clients, each sending the next `per_request` texts until the window ends."""
    answered = errors = 0
    statuses: dict[str, int] = {}
    latencies: list[float] = []
    first: list[list[float]] = []
    cursor = 0
    stop_at = time.monotonic() + seconds

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal answered, errors, cursor
        while time.monotonic() < stop_at:
            start = cursor % len(data)
            cursor += per_request
            chunk = [data[(start + j) % len(data)] for j in range(per_request)]
            t0 = time.perf_counter()
            try:
                async with session.post(
                    base + "/v1/embeddings", json={"input": chunk, "model": "minilm", "timeout_ms": 30000}
                ) as r:
                    body = await r.json(content_type=None)
                    if r.status == 200:
                        answered += per_request
                        latencies.append(time.perf_counter() - t0)
                        if not first and start == 0 and per_request >= 8:
                            first.extend(d["embedding"] for d in body["data"][:8])
                    else:
                        errors += 1
                        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
                        if r.status in (429, 503):  # shed: wait as asked, as a well-behaved client would
                            await asyncio.sleep(
                                min(1.0, float(body.get("retry_after_ms") or 50) / 1000)
                                if isinstance(body, dict)
                                else 0.05
                            )
            except (TimeoutError, aiohttp.ClientError) as exc:
                errors += 1
                statuses[type(exc).__name__] = statuses.get(type(exc).__name__, 0) + 1

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        started = time.monotonic()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        took = time.monotonic() - started
    lat = np.array(latencies) * 1000 if latencies else np.array([np.nan])
    return {
        "texts_per_s": answered / took,
        "p50_ms": report.pct(lat, 50),
        "p95_ms": report.pct(lat, 95),
        "errors": errors,
        "statuses": statuses,
        "first": first,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (the server gets --devices 1 on CUDA)")
    p.add_argument(
        "--minilm-dir",
        default=os.environ.get("BATCHSERVE_MINILM_DIR", ""),
        help="the weights folder (default: $BATCHSERVE_MINILM_DIR, else the package's, extracted)",
    )
    p.add_argument("--tiny", action="store_true", help="a quick CPU run of every part (not a measurement)")
    p.add_argument("--texts", type=int, default=20000, help="texts in the offline runs")
    p.add_argument("--batch-size", type=int, default=512, help="sentence-transformers' batch size offline")
    p.add_argument("--inputs", default="1,32", help="inputs per request, one server row each")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--seconds", type=float, default=8.0, help="each server row's window")
    p.add_argument("--start-timeout-s", type=float, default=120.0)
    common.add_output_flags(p, name="gpu-embed")
    a = p.parse_args()
    if a.tiny:
        a.texts, a.batch_size, a.inputs, a.concurrency, a.seconds = 128, 32, "1,8", 8, 2.0
    from batchserve.backends import default_threads, minilm

    folder = Path(a.minilm_dir) if a.minilm_dir else minilm.model_dir()
    cuda = a.device.startswith("cuda")
    if not cuda:
        import torch

        torch.set_num_threads(default_threads())  # the server's own thread count on a CPU
    data = texts(a.texts)
    server_batch, server_tokens = minilm.gpu_batch_limits(minilm.free_memory(a.device)) if cuda else (100, 0)
    st_rate, st_first = offline_st(folder, a.device, data, a.batch_size)
    own_rate = offline_backend(folder, a.device, data, server_batch)
    rows: list[list[object]] = [
        ["sentence-transformers offline", f"batch {a.batch_size}", "", st_rate, 1.0, "", "", ""],
        ["minilm backend offline", f"batch {server_batch}", "", own_rate, own_rate / st_rate, "", "", ""],
    ]
    rep: dict[str, Any] = {
        "provenance": report.provenance(),
        "device": a.device,
        "folder": str(folder),
        "settings": {k: v for k, v in vars(a).items() if k != "out_dir"},
        "server_batch": server_batch,
        "server_tokens": server_tokens,
        "offline": {"sentence_transformers": st_rate, "backend": own_rate},
        "server": [],
    }
    cmd = servers.serve_cmd(
        "minilm",
        "--log-level",
        "info",
        *(["--devices", "1"] if cuda else []),
    )
    servers.stop_on_signals()
    agreement = float("nan")
    try:
        server = servers.start(
            "batchserve-minilm",
            cmd,
            common.log_dir(a, "gpu-embed"),
            a.start_timeout_s,
            env={"BATCHSERVE_MINILM_DIR": str(folder)},
        )
        rep["ready_s"] = server.ready_s
        for k in (int(x) for x in a.inputs.split(",") if x):
            got = asyncio.run(load(server.base, data, k, a.concurrency, a.seconds))
            got.pop("first")  # the vectors are compared once, below
            rep["server"].append({"inputs": k, "concurrency": a.concurrency, **got})
            rows.append(
                [
                    "batchserve",
                    f"{k} input(s)/request",
                    a.concurrency,
                    got["texts_per_s"],
                    got["texts_per_s"] / st_rate,
                    got["p50_ms"],
                    got["p95_ms"],
                    f"{got['errors']} {got['statuses']}" if got["errors"] else 0,
                ]
            )
        probe = asyncio.run(load(server.base, data[:8], 8, 1, 0.01))
        if probe["first"]:
            v = np.asarray(probe["first"], dtype=np.float32)
            agreement = float((v * st_first).sum(1).min())
    except servers.ServerFailed as exc:
        rep["error"] = str(exc)
        print(f"server failed: {exc}")
    finally:
        servers.stop_all()
    rep["min_cosine_server_vs_offline"] = agreement
    md = (
        f"minilm ({folder.name}) on {a.device}: served vs sentence-transformers offline, {a.texts} texts; "
        f"server batch {server_batch}, token budget {server_tokens or 'none'}; lowest cosine of served vs offline "
        f"vectors {agreement:.5f}\n\n"
        + report.table(
            ["path", "shape", "concurrency", "texts/s", "vs offline ST", "p50 ms", "p95 ms", "errors"],
            [
                [
                    r[0],
                    r[1],
                    r[2],
                    report.fmt(r[3], ",.0f"),
                    report.fmt(r[4], ".2f"),
                    report.fmt(r[5]) if r[5] != "" else "",
                    report.fmt(r[6]) if r[6] != "" else "",
                    r[7],
                ]
                for r in rows
            ],
        )
    )
    print(md)
    print(report.written(report.write(common.run_name(a, "gpu-embed"), rep, md, common.out_dir(a))))
    return 0 if "error" not in rep else 1


if __name__ == "__main__":
    sys.exit(main())
