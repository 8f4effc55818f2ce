"""The ecosystem's load generators against a real `--backend smollm2` server, with their defaults: does each one
run to the end, and what does it measure? (issue 26, item 5)

`guidellm run` is given the server's URL and nothing about the model: it probes `GET /health` (its backend
validation, on by default), takes the first id of `GET /v1/models` as the model (the chat model, listed first)
and streams chat completions. The only extra it gets is where the model's tokenizer is, as a local path
(`--tokenizer`), because this machine reaches no model hub: online, guidellm would load it by the model's
name. `aiperf` (NVIDIA's) runs when the `aiperf` command is found (it pins older orjson, pandas and
prometheus-client than batchserve's venv has, so it may live in a venv of its own: `--aiperf PATH`). aiperf
needs a model named (`--model`; it does not read /v1/models): run with its defaults it stops before sending a
request, so it runs a second time with the first id of /v1/models named.

    python -m bench.ecosystem_clients                 # ~2 minutes on a CPU: load, 16 requests each; prints a table
    python -m bench.ecosystem_clients --record        # also bench/results/ecosystem-<time>.{md,json}

Requests are bounded (`--requests`, synchronous: one at a time), since this is a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import report, servers
from bench.common import add_output_flags, guarded, log_dir, out_dir, run_name

GUIDELLM = "guidellm"


def tokenizer_dir() -> Path | None:
    """The transformers-format copy of SmolLM2 that the smollm2 backend converts once (its tokenizer)."""
    root = Path(os.path.expanduser(os.environ.get("BATCHSERVE_WEIGHTS_CACHE", "~/.cache/batchserve")))
    found = sorted(root.glob("SmolLM2-135M-Instruct*/tokenizer.json"), key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None


def run_guidellm(base: str, requests: int, work: Path, tokenizer: Path) -> dict:
    out = work / "guidellm.json"
    cmd = [GUIDELLM, "run", "--backend", f"kind=openai_http,target={base}", "--profile", "kind=synchronous",
           "--constraint", f"kind=max_requests,count={requests}",
           "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=32",
           "--tokenizer", f"kind=hf_auto,model={tokenizer}", "--output", f"kind=json,path={out}",
           "--disable-console-interactive"]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    row: dict = {"tool": "guidellm", "rc": proc.returncode, "wall_s": round(time.monotonic() - started, 1),
                 "command": " ".join(cmd[:4] + ["..."])}
    if proc.returncode != 0 or not out.exists():
        row["error"] = (proc.stdout + proc.stderr)[-2000:]
        return row
    bench = json.loads(out.read_text())["benchmarks"][0]
    metrics = bench["metrics"]

    def stat(name: str, key: str = "median") -> float | None:
        values = metrics.get(name, {}).get("successful") or {}
        return values.get(key)

    totals = metrics.get("request_totals") or {}
    spec = json.loads(out.read_text()).get("config", {}).get("spec", {}).get("backend", {})
    row.update({"model_named": spec.get("model") or None, "validate_backend": spec.get("validate_backend"),
                "completed": totals.get("successful"), "errored": totals.get("errored"),
                "req_per_s": stat("requests_per_second", "mean"),
                "ttft_ms_p50": stat("time_to_first_token_ms"), "itl_ms_p50": stat("inter_token_latency_ms"),
                "latency_s_p50": stat("request_latency")})
    return row


def run_aiperf(aiperf: str, base: str, model: str | None, requests: int, work: Path, tokenizer: Path) -> dict:
    """aiperf's `profile`, streaming chat, one request at a time; with `model` None, no model is named."""
    artifacts = work / ("aiperf-named" if model else "aiperf")
    cmd = [aiperf, "profile", "--url", base, *(["--model", model] if model else []), "--endpoint-type", "chat",
           "--streaming", "--request-count", str(requests), "--concurrency", "1", "--tokenizer", str(tokenizer),
           "--artifact-dir", str(artifacts), "--ui-type", "none", "--no-auto-plot"]
    started = time.monotonic()
    # Not HF_HUB_OFFLINE here: aiperf 0.13's offline branch treats a local tokenizer path as a hub repo id
    # (HFValidationError); online, a local path is loaded as one, and nothing is fetched.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    row: dict = {"tool": "aiperf" + (" (model named)" if model else ""), "rc": proc.returncode,
                 "wall_s": round(time.monotonic() - started, 1), "model_named": model}
    found = sorted(artifacts.rglob("profile_export_aiperf.json")) if artifacts.exists() else []
    if proc.returncode != 0 or not found:
        row["error"] = (proc.stdout + proc.stderr)[-2000:]
        return row
    data = json.loads(found[0].read_text())

    def stat(name: str, key: str = "p50") -> float | None:
        value = data.get(name)
        return value.get(key) if isinstance(value, dict) else None

    row.update({"completed": (data.get("request_count") or {}).get("avg"), "errored": None,
                "req_per_s": stat("request_throughput", "avg"), "ttft_ms_p50": stat("time_to_first_token"),
                "itl_ms_p50": stat("inter_token_latency"),
                "latency_s_p50": (stat("request_latency") or 0) / 1000 or None})
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=16, help="requests per tool (default %(default)d)")
    p.add_argument("--aiperf", default=shutil.which("aiperf") or "", help="the aiperf command (default: on PATH)")
    add_output_flags(p, name="ecosystem")
    return p.parse_args(argv)


def why(output: str) -> str:
    """The telling lines of a tool's failure output (its boxes and borders stripped)."""
    lines = [re.sub(r"[│╭╮╰╯─]+", " ", line).strip() for line in output.splitlines()]
    lines = [line for line in lines if line]
    keep = [i for i, line in enumerate(lines) if re.search(r"error|Reason|should|required", line, re.I)]
    picked = lines[keep[0]:keep[0] + 4] if keep else lines[-2:]
    return " ".join(picked)[:400]


def main() -> None:
    a = parse_args()
    name = run_name(a, "ecosystem")
    rep: dict = {"provenance": report.provenance(), "settings": {"backend": "smollm2", "requests": a.requests, "profile": "synchronous",
                              "guidellm_data": "synthetic_text prompt_tokens=64 output_tokens=32"}}
    rows: list[dict] = []
    with guarded(rep), tempfile.TemporaryDirectory(prefix="ecosystem-") as tmp:
        work = Path(tmp)
        cmd = [sys.executable, "-m", "batchserve", "serve", "--port", "0", "--backend", "smollm2", "--jobs-db", "",
               "--drain-grace-s", "0"]
        server = servers.start("smollm2", cmd, log_dir(a, name), timeout_s=900)
        rep["server_ready_s"] = round(server.ready_s, 1)
        tokenizer = tokenizer_dir()
        if tokenizer is None:
            raise SystemExit("no converted SmolLM2 tokenizer under ~/.cache/batchserve (the server makes it)")
        rows.append(run_guidellm(server.base, a.requests, work, tokenizer))
        model = json.loads(subprocess.run(["curl", "-s", server.base + "/v1/models"], capture_output=True,
                                          text=True).stdout)["data"][0]["id"]
        if a.aiperf:
            rows.append(run_aiperf(a.aiperf, server.base, None, a.requests, work, tokenizer))
            if rows[-1].get("error"):  # its defaults did not run: say why, and run it with the model named
                rows.append(run_aiperf(a.aiperf, server.base, model, a.requests, work, tokenizer))
        else:
            rows.append({"tool": "aiperf", "error": "not installed (pip install aiperf, in a venv of its own)"})
    rep["rows"] = rows
    header = ["tool", "rc", "completed", "errored", "req/s", "TTFT p50 ms", "ITL p50 ms", "latency p50 s", "wall s"]
    md = report.table(header, [[r.get("tool"), r.get("rc"), r.get("completed"), r.get("errored"),
                                report.fmt(r.get("req_per_s"), ".2f"), report.fmt(r.get("ttft_ms_p50")),
                                report.fmt(r.get("itl_ms_p50")), report.fmt(r.get("latency_s_p50"), ".2f"),
                                r.get("wall_s")] for r in rows])
    notes = "\n".join(f"- {r['tool']} stopped: {why(r['error'])}" for r in rows if r.get("error"))
    markdown = (f"# guidellm / aiperf against --backend smollm2 (no model named, validation on)\n\n{md}\n\n"
                f"{a.requests} requests per tool, synchronous; server ready in {rep.get('server_ready_s')} s.\n"
                + (f"\n{notes}\n" if notes else ""))
    print(markdown)
    print(report.written(report.write(name, rep, markdown, out_dir(a))))


if __name__ == "__main__":
    main()
