"""The generation engine's shares by tenant and tier (issue 33 item 3), measured through HTTP on a live
`--generation on` server with SmolLM2's real weights and two keyed tenants per scenario:

    python -m bench.gen_share                      # both scenarios, the issue's sizes (CPU: ~15-30 minutes)
    python -m bench.gen_share --scenarios hog      # one
    python -m bench.gen_share --lines 20 --line-tokens 40 --record
    python -m bench.gen_share --scenarios batch --beside 1,0.25   # the batch cap off, then at 0.25, one run
    python -m bench.gen_share --code /tmp/base     # the tree in /tmp/base first (`git archive <commit> | tar -x
                                                   # -C /tmp/base`), then this checkout: without and with a change
    python -m bench.gen_share --scenarios prompts  # short chats beside long prompts (issue 46 item 4)

1. `hog`: one tenant holds every slot with long streamed chats (slots + 2 of them, EOS ignored), another
   sends `--short` short chats one after another. Reported: how many were answered, their p50 alone and
   beside the hog, the ratio (goal: 10 of 10, <= 3x), and the sequences paused (preempted). The issue measured
   0 of 10 (9 x 503, 1 x 504) before the shares.
2. `batch`: one tenant's OpenAI chat batch of `--lines` lines of `--line-tokens` tokens (EOS ignored) beside
   another tenant's interactive chats, one after another, for as long as the batch runs. Reported: lines
   completed / failed, the batch's wall time, the interactive p50 alone and beside it, the ratio (goal: every
   valid line completes, <= 1.5x). The issue measured 84 of 100 lines failed and p50 0.7 s -> 8.9 s before.
   `--beside` runs it once per value of `--generation-batch-beside-interactive` (the share of the slots batch
   lines keep while interactive work is there; 1 = no cap, as before it), in the order given, in one run.

3. `prompts`: short chats beside another tenant's long prompts (`--prompt-tokens`, ~1,500, `max_tokens` 1):
   first from `--prompt-streams` interactive callers in closed loops, then from a chat batch of `--prompt-lines`
   lines of them. Reported per phase: chats answered, p50 alone and beside, the ratio (goal: all answered,
   <= 3x). The issue measured one answer in 20 s beside the interactive prompts (0.8 s alone) and p50 16.2 s
   beside the batch, before prefill was priced (`decoding/prefill_share.py`).

A fresh server per scenario (each with its own temporary TOML config of keys); every server stopped by PID.
The machine is shared: the load average is printed and recorded with the results; quote ratios from one run.
Results (markdown + JSON: machine, commit, settings) go to bench/results/gen-share-*.{md,json} only with
--record (or --out DIR).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench import common, report, servers

MODEL = "SmolLM2-135M-Instruct"


def keyed(directory: Path, tenants: tuple[str, ...]) -> tuple[Path, dict[str, str]]:
    """A TOML config with one paid key per tenant (docs/configuration.md), and the keys."""
    from batchserve.http.guards import digest, new_key

    keys = {t: new_key() for t in tenants}
    config = directory / "keys.toml"
    config.write_text(
        "".join(
            f'[[keys]]\ntenant = "{t}"\ntier = "paid"\nsha256 = "{digest(k)}"\nrate = 1000\nburst = 1000\n'
            for t, k in keys.items()
        )
    )
    return config, keys


def chat(content: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


def timed_chats(
    url: str, key: str, bodies: list[dict[str, Any]], until: threading.Event | None = None
) -> tuple[list[float], list[httpx.Response]]:
    """Each body in turn (a closed loop of one; cycling through them until `until` is set, if given): seconds
    per answer, and the answers."""
    times: list[float] = []
    answers: list[httpx.Response] = []
    with httpx.Client(base_url=url, timeout=300, headers={"Authorization": f"Bearer {key}"}) as c:
        i = 0
        while i < len(bodies) or (until is not None and not until.is_set()):
            began = time.perf_counter()
            answers.append(c.post("/v1/chat/completions", json=bodies[i % len(bodies)]))
            times.append(time.perf_counter() - began)
            i += 1
            if until is not None and until.is_set():
                break
    return times, answers


class Hog:
    """`n` long streamed chats of one tenant (EOS ignored), in threads; each hangs up (its sequence is
    cancelled) when the block ends."""

    def __init__(self, url: str, key: str, n: int, max_tokens: int) -> None:
        self.url, self.key, self.stopping = url, key, threading.Event()
        self.lines = [0] * n  # SSE lines read per chat
        self.threads = [threading.Thread(target=self._one, args=(i, max_tokens), daemon=True) for i in range(n)]

    def _one(self, i: int, max_tokens: int) -> None:
        body = chat(f"Tell me a very long story about the number {i}.", max_tokens, stream=True, ignore_eos=True)
        try:
            with httpx.Client(base_url=self.url, timeout=900, headers={"Authorization": f"Bearer {self.key}"}) as c:
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    for _ in r.iter_lines():
                        self.lines[i] += 1
                        if self.stopping.is_set():
                            return  # hanging up cancels the sequence
        except httpx.HTTPError:
            pass

    def streaming(self) -> int:
        """How many of the chats have started answering."""
        return sum(1 for n in self.lines if n > 2)

    def __enter__(self) -> Hog:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(60)


def engine_stats(url: str) -> dict[str, Any]:
    return httpx.get(url + "/internal/generation", timeout=30).json()


def wait_until(check: Any, timeout: float, every: float = 0.1) -> None:
    give_up = time.monotonic() + timeout
    while not check():
        if time.monotonic() > give_up:
            raise TimeoutError(f"not true within {timeout}s")
        time.sleep(every)


def run_batch(url: str, key: str, bodies: list[dict[str, Any]], give_up_s: float) -> dict[str, Any]:
    """An OpenAI chat batch of these bodies, polled to its end: the batch object."""
    content = b"".join(
        orjson.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}) + b"\n"
        for i, body in enumerate(bodies)
    )
    with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {key}"}) as c:
        f = c.post("/v1/files", files={"file": ("in.jsonl", content, "application/jsonl")}, data={"purpose": "batch"})
        f.raise_for_status()
        b = c.post(
            "/v1/batches",
            json={"input_file_id": f.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        )
        b.raise_for_status()
        batch = b.json()
        give_up = time.monotonic() + give_up_s
        while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
            if time.monotonic() > give_up:
                return batch
            time.sleep(0.5)
            batch = c.get(f"/v1/batches/{batch['id']}").json()
    return batch


def p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# `python -m batchserve` from another tree: it goes first on sys.path (`-m` would put this checkout first)
FROM_TREE = (
    "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); sys.argv[0] = 'batchserve'; "
    "runpy.run_module('batchserve', run_name='__main__', alter_sys=True)"
)


def start(name: str, code: str, a: argparse.Namespace, config: Path, log_dir: Path, extra: list[str]) -> servers.Server:
    """A `--generation on` server of this checkout (`code` "") or of the tree in the directory `code`."""
    run = [sys.executable, "-c", FROM_TREE, code] if code else [sys.executable, "-m", "batchserve"]
    cmd = [
        *run,
        "serve",
        "--port",
        "0",
        "--devices",
        "1",
        "--generation",
        "on",
        "--generation-max-context",
        str(a.max_context),
        "--config",
        str(config),
        "--drain-grace-s",
        "0",
        *(["--generation-max-seqs", str(a.max_seqs)] if a.max_seqs else []),
        *extra,
    ]
    return servers.start(name, cmd, log_dir, timeout_s=300)


def ok_times(times: list[float], answers: list[httpx.Response]) -> list[float]:
    """The times of the answers that are 200 (a refusal is fast, and not an answer)."""
    return [t for t, r in zip(times, answers) if r.status_code == 200]


def hog_scenario(code: str, a: argparse.Namespace, tmp: Path, log_dir: Path) -> dict[str, Any]:
    config, keys = keyed(tmp, ("hog", "small"))
    s = start(f"gen-share-hog{'-' + Path(code).name if code else ''}", code, a, config, log_dir, [])
    slots = engine_stats(s.base)["max_seqs"]
    shorts = [chat(f"What is {i} plus {i}?", a.short_tokens) for i in range(a.short)]
    timed_chats(s.base, keys["small"], shorts[:1])  # warm
    alone, _ = timed_chats(s.base, keys["small"], shorts)
    with Hog(s.base, keys["hog"], slots + 2, a.hog_tokens) as hog:
        wait_until(lambda: engine_stats(s.base)["running"] == slots and hog.streaming() >= slots, 300)
        beside, answers = timed_chats(s.base, keys["small"], shorts)
        preempted = engine_stats(s.base).get("preempted")
    servers.stop(s)
    statuses = [r.status_code for r in answers]
    beside = ok_times(beside, answers)
    return {
        "scenario": "hog",
        "code": code or "this checkout",
        "slots": slots,
        "hog_chats": slots + 2,
        "short_chats": a.short,
        "answered": statuses.count(200),
        "statuses": sorted(set(statuses)),
        "p50_alone_s": p50(alone),
        "p50_beside_s": p50(beside),
        "ratio": p50(beside) / p50(alone),
        "goal_ratio": 3.0,
        "preempted": preempted,
    }


def batch_scenario(code: str, a: argparse.Namespace, tmp: Path, log_dir: Path, share: str = "") -> dict[str, Any]:
    """`share`: the server's --generation-batch-beside-interactive ("": its default)."""
    config, keys = keyed(tmp, ("batcher", "caller"))
    cap = ["--generation-batch-beside-interactive", share] if share else []
    s = start(
        f"gen-share-batch{'-' + Path(code).name if code else ''}{'-' + share if share else ''}",
        code,
        a,
        config,
        log_dir,
        ["--jobs-db", str(tmp / "jobs.db"), *cap],
    )
    interactive = [chat(f"Name a color, number {i}.", a.short_tokens) for i in range(a.short)]
    timed_chats(s.base, keys["caller"], interactive[:1])  # warm
    alone, _ = timed_chats(s.base, keys["caller"], interactive)
    lines = [chat(f"Describe the number {i} in one sentence.", a.line_tokens, ignore_eos=True) for i in range(a.lines)]
    done: dict[str, Any] = {}
    over = threading.Event()
    began = time.perf_counter()

    def batch() -> None:
        try:
            done.update(run_batch(s.base, keys["batcher"], lines, a.batch_timeout_s))
        finally:
            over.set()

    t = threading.Thread(target=batch)
    t.start()
    wait_until(lambda: engine_stats(s.base)["running"] >= 2 or over.is_set(), 120, 0.05)
    steps_before = engine_stats(s.base).get("steps") or {}
    beside, answers = timed_chats(s.base, keys["caller"], interactive, until=over)
    steps_after = engine_stats(s.base).get("steps") or {}
    t.join()
    wall = time.perf_counter() - began
    stats = engine_stats(s.base)
    # the duty cycle while the interactive chats ran: steps with the batch rows, and of the interactive rows alone
    mix = {k: steps_after.get(k, 0) - steps_before.get(k, 0) for k in ("full", "interactive_only", "unseparated")}
    preempted = stats.get("preempted")
    # alone again: on a shared machine the load under the first alone phase may not be the load beside the batch;
    # the ratio to each, and to the slower of the two, brackets the drift
    time.sleep(2)  # the interactive lane's linger and the last lines' ends
    after, _ = timed_chats(s.base, keys["caller"], interactive)
    servers.stop(s)
    counts = done.get("request_counts") or {}
    statuses = [r.status_code for r in answers]
    beside = ok_times(beside, answers)
    return {
        "scenario": "batch",
        "code": code or "this checkout",
        "beside": share or "default",
        "batch_rows_beside_interactive": stats.get("batch_rows_beside_interactive"),
        "lines": a.lines,
        "line_tokens": a.line_tokens,
        "batch_status": done.get("status"),
        "completed": counts.get("completed"),
        "failed": counts.get("failed"),
        "batch_wall_s": wall,
        "interactive_chats": len(answers),
        "interactive_ok": statuses.count(200),
        "p50_alone_s": p50(alone),
        "p50_beside_s": p50(beside),
        "ratio": p50(beside) / p50(alone),
        "p50_alone_after_s": p50(after),
        "ratio_to_after": p50(beside) / p50(after),
        "ratio_to_slower_alone": p50(beside) / max(p50(alone), p50(after)),
        "goal_ratio": 1.5,
        "preempted": preempted,
        "steps_full": mix["full"],
        "steps_interactive_only": mix["interactive_only"],
        "steps_unseparated": mix["unseparated"],
    }


def long_prompt(i: int, tokens: int) -> str:
    """About `tokens` tokens of SmolLM2's tokenizer (" apple" is one), distinct per `i`."""
    return f"Document {i}. Count the apples:" + " apple" * tokens


def prompts_scenario(code: str, a: argparse.Namespace, tmp: Path, log_dir: Path) -> dict[str, Any]:
    """Short chats alone, then beside an interactive tenant's long prompts, then beside a chat batch of them."""
    config, keys = keyed(tmp, ("prompter", "caller"))
    s = start(
        f"gen-share-prompts{'-' + Path(code).name if code else ''}",
        code,
        a,
        config,
        log_dir,
        ["--jobs-db", str(tmp / "jobs.db")],
    )
    shorts = [chat(f"What is {i} plus {i}?", a.short_tokens) for i in range(a.short)]
    longs = [chat(long_prompt(i, a.prompt_tokens), 1) for i in range(max(a.prompt_lines, a.prompt_streams))]
    timed_chats(s.base, keys["caller"], shorts[:1])  # warm
    alone, _ = timed_chats(s.base, keys["caller"], shorts)
    stop = threading.Event()
    streams = [
        threading.Thread(
            target=timed_chats, args=(s.base, keys["prompter"], longs[i :: a.prompt_streams], stop), daemon=True
        )
        for i in range(a.prompt_streams)
    ]
    for t in streams:
        t.start()
    wait_until(lambda: engine_stats(s.base)["running"] >= 1, 120, 0.05)
    beside_i, answers_i = timed_chats(s.base, keys["caller"], shorts)
    stop.set()
    for t in streams:
        t.join(300)
    done: dict[str, Any] = {}

    def batch() -> None:
        try:
            done.update(run_batch(s.base, keys["prompter"], longs[: a.prompt_lines], a.batch_timeout_s))
        except httpx.HTTPError:
            pass  # the server stopped under it: the chats beside it are what is measured

    t = threading.Thread(target=batch, daemon=True)
    t.start()
    wait_until(lambda: engine_stats(s.base)["batch_running"] >= 1, 120, 0.05)
    beside_b, answers_b = timed_chats(s.base, keys["caller"], shorts)
    stats = engine_stats(s.base)
    servers.stop(s)
    t.join(30)
    ok_i, ok_b = ok_times(beside_i, answers_i), ok_times(beside_b, answers_b)
    return {
        "scenario": "prompts",
        "code": code or "this checkout",
        "prompt_tokens": a.prompt_tokens,
        "prompt_streams": a.prompt_streams,
        "prompt_lines": a.prompt_lines,
        "short_chats": a.short,
        "p50_alone_s": p50(alone),
        "interactive_answered": len(ok_i),
        "p50_beside_interactive_s": p50(ok_i),
        "ratio_interactive": p50(ok_i) / p50(alone),
        "batch_answered": len(ok_b),
        "p50_beside_batch_s": p50(ok_b),
        "ratio_batch": p50(ok_b) / p50(alone),
        "goal_ratio": 3.0,
        "preempted": stats.get("preempted"),
        "steps": stats.get("steps"),
    }


def markdown(rows: list[dict[str, Any]], load: tuple[float, float, float]) -> str:
    out = [
        f"# Generation shares by tenant (issue 33 item 3)\n\nload average at start {load[0]:.2f} "
        f"{load[1]:.2f} {load[2]:.2f} (a shared machine: one run's figures)\n"
    ]
    for r in rows:
        if r["scenario"] == "prompts":
            out.append(
                report.table(
                    [
                        "scenario",
                        "code",
                        "prompt tokens",
                        "short chats beside",
                        "answered",
                        "p50 alone s",
                        "p50 beside s",
                        "ratio (goal 3)",
                    ],
                    [
                        [
                            f"{r['prompt_streams']} interactive streams of long prompts",
                            r["code"],
                            r["prompt_tokens"],
                            "interactive",
                            f"{r['interactive_answered']}/{r['short_chats']}",
                            report.fmt(r["p50_alone_s"], ".2f"),
                            report.fmt(r["p50_beside_interactive_s"], ".2f"),
                            report.fmt(r["ratio_interactive"], ".2f"),
                        ],
                        [
                            f"a chat batch of {r['prompt_lines']} long prompts",
                            r["code"],
                            r["prompt_tokens"],
                            "batch",
                            f"{r['batch_answered']}/{r['short_chats']}",
                            report.fmt(r["p50_alone_s"], ".2f"),
                            report.fmt(r["p50_beside_batch_s"], ".2f"),
                            report.fmt(r["ratio_batch"], ".2f"),
                        ],
                    ],
                )
            )
        elif r["scenario"] == "hog":
            out.append(
                report.table(
                    [
                        "scenario",
                        "code",
                        "slots",
                        "hog chats",
                        "answered",
                        "p50 alone s",
                        "p50 beside s",
                        "ratio (goal 3)",
                        "preempted",
                    ],
                    [
                        [
                            "one tenant holds every slot",
                            r["code"],
                            r["slots"],
                            r["hog_chats"],
                            f"{r['answered']}/{r['short_chats']}",
                            report.fmt(r["p50_alone_s"], ".2f"),
                            report.fmt(r["p50_beside_s"], ".2f"),
                            report.fmt(r["ratio"], ".2f"),
                            r["preempted"],
                        ]
                    ],
                )
            )
        else:
            out.append(
                report.table(
                    [
                        "scenario",
                        "code",
                        "batch rows beside interactive",
                        "lines x tokens",
                        "completed",
                        "failed",
                        "batch s",
                        "interactive ok",
                        "p50 alone s",
                        "p50 beside s",
                        "ratio (goal 1.5)",
                        "p50 alone after s",
                        "ratio to after",
                        "preempted",
                        "steps full / interactive-only",
                    ],
                    [
                        [
                            f"chat batch beside interactive ({r['batch_status']})",
                            r["code"],
                            f"{r.get('batch_rows_beside_interactive', 'all')} ({r.get('beside', 'default')})",
                            f"{r['lines']} x {r['line_tokens']}",
                            r["completed"],
                            r["failed"],
                            report.fmt(r["batch_wall_s"], ".0f"),
                            f"{r['interactive_ok']}/{r['interactive_chats']}",
                            report.fmt(r["p50_alone_s"], ".2f"),
                            report.fmt(r["p50_beside_s"], ".2f"),
                            report.fmt(r["ratio"], ".2f"),
                            report.fmt(r.get("p50_alone_after_s", float("nan")), ".2f"),
                            report.fmt(r.get("ratio_to_after", float("nan")), ".2f"),
                            r["preempted"],
                            f"{r.get('steps_full', '-')} / {r.get('steps_interactive_only', '-')}",
                        ]
                    ],
                )
            )
    return "\n\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default="hog,batch", help="comma-separated: hog, batch, prompts (default hog,batch)")
    p.add_argument(
        "--max-seqs", type=int, default=0, help="--generation-max-seqs (default 0: the server's, 8 on a CPU)"
    )
    p.add_argument("--max-context", type=int, default=2048, help="--generation-max-context (default %(default)s)")
    p.add_argument("--short", type=int, default=10, help="short / interactive chats (default %(default)s)")
    p.add_argument("--short-tokens", type=int, default=16, help="max_tokens of a short chat (default %(default)s)")
    p.add_argument("--hog-tokens", type=int, default=1500, help="max_tokens of a hog's chat (default %(default)s)")
    p.add_argument("--lines", type=int, default=100, help="chat batch lines (default %(default)s)")
    p.add_argument("--line-tokens", type=int, default=160, help="max_tokens of a line (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=1500, help="prompts: a long prompt's tokens (about)")
    p.add_argument("--prompt-streams", type=int, default=4, help="prompts: interactive callers of long prompts")
    p.add_argument("--prompt-lines", type=int, default=60, help="prompts: chat batch lines of long prompts")
    p.add_argument(
        "--batch-timeout-s",
        type=float,
        default=5400,
        help="give up on the batch after this (default %(default)s: 100 x 160 takes ~3,300 s on 2 cores)",
    )
    p.add_argument(
        "--beside",
        default="",
        help="batch scenario: comma-separated values of --generation-batch-beside-interactive, each "
        "run in turn (default: the server's)",
    )
    p.add_argument(
        "--code",
        action="append",
        default=[],
        help="another tree of the code to run first (repeatable), e.g. the commit before a change",
    )
    common.add_output_flags(p, name="gen-share")
    a = p.parse_args(argv)
    name = common.run_name(a, "gen-share")
    log_dir = common.log_dir(a, name)
    load = os.getloadavg()
    rows: list[dict[str, Any]] = []
    rep: dict[str, Any] = {}
    with common.guarded(rep), tempfile.TemporaryDirectory(prefix="gen-share-") as tmp:
        for scenario in (x.strip() for x in a.scenarios.split(",")):
            runs = [(code, "") for code in [*a.code, ""]]
            if scenario == "batch" and a.beside:
                runs = [(code, beside.strip()) for code in [*a.code, ""] for beside in a.beside.split(",")]
            for i, (code, beside) in enumerate(runs):
                directory = Path(tmp) / f"{scenario}-{i}"
                directory.mkdir()
                if scenario == "batch":
                    rows.append(batch_scenario(code, a, directory, log_dir, beside))
                elif scenario == "prompts":
                    rows.append(prompts_scenario(code, a, directory, log_dir))
                else:
                    rows.append(hog_scenario(code, a, directory, log_dir))
                print(rows[-1], flush=True)
    md = markdown(rows, load)
    print("\n" + md)
    rep.update({**report.provenance(), "settings": vars(a), "load_average": load, "rows": rows})
    print(report.written(report.write(name, rep, md, common.out_dir(a)), log_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
