"""The tokenizer stage under huge inputs on the real all-MiniLM-L6-v2 (issue 46, item 2): memory and fairness.

    python -m bench.tokenize_bench             # ~1.5 min: both phases, prints the table
    python -m bench.tokenize_bench --seconds 3 --settle 3   # a check: shorter phases
    python -m bench.tokenize_bench --record    # also bench/results/tokenize-<UTC time>.{md,json}

One `batchserve serve` with two models: `minilm` (the real model, backend `minilm`) and `rerank`, a cross-encoder
folder this bench builds from minilm's own tokenizer and config (BertForSequenceClassification, random weights:
what is measured is the tokenizer stage, not the scores). Two API keys: `hostile` of tier `free`, `other` of
tier `paid`, rates far above what is sent.

- Memory: RSS after warm-up; then `hostile` sends ten ~938 KB /v1/embeddings bodies (60 inputs of 15,600
  characters) and three ~94 KB /v1/rerank bodies (six 15,600-character documents, each far past the model's 256
  tokens: before the fix the encoding cache kept every overflow window of them) all at once. Goals: the peak
  within 300 MB of the value after warm-up, and RSS 10 s later within 100 MB of it.
- Fairness: `other` runs two closed loops of one short input a request, alone, then beside `hostile`'s four
  closed loops of 60 inputs of 16,000 characters with `timeout_ms` 1 (each tokenized, then refused by
  admission). Goal: `other` keeps at least half the answers it got alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench import common, report, servers
from bench.procstat import RssWatch, rss_mb

WORDS = "the quick brown fox jumps over a lazy dog while seven tired engineers measure resident memory".split()
EMBED_BODIES, EMBED_INPUTS, RERANK_BODIES, RERANK_DOCS, LONG_CHARS = 10, 60, 3, 6, 15_600
FLOOD_LOOPS, FLOOD_INPUTS, FLOOD_CHARS, SMALL_LOOPS = 4, 60, 16_000, 2
GOALS = {"peak_mb": 300.0, "after_mb": 100.0, "kept": 0.5}


def long_text(seed: int, chars: int) -> str:
    rng = random.Random(seed)
    words: list[str] = []
    length = 0
    while length < chars:
        words.append(rng.choice(WORDS))
        length += len(words[-1]) + 1
    return " ".join(words)[:chars]


def cross_encoder(folder: Path) -> Path:
    """minilm's tokenizer and config with a one-label classification head, random weights."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from batchserve.backends import minilm

    source = minilm.model_dir()
    torch.manual_seed(0)
    BertForSequenceClassification(BertConfig.from_pretrained(source, num_labels=1)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


def write_config(directory: Path) -> tuple[Path, dict[str, str]]:
    config = directory / "bs.toml"
    folder = cross_encoder(directory / "rerank")
    config.write_text(
        f'[[models]]\nname = "minilm"\nbackend = "minilm"\n\n[[models]]\nname = "rerank"\npath = "{folder}"\n'
    )
    keys = {tenant: servers.add_key(config, tenant, tier) for tenant, tier in (("hostile", "free"), ("other", "paid"))}
    return config, keys


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


async def post_all(url: str, bodies: list[tuple[str, bytes]], key: str) -> dict[int, int]:
    """Send every (path, body) at once; the count of each status."""
    statuses: dict[int, int] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:

        async def one(path: str, body: bytes) -> None:
            async with s.post(url + path, data=body, headers=bearer(key)) as r:
                await r.read()
                statuses[r.status] = statuses.get(r.status, 0) + 1

        await asyncio.gather(*(one(path, body) for path, body in bodies))
    return statuses


def memory_phase(server: servers.Server, keys: dict[str, str], settle_s: float) -> dict:
    url = server.base
    warm = [("/v1/embeddings", json.dumps({"model": "minilm", "input": ["a warm-up input"] * 8}).encode())] * 4
    warm += [
        ("/v1/rerank", json.dumps({"model": "rerank", "query": "a dog", "documents": ["a fox", "a dog"]}).encode())
    ] * 4
    asyncio.run(post_all(url, warm, keys["other"]))
    time.sleep(2.0)
    bodies = [
        (
            "/v1/embeddings",
            json.dumps(
                {"model": "minilm", "input": [long_text(b * 100 + i, LONG_CHARS) for i in range(EMBED_INPUTS)]}
            ).encode(),
        )
        for b in range(EMBED_BODIES)
    ]
    bodies += [
        (
            "/v1/rerank",
            json.dumps(
                {
                    "model": "rerank",
                    "query": "which text is about a dog",
                    "documents": [long_text(10_000 + b * 100 + i, LONG_CHARS) for i in range(RERANK_DOCS)],
                }
            ).encode(),
        )
        for b in range(RERANK_BODIES)
    ]
    sizes = sorted({len(body) // 1000 for _, body in bodies})
    with RssWatch(server.pid) as watch:
        statuses = asyncio.run(post_all(url, bodies, keys["hostile"]))
        time.sleep(0.5)
    time.sleep(settle_s)
    after = rss_mb(server.pid)
    return {
        "body_kb": sizes,
        "statuses": statuses,
        "rss_warm_mb": watch.start_mb,
        "rss_peak_mb": watch.peak_mb,
        "rss_after_mb": after,
        "peak_over_mb": watch.peak_mb - watch.start_mb,
        "after_over_mb": after - watch.start_mb,
        "settle_s": settle_s,
    }


async def small_answers(url: str, key: str, seconds: float) -> int:
    answered = 0
    stop = time.monotonic() + seconds
    async with aiohttp.ClientSession() as s:

        async def loop(i: int) -> None:
            nonlocal answered
            n = 0
            while time.monotonic() < stop:
                n += 1
                body = {"input": f"the cat {i} {n}", "model": "minilm"}
                async with s.post(url + "/v1/embeddings", json=body, headers=bearer(key)) as r:
                    await r.read()
                    answered += r.status == 200

        await asyncio.gather(*(loop(i) for i in range(SMALL_LOOPS)))
    return answered


async def beside_flood(url: str, keys: dict[str, str], seconds: float) -> tuple[int, dict[int, int]]:
    statuses: dict[int, int] = {}
    done = asyncio.Event()
    bodies = [
        json.dumps(
            {
                "model": "minilm",
                "input": [long_text(50_000 + i * FLOOD_INPUTS + j, FLOOD_CHARS) for j in range(FLOOD_INPUTS)],
                "timeout_ms": 1,
            }
        ).encode()
        for i in range(FLOOD_LOOPS)
    ]

    async def flood(s: aiohttp.ClientSession, body: bytes) -> None:
        while not done.is_set():
            async with s.post(url + "/v1/embeddings", data=body, headers=bearer(keys["hostile"])) as r:
                await r.read()
                statuses[r.status] = statuses.get(r.status, 0) + 1

    async with aiohttp.ClientSession() as s:
        floods = [asyncio.ensure_future(flood(s, body)) for body in bodies]
        await asyncio.sleep(0.5)
        answered = await small_answers(url, keys["other"], seconds)
        done.set()
        await asyncio.gather(*floods)
    return answered, statuses


def fairness_phase(server: servers.Server, keys: dict[str, str], seconds: float) -> dict:
    asyncio.run(small_answers(server.base, keys["other"], 1.0))  # warm
    alone = asyncio.run(small_answers(server.base, keys["other"], seconds))
    beside, statuses = asyncio.run(beside_flood(server.base, keys, seconds))
    return {
        "seconds": seconds,
        "alone": alone,
        "beside": beside,
        "kept": beside / alone if alone else 0.0,
        "flood_statuses": statuses,
    }


def markdown(rep: dict) -> str:
    m, f = rep["memory"], rep["fairness"]
    verdict = {
        "peak": m["peak_over_mb"] <= GOALS["peak_mb"],
        "after": m["after_over_mb"] <= GOALS["after_mb"],
        "kept": f["kept"] >= GOALS["kept"],
    }
    rows = [
        [
            f"peak RSS over warm ({m['rss_warm_mb']:.0f} MB), {EMBED_BODIES} embeddings + {RERANK_BODIES} rerank "
            f"bodies of {m['body_kb']} KB, statuses {m['statuses']}",
            f"{m['peak_over_mb']:+.0f} MB",
            f"<= {GOALS['peak_mb']:.0f} MB",
            "met" if verdict["peak"] else "missed",
        ],
        [
            f"RSS {m['settle_s']:g} s later, over warm",
            f"{m['after_over_mb']:+.0f} MB",
            f"<= {GOALS['after_mb']:.0f} MB",
            "met" if verdict["after"] else "missed",
        ],
        [
            f"`other`'s answers in {f['seconds']:g} s beside {FLOOD_LOOPS} loops of {FLOOD_INPUTS} x "
            f"{FLOOD_CHARS:,}-char inputs (statuses {f['flood_statuses']}), over alone",
            f"{f['beside']} / {f['alone']} = {f['kept']:.2f}",
            f">= {GOALS['kept']}",
            "met" if verdict["kept"] else "missed",
        ],
    ]
    return report.table(["measure", "value", "goal", ""], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=8.0, help="each fairness phase (default %(default)g)")
    p.add_argument("--settle", type=float, default=10.0, help="seconds before the RSS after (default %(default)g)")
    common.add_output_flags(p, name="tokenize")
    a = p.parse_args(argv)
    name = common.run_name(a, "tokenize")
    logs = common.log_dir(a, name)
    rep: dict = {"kind": "tokenize", "settings": {"seconds": a.seconds, "settle_s": a.settle}, **report.provenance()}
    with common.guarded(rep), tempfile.TemporaryDirectory(prefix="tokenize-bench-") as tmp:
        config, keys = write_config(Path(tmp))
        cmd = [sys.executable, "-m", "batchserve", "serve", "--port", "0", "--config", str(config)]
        server = servers.start("batchserve", [*cmd, "--drain-grace-s", "0"], logs, timeout_s=300)
        rep["loadavg_before"] = os.getloadavg()
        rep["memory"] = memory_phase(server, keys, a.settle)
        rep["fairness"] = fairness_phase(server, keys, a.seconds)
        rep["loadavg_after"] = os.getloadavg()
    if "memory" not in rep or "fairness" not in rep:
        print(json.dumps(rep, default=str), file=sys.stderr)
        return 1
    table = markdown(rep)
    load = f"load average {rep['loadavg_before'][0]:.1f} before, {rep['loadavg_after'][0]:.1f} after"
    print(table)
    body = f"# batchserve tokenizer stage under huge inputs — {rep['when_utc']}\n\n{load}\n\n{table}\n"
    print(report.written(report.write(name, rep, body, common.out_dir(a)), logs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
