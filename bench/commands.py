"""bench/'s commands in five groups, by what they measure, and a runner for a group (issue 35 item 6):

    python -m bench                           # the catalogue: every command, what it measures, its time, its needs
    python -m bench contract --quick          # each bench of a group in turn, with its short settings
    python -m bench hostile --record          # ... at full length, results into bench/results/ (--out DIR: to DIR)
    python -m bench fleet --only fleet,scale  # some of a group

Why: bench/ grew a script per issue; a newcomer needs to see which ones are the standard benches and what each
one answers. Each bench stays its own `python -m bench.<name>` command (this module only runs them, one
subprocess each, in turn, and reports their exit statuses). The GPU group's main command is
`bash bench/gpu_check.sh`, run on a lent GPU machine with the fixed procedure in bench/README.md; from here
`python -m bench gpu --quick` dry-runs its stages on the CPU (`--cpu-smoke`) beside the benches that stand
the GPU in by a clock. bench/README.md's table lists the same commands (a unit test keeps the two in step).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Bench:
    name: str  # `python -m bench.<name>`, or a script under bench/ (ends in .sh)
    measures: str
    runtime: str  # at full length, on this 2-core machine
    needs: str  # "-" (sim only), "real model (CPU)", "GPU", ...
    quick: tuple[str, ...] = ()  # flags for a short run (a check of the path, not a measurement)
    output: str = "dir"  # how it takes a destination: "dir" (--record / --out DIR), "file" (--out FILE), "" none

    def command(self, quick: bool, record: bool, out: Path | None) -> tuple[list[str], dict[str, str]]:
        env: dict[str, str] = {}
        if self.name.endswith(".sh"):
            cmd = ["bash", f"bench/{self.name}", *(self.quick if quick else ())]
            if out is not None:
                env["OUT"] = str(out)
            return cmd, env
        cmd = [sys.executable, "-m", f"bench.{self.name}", *(self.quick if quick else ())]
        if self.output and record:
            cmd.append("--record")
        elif self.output == "dir" and out is not None:
            cmd += ["--out", str(out)]
        elif self.output == "file" and out is not None:
            cmd += ["--out", str(out / f"{self.name}.md")]
        return cmd, env


GROUPS: dict[str, tuple[str, tuple[Bench, ...]]] = {
    "contract": (
        "the contract on the sim backend: latency against the ideal batcher, CPU per request",
        (
            Bench(
                "run_standard",
                "the standard table: p95 per row beside the ideal batcher on the same arrivals, "
                "CPU per request against bare Starlette and the minimal batcher",
                "~4 min",
                "-",
                ("--duration", "5", "--warmup", "2", "--rows", "1:900", "--skip-cpu"),
            ),
            Bench(
                "cpu_compare",
                "server CPU per request at 900 RPS: bare Starlette, minimal batcher, batchserve, "
                "taking turns window by window",
                "~2.5 min",
                "-",
                ("--repeats", "1", "--duration", "4", "--warmup", "2"),
            ),
            Bench(
                "hotpath",
                "in-process CPU µs per request of the inference route beside the bare route and the "
                "minimal batcher, no sockets (`--floor`: plain ASGI references)",
                "~20 s",
                "-",
            ),
            Bench(
                "ideal",
                "the ideal batcher's p50/p95/p99 (a discrete-event model, no server)",
                "seconds",
                "-",
                output="",
            ),
            Bench("plan_check", "`batchserve plan`'s predictions beside a recorded standard run", "seconds", "-"),
            Bench(
                "protocols",
                "KServe v2 against /v1/inference at 900 RPS, and OpenTelemetry on against off",
                "~1.5 min",
                "-",
                ("--duration", "4", "--warmup", "2", "--repeat", "1"),
            ),
            Bench(
                "jobs_bench",
                "interactive p95 with and without a 20,000-item batch job; the job's items/s",
                "~1 min",
                "-",
                ("--duration", "5", "--warmup", "2", "--job-items", "5000"),
            ),
            Bench(
                "startup",
                "seconds to port, /healthz and /readyz, and to exit after SIGTERM (`--code DIR`: "
                "another tree beside this one)",
                "~30 s (sim)",
                "-",
                ("--backend", "sim"),
            ),
            Bench(
                "locust",
                "the shipped locustfile against a server it starts: stages up to 1.5x capacity, each "
                "stage's offered/answered rate, locust and server p50/p95, refusals; the ledger by tier",
                "~70 s",
                "locust",
                ("--users", "20", "--run-time", "12s", "--stages", "2"),
            ),
            Bench(
                "burst",
                "a burst rides one batch: locust users spawned at once at 10, 180 and 900 req/s (locust's "
                "and the server's p50/p95, refusals) and open-loop Poisson at 10-950 req/s and 1,800 req/s on 4 "
                "devices, beside `--base DIR`",
                "~6 min",
                "locust",
                ("--duration", "4"),
            ),
        ),
    ),
    "models": (
        "real models on the CPU: the served rate against the model alone, and peers",
        (
            Bench(
                "embed_bench",
                "all-MiniLM-L6-v2 offline by batch size, then batchserve and Infinity under the same open-loop load",
                "~8 min",
                "real model (CPU); Infinity optional",
                ("--smoke",),
            ),
            Bench(
                "cost_bench",
                "minilm capacity by count and by cost, then 0.6-2x of it against batchserve and "
                "Infinity: goodput, p95, where refusals happen",
                "~6 min",
                "real model (CPU); Infinity optional",
                ("--smoke",),
            ),
            Bench(
                "generation_bench",
                "SmolLM2 on real weights: static batches, transformers' manager, the slot "
                "stepper, the Engine and the live server: output tokens/s, short requests' p50",
                "~4 min",
                "real model (CPU)",
                ("--requests", "8", "--batch", "4", "--long", "64", "--no-http"),
            ),
            Bench(
                "inference_paths",
                "/v1/inference of smollm2 on its two paths, static batches vs the slot "
                "stepper, open-loop: answered/s, p50/p95, 503s, same text",
                "~4 min",
                "real model (CPU)",
                ("--rates", "1", "--duration", "5"),
            ),
            Bench(
                "executor_bench",
                "in-server vs offline batch time and /healthz latency under load, per executor (thread, process)",
                "~10 min",
                "real model (CPU)",
                ("--duration", "10", "--rates", "1", "--sizes", "1,2", "--max-new-tokens", "4"),
                output="file",
            ),
            Bench(
                "capacity_embed",
                "all-MiniLM-L6-v2 capacity (highest rate served with at most 1 % refused at p95 <= 1 s, 8-40-word "
                "requests, open loop): batchserve on torch and on int8 ONNX beside offline encode, the int8 graph "
                "alone and Infinity, with a profile of the server (issues 36, 48)",
                "~10 min",
                "real model (CPU); Infinity optional",
                ("--smoke",),
            ),
            Bench(
                "fairness",
                "tokens served per tenant, two paid tenants on minilm (4 x 220-token inputs vs 16 x 8 a "
                "request, closed loops), this checkout beside the base commit's item turns (issue 33)",
                "~3 min",
                "real model (CPU)",
                ("--duration", "5", "--max-s", "10", "--warmup", "1"),
            ),
            Bench(
                "gen_share",
                "the generation engine's shares by tenant and tier through HTTP: a tenant holding "
                "every slot beside another's short chats; a 100-line chat batch beside interactive chats (issue 33)",
                "~65 min",
                "real model (CPU)",
                ("--short", "3", "--hog-tokens", "200", "--lines", "6", "--line-tokens", "16"),
            ),
            Bench(
                "job_pricing",
                "another tenant's interactive /v1/embeddings beside a batch of 2,048-input lines "
                "(`--base DIR`: the commit before, side by side)",
                "~4 min",
                "real model (CPU)",
            ),
        ),
    ),
    "gpu": (
        "the GPU: the one-call check on a lent machine, and the host's side with the GPU stood in",
        (
            Bench(
                "gpu_check.sh",
                'on a lent GPU (bench/README.md, "The one-call GPU check"): graph paths\' tokens '
                "against the CPU, /v1/inference static vs stepper, the slot stepper at 256-1,024 rows, minilm "
                "served vs offline",
                "~6 min (340 s budget)",
                "GPU (prepared by `bash bench/gpu_prep.sh`)",
                ("--cpu-smoke",),
            ),
            Bench(
                "stepper_host",
                "the real slot stepper and Engine over a device stood in by a clock (4 ms a "
                "step of 256): does the host keep a GPU busy? (`--http`: through a live server)",
                "~1 min",
                "-",
                ("--repeats", "1", "--requests", "256"),
            ),
            Bench(
                "engine_loop",
                "generated tokens a second the event loop's side (Engine, detokenization, streams) takes, no model",
                "~15 s",
                "-",
                ("--repeats", "1"),
            ),
            Bench(
                "prefill_burst",
                "how long a burst of joins stalls the sequences decoding, per prefill budget "
                "(a 2-layer model, random weights)",
                "~1 min",
                "-",
            ),
        ),
    ),
    "fleet": (
        "several servers and processes: behind nginx, one process's ceiling, the autoscaling signal",
        (
            Bench(
                "fleet",
                "3 servers behind nginx against one alone, and a rolling restart under load",
                "~3 min",
                "nginx (apt-get)",
                ("--duration", "4", "--warmup", "2", "--restart-window", "20", "--grace", "1", "--restart-rate", "600"),
            ),
            Bench(
                "scale",
                "one process's ceiling and CPU per request, then 1 and N processes around `batchserve "
                "plan`'s prediction",
                "~2 min",
                "-",
                ("--duration", "2", "--warmup", "1", "--factors", "0.8,1.0", "--max-ramp-rows", "3"),
            ),
            Bench(
                "autoscale_signal",
                "a ramp 30 % -> 130 % of capacity: when each /metrics signal crosses, against when p95 breaks the SLO",
                "~75 s",
                "-",
                ("--ramp-s", "20", "--warmup-s", "3"),
            ),
        ),
    ),
    "hostile": (
        "hostile load: overload, faults, abuse, noisy neighbours",
        (
            Bench(
                "overload",
                "1 device offered 3x its capacity: admitted p95, refusal latency, memory",
                "~25 s",
                "-",
                ("--duration", "6"),
            ),
            Bench(
                "drill",
                "4 devices at 1,500 RPS with poison and hanging inputs and a SIGTERM: nothing left unanswered",
                "~40 s",
                "-",
                ("--rate", "300", "--duration", "12", "--hang-at", "4", "--signal-at", "10"),
            ),
            Bench(
                "tenancy_bench",
                "tiers, tenants and models side by side: a paid tenant beside a free flood",
                "~2 min",
                "-",
                ("--duration", "4", "--warmup", "2"),
            ),
            Bench(
                "soak",
                "hostile clients (idle floods, slowloris, huge headers, failing jobs, 1 MB prompts) "
                "beside 50 % interactive load",
                "~5 min",
                "real models (CPU) unless turned off",
                (
                    "--duration",
                    "10",
                    "--idle",
                    "500",
                    "--slowloris",
                    "50",
                    "--prompt-clients",
                    "0",
                    "--embed-clients",
                    "0",
                ),
            ),
            Bench(
                "idle_flood",
                "server RSS before, during and after floods of idle connections",
                "~30 s",
                "-",
                ("--sizes", "2000"),
            ),
            Bench(
                "grpc_flood",
                "20,000 idle gRPC connections against a server of 20,000 descriptors while /healthz, a "
                "keyed request and a gRPC call keep answering",
                "~40 s",
                "-",
                ("--connections", "2000", "--server-fd-limit", "2000", "--hold-s", "4", "--idle-s", "1"),
            ),
            Bench(
                "storage",
                "three 59 MB uploads beside another tenant's 30 req/s (p95, RSS), the upload -> batch "
                "-> cancel -> delete loop under a byte quota, six GETs of a 2,048-input output (issue 34)",
                "~3 min",
                "-",
                ("--upload-mb", "5", "--parts", "bc"),
            ),
            Bench(
                "hung_child",
                "`--processes 2` under load, one child SIGSTOPped: time to kill and replace it, p95 "
                "before/during/after, every request's outcome (issue 34)",
                "~45 s",
                "-",
                ("--duration", "10", "--stop-at", "3", "--stop-s", "4"),
            ),
            Bench(
                "tokenize_bench",
                "the tokenizer stage on the real minilm: RSS across ten 938 KB embeddings and three 94 KB rerank "
                "bodies, another tenant's answers beside 16,000-character inputs (issue 46)",
                "~1.5 min",
                "real model (CPU)",
                ("--seconds", "3", "--settle", "3"),
            ),
            Bench(
                "ledger_drill",
                "two keyed tenants overloading a sim server: the SLO ledger's outcomes against the "
                "clients' own counts, per tier and per key (issue 33)",
                "~20 s",
                "-",
                ("--seconds", "2"),
            ),
            Bench(
                "priority",
                "one key's two classes at 1.5x one sim device's capacity: `\"priority\"` requests (enterprise) "
                "beside default ones (paid): per class 200 / refused / 504 and the server's queue wait (issue 49)",
                "~40 s",
                "-",
                ("--quick",),
            ),
            Bench(
                "fair_service",
                "two backlogged paid tenants (1-input and 8-input requests, closed loops) on one sim device: "
                "the service difference over time, Jain's index per 10 s, device idle while inputs wait (issue 49)",
                "~45 s",
                "-",
                ("--quick",),
            ),
        ),
    ),
}


def catalogue() -> str:
    lines = []
    for group, (what, benches) in GROUPS.items():
        lines.append(f"{group}: {what}")
        for b in benches:
            cmd = f"bash bench/{b.name}" if b.name.endswith(".sh") else f"python -m bench.{b.name}"
            lines.append(f"  {cmd:<36} {b.runtime:<22} {b.needs}")
    lines.append("\npython -m bench GROUP [--quick] [--record | --out DIR] [--only a,b]: a group's benches in turn")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=catalogue(),
    )
    p.add_argument("group", nargs="?", choices=sorted(GROUPS), help="run this group's benches in turn")
    p.add_argument("--quick", action="store_true", help="each bench's short settings: a check, not a measurement")
    p.add_argument("--only", default="", help="comma-separated bench names of the group")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--record", action="store_true", help="each bench writes into bench/results/")
    where.add_argument("--out", type=Path, default=None, help="each bench writes into this directory")
    a = p.parse_args(argv)
    if a.only and a.group is None:
        p.error("--only needs a group")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.group is None:
        print(catalogue())
        return 0
    benches = GROUPS[a.group][1]
    if a.only:
        wanted = {n.strip().removesuffix(".py") for n in a.only.split(",") if n.strip()}
        unknown = wanted - {b.name for b in benches}
        if unknown:
            print(f"not in {a.group}: {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        benches = tuple(b for b in benches if b.name in wanted)
    results: list[tuple[str, int, float]] = []
    for b in benches:
        cmd, env = b.command(a.quick, a.record, a.out)
        print(f"\n== {' '.join(cmd)}", flush=True)
        start = time.monotonic()
        try:
            rc = subprocess.run(cmd, check=False, cwd=REPO, env={**os.environ, **env}).returncode
        except KeyboardInterrupt:  # the bench stops its own servers on the same Ctrl-C
            results.append((b.name, 130, time.monotonic() - start))
            break
        results.append((b.name, rc, time.monotonic() - start))
    print(f"\n{a.group}: " + ", ".join(f"{n} {'ok' if rc == 0 else f'exit {rc}'} ({s:.0f} s)" for n, rc, s in results))
    return 0 if results and all(rc == 0 for _, rc, _ in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
