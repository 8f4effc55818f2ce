"""Tokens served per tenant: two backlogged tenants of one tier on minilm, one sending long inputs, one short
(issue 33, item 2), with the change and with the old behaviour, in one command:

    python -m bench.fairness                   # this checkout, then the base commit: ~2 x (start + 3 + 15..45 s)
    python -m bench.fairness --slo-ms 0        # the server's own objective (derived from its warm-up)
    python -m bench.fairness --base ''         # this checkout only
    python -m bench.fairness --record          # also bench/results/fairness-<UTC time>.{md,json}

The scenario (the same as tests/integration/core/test_fair_share_http.py): a fresh `batchserve serve` with the
real all-MiniLM-L6-v2 model (backend `minilm`), a TOML config with two API keys of tier `paid` (rates far above
what is sent, so only the fair queue and admission act) for tenants `long` and `short`. They run closed
loops against /v1/embeddings (8 and 16, `--loops-long`, `--loops-short`: each keeps several batches of inputs
outstanding, so it is backlogged): `long` sends 4 inputs of 220 tokens a request, `short` 16 inputs of 8; a
refused request (503/429) is sent again after `--backoff-ms`, the way a client retries. Requests carry
`timeout_ms` 20000 and the server `--slo-ms 5000` by default: pinned, so the bound admission keeps under pressure
does not follow a warm-up measured on a busy machine, and a long request's four inputs (each alone in a batch
when a busy CPU lowers the batch budget) are refused by the objective, not by a 4 s default deadline. Counted in
the measured window (after `--warmup`; extended up to `--max-s` until each tenant has `--min-answers` answers: a
long request is 880 tokens, and a busy machine serves few): the answers' summed `usage.prompt_tokens` per tenant
(what the model served them), requests answered and refused, and the ratio of the two tenants' tokens (larger
over smaller; 1.00 is an equal share).

The old behaviour is the base commit (default b6ba887, the branch point of issue 33: tenants took turns one item a
turn, length classes a batch a turn, and admission counted items): its tree is extracted with `git archive` into
a temporary directory and its server started from there (nothing is checked out in this repository). Same
machine, same settings, one after the other. The machine is shared and noisy: the load average is reported
beside each row.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/fairness.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import asyncio
import contextlib
import math
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field

import aiohttp
import orjson

from bench import plot, report, servers
from bench.common import add_output_flags, guarded, log_dir, out_dir, run_name
from bench.fair_metrics import Answered, DeviceSampler, difference, idle_while_waiting, windows

BASE_COMMIT = "b6ba887"
# 218 words of this sentence are 220 minilm tokens (with [CLS] and [SEP]); the short input is 8.
LONG_TEXT = " ".join(("the quick brown fox jumps over the lazy dog " * 30).split()[:218])
SHORT_TEXT = "a short one: item 7"
SCENARIO = {"long": (LONG_TEXT, 4), "short": (SHORT_TEXT, 16)}  # tenant -> (input, inputs per request)
# Closed loops per tenant: each keeps several batches of inputs outstanding (long: 32 inputs, ~3 batches of the
# 12 a 2,750-token budget holds; short: 256, 4 batches of 64), so it still has inputs waiting while the answers
# of its last batch travel back and it sends again: backlogged. A client holding one batch or less is served
# only every other batch, whatever the queue's policy (bench/results/fairness-*-loops4.md).
LOOPS = {"long": 8, "short": 16}


@dataclass
class Served:
    """One tenant's figures over the measured window."""

    tenant: str
    tokens: int = 0  # summed usage.prompt_tokens of the answers
    answered: int = 0
    refused: int = 0  # 503 / 429 at the door
    other: dict[str, int] = field(default_factory=dict)  # any other status (504, errors): count by status
    last_refusal: str = ""  # the message of the last refusal seen, for the table's reader
    window_s: float = 0.0  # the measured window (extended until every tenant had its answers)


async def closed_loops(
    url: str,
    keys: dict[str, str],
    duration_s: float,
    warmup_s: float = 0.0,
    loops: dict[str, int] | None = None,
    backoff_s: float = 0.05,
    timeout_ms: float | None = None,
    min_answers: int = 0,
    max_s: float = 0.0,
    log: list[Answered] | None = None,
    sampler: DeviceSampler | None = None,
) -> dict[str, Served]:
    """Each tenant of `keys` (tenant -> API key) runs `loops[tenant]` closed loops (default `LOOPS`) of its
    `SCENARIO` request for
    `warmup_s`, then a measured window of `duration_s`, extended (up to `max_s` in all) until every tenant has
    `min_answers` answers in it: a long request is ~880 tokens, so a share measured over a handful of them is
    mostly rounding (a busy machine serves few). Answers and refusals that come back inside the window are
    counted. A refused request is sent again after `backoff_s`. `timeout_ms`: each request's (None: the
    server's default). `log` gets every answer of the run (warm-up too; seconds from the start, its tokens);
    `sampler` reads the server's devices meanwhile, on the same clock."""
    start = time.monotonic()
    if sampler is not None:
        sampler.start = start
    measure_from = start + warmup_s
    stop = [measure_from + duration_s]
    last = measure_from + max(duration_s, max_s)
    out = {tenant: Served(tenant) for tenant in keys}
    conn = aiohttp.TCPConnector(limit=0)

    def over(now: float) -> bool:
        if now < stop[0]:
            return False
        if now < last and any(s.answered < min_answers for s in out.values()):
            stop[0] = now + 0.5  # not yet: a little longer
            return False
        return True

    client_timeout = aiohttp.ClientTimeout(total=max(30.0, 2 * (timeout_ms or 0) / 1000))
    async with aiohttp.ClientSession(connector=conn, timeout=client_timeout) as session:

        async def loop(tenant: str) -> None:
            text, n = SCENARIO[tenant]
            # base64 vectors, as OpenAI's own client asks: parsing 16 x 384 floats per answer in Python delayed
            # the short tenant's next request by more than its batch took on a busy machine, so its closed loops
            # were throttled by the client, not the server
            body: dict[str, object] = {"model": "minilm", "input": [text] * n, "encoding_format": "base64"}
            if timeout_ms is not None:
                body["timeout_ms"] = timeout_ms
            headers = {"Authorization": f"Bearer {keys[tenant]}"}
            got = out[tenant]
            while not over(time.monotonic()):
                async with session.post(url + "/v1/embeddings", json=body, headers=headers) as r:
                    payload = orjson.loads(await r.read())
                    status = r.status
                now = time.monotonic()
                counted = measure_from <= now and not over(now)
                if status == 200:
                    if log is not None:
                        log.append(Answered(now - start, tenant, int(payload["usage"]["prompt_tokens"])))
                    if counted:
                        got.tokens += int(payload["usage"]["prompt_tokens"])
                        got.answered += 1
                    continue
                if counted:
                    if status in (429, 503):
                        got.refused += 1
                        got.last_refusal = str((payload.get("error") or {}).get("message", ""))[:160]
                    else:
                        got.other[str(status)] = got.other.get(str(status), 0) + 1
                await asyncio.sleep(backoff_s)

        counts = {**LOOPS, **(loops or {})}
        watch = asyncio.create_task(sampler.run(session, math.inf)) if sampler is not None else None
        await asyncio.gather(*(loop(tenant) for tenant in keys for _ in range(counts[tenant])))
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
    for s in out.values():
        s.window_s = stop[0] - measure_from
    return out


def ratio(served: dict[str, Served]) -> float:
    """The larger tenant's tokens over the smaller's (inf when one got none)."""
    tokens = sorted(s.tokens for s in served.values())
    return tokens[-1] / tokens[0] if tokens[0] else float("inf")


def write_config(directory: Path, root: Path) -> tuple[Path, dict[str, str]]:
    """A config with the minilm model and a paid key per tenant, made by `batchserve keys add` of `root`."""
    config = directory / "bs.toml"
    config.write_text('[[models]]\nname = "minilm"\nbackend = "minilm"\n')
    keys = {tenant: servers.add_key(config, tenant, "paid", root=root) for tenant in SCENARIO}
    return config, keys


def env_for(root: Path) -> dict[str, str]:
    """This environment without BATCHSERVE_* variables, importing `batchserve` from `root`."""
    return {**servers.clean_env(), "PYTHONPATH": str(root)}


def extract(commit: str, into: Path) -> Path:
    """The tree of `commit` (its batchserve package) in `into`, by `git archive`: no checkout, no worktree."""
    archive = subprocess.run(
        ["git", "archive", commit, "batchserve", "pyproject.toml"], cwd=servers.REPO, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def literature(log: list[Answered], sampler: DeviceSampler, t0: float, t1: float, window_s: float) -> dict:
    """The measured window [t0, t1] in the literature's terms (`bench.fair_metrics`): the accumulated tokens
    served to `long` less those to `short`, over U, the largest answer's tokens; Jain's index and the device's
    idle time while inputs waited, per window of `window_s`."""
    inside = [x for x in log if t0 <= x.t <= t1]
    unit = max((x.cost for x in inside), default=math.nan)
    diff = difference(inside, ("long", "short"), t0)
    per = windows(inside, tuple(SCENARIO), t0, t1, window_s)
    for w in per:
        w |= idle_while_waiting(sampler.readings, w["from_s"], w["to_s"])
    return {
        "unit": unit,
        "diff": [(round(t, 3), d) for t, d in diff],
        "max_abs_d": max(abs(d) for _, d in diff) / unit,
        "windows": per,
        "idle": idle_while_waiting(sampler.readings, t0, t1),
    }


def run_one(label: str, root: Path, a: argparse.Namespace, logs: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="fairness-") as tmp:
        config, keys = write_config(Path(tmp), root)
        cmd = [
            sys.executable,
            "-m",
            "batchserve",
            "serve",
            "--port",
            "0",
            "--config",
            str(config),
            "--drain-grace-s",
            "0",
            *([f"--slo-ms={a.slo_ms:g}"] if a.slo_ms else []),
            *a.server_arg,
        ]
        server = servers.start(label, cmd, logs, timeout_s=300, env=env_for(root))
        try:
            load_before = os.getloadavg()[0]
            log: list[Answered] = []
            sampler = DeviceSampler(server.base, 0.0, a.sample_ms / 1000)
            served = asyncio.run(
                closed_loops(
                    server.base,
                    keys,
                    a.duration,
                    a.warmup,
                    {"long": a.loops_long, "short": a.loops_short},
                    a.backoff_ms / 1000,
                    a.timeout_ms or None,
                    a.min_answers,
                    a.max_s,
                    log,
                    sampler,
                )
            )
            load_after = os.getloadavg()[0]
        finally:
            servers.stop(server)
    return {
        "label": label,
        "served": {t: asdict(s) for t, s in served.items()},
        "ratio": ratio(served),
        "loadavg": [round(load_before, 2), round(load_after, 2)],
        "fair": literature(log, sampler, a.warmup, a.warmup + next(iter(served.values())).window_s, a.window_s),
    }


def markdown(rows: list[dict], a: argparse.Namespace, prov: dict) -> str:
    head = [
        "run",
        "tenant",
        "tokens served",
        "answered",
        "refused",
        "other",
        "window s",
        "tokens/s",
        "ratio",
        "load avg",
    ]
    lines = []
    for row in rows:
        for tenant, s in row["served"].items():
            lines.append(
                [
                    row["label"],
                    tenant,
                    s["tokens"],
                    s["answered"],
                    s["refused"],
                    ", ".join(f"{k}: {v}" for k, v in s["other"].items()) or "0",
                    f"{s['window_s']:.1f}",
                    f"{s['tokens'] / max(s['window_s'], 1e-9):.0f}",
                    f"{row['ratio']:.2f}",
                    f"{row['loadavg'][0]} → {row['loadavg'][1]}",
                ]
            )
    fair_rows = []
    for row in rows:
        f = row["fair"]
        for w in f["windows"] or [{"from_s": math.nan, "to_s": math.nan, "jain": math.nan, "served": {}} | f["idle"]]:
            fair_rows.append(
                [
                    row["label"],
                    f"{f['max_abs_d']:.2f} (U {report.fmt(f['unit'], '.0f')})",
                    f"{w['from_s']:.1f}-{w['to_s']:.1f}",
                    " / ".join(report.fmt(w["served"].get(t), ".0f") for t in SCENARIO),
                    report.fmt(w["jain"], ".4f"),
                    report.fmt(w["idle_ms"], ".0f"),
                    report.fmt(w["idle_share"] * 100, ".2f"),
                ]
            )
    machine, git = prov["machine"], prov["git"]
    return "\n".join(
        [
            "# Tokens served per tenant (issue 33, item 2)",
            "",
            f"Two `paid` tenants on minilm, {a.loops_long} and {a.loops_short} closed loops for {a.warmup:g} s warm-up "
            f"+ {a.duration:g} s measured (extended up to {a.max_s:g} s until each tenant had {a.min_answers} "
            "answers): `long` sends 4 inputs of 220 tokens a request, `short` 16 of 8; a refused request is sent again "
            f"after {a.backoff_ms:g} ms; timeout_ms {f'{a.timeout_ms:g}' if a.timeout_ms else 'the server default'}, "
            f"server --slo-ms {f'{a.slo_ms:g}' if a.slo_ms else 'its default (derived from its warm-up)'}. Ratio: the "
            "larger tenant's tokens over the smaller's (1.00 = equal shares). "
            f"`base` is commit {a.base} (tenants took turns one item a turn), extracted with `git archive`.",
            "",
            report.table(head, lines),
            "",
            "In the literature's terms (`bench/fair_metrics.py`), over the measured window from its start t0: the "
            "accumulated service difference D = (tokens served to `long` - to `short`) / U, U the largest answer's "
            "tokens (a long request), as its largest |D| (the bound start-time fair queuing and VTC give two "
            f"backlogged tenants is 2); tokens and Jain's index per {a.window_s:g} s window; the device's idle time "
            f"while inputs waited (read every {a.sample_ms:g} ms from /internal/health and /metrics; the hand-off "
            "between two batches counts as idle). Answers are stamped as the client reads them.",
            "",
            report.table(
                [
                    "run",
                    "max abs D / U",
                    "window s",
                    "tokens " + " / ".join(SCENARIO),
                    "Jain",
                    "idle ms while waiting",
                    "idle % of waiting",
                ],
                fair_rows,
            ),
            "",
            f"Machine: {machine['cpu_model']}, {machine['cores_usable']} usable cores, load average at start "
            f"{machine['loadavg_at_start']} (shared by other sessions: noisy). Commit {git['commit'][:12]}"
            f"{' (dirty)' if git['dirty'] else ''}, {prov['when_utc']}. Server flags: "
            f"{' '.join(a.server_arg) or 'none'}.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=15.0, help="measured seconds per run (default %(default)g)")
    p.add_argument("--min-answers", type=int, default=8, help="answers each tenant needs in the window (default 8)")
    p.add_argument("--max-s", type=float, default=45.0, help="the longest the window is extended to (default 45)")
    p.add_argument("--slo-ms", type=float, default=5000.0, help="the server's --slo-ms (0: its default)")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of load before the window (default %(default)g)")
    p.add_argument("--loops-long", type=int, default=LOOPS["long"], help="closed loops of the long tenant (8)")
    p.add_argument("--loops-short", type=int, default=LOOPS["short"], help="closed loops of the short tenant (16)")
    p.add_argument("--backoff-ms", type=float, default=50.0, help="wait before resending a refused request")
    p.add_argument(
        "--timeout-ms",
        type=float,
        default=20000.0,
        help="each request's timeout_ms (0: the server's default, derived from its warm-up)",
    )
    p.add_argument("--window-s", type=float, default=10.0, help="Jain's index window (default %(default)g)")
    p.add_argument("--sample-ms", type=float, default=200.0, help="how often the devices are read (default 200)")
    p.add_argument("--base", default=BASE_COMMIT, help="the commit of the old behaviour ('' skips it)")
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for `batchserve serve`")
    add_output_flags(p, name="fairness")
    a = p.parse_args(argv)
    name = run_name(a, "fairness")
    logs = log_dir(a, name)
    prov = report.provenance()
    rows: list[dict] = []
    rep: dict = {"settings": vars(a) | {"out_dir": str(a.out_dir)}, **prov, "rows": rows}
    base_dir = Path(tempfile.mkdtemp(prefix="fairness-base-")) if a.base else None
    try:
        with guarded(rep):
            rows.append(run_one("this checkout", servers.REPO, a, logs))
            if base_dir is not None:
                rows.append(run_one(f"base {a.base}", extract(a.base, base_dir), a, logs))
    finally:
        if base_dir is not None:
            shutil.rmtree(base_dir, ignore_errors=True)
    md = markdown(rows, a, prov)
    if out_dir(a) is not None and rows:
        md += f"\n\n![the service difference over time]({name}.png)"
    print(md)
    paths = report.write(name, rep, md, out_dir(a))
    if paths is not None and rows:
        series = {
            row["label"]: (
                [a.warmup + t for t, _ in row["fair"]["diff"]],
                [d / row["fair"]["unit"] for _, d in row["fair"]["diff"]],
            )
            for row in rows
        }
        title = "Accumulated service difference, tokens to `long` less to `short` (minilm, 2 paid tenants)"
        png = plot.series_png(series, title, "seconds of load", "difference / largest request's tokens", (2.0, -2.0))
        paths[1].with_suffix(".png").write_bytes(png)
    print(report.written(paths, logs if out_dir(a) else None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
