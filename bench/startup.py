"""How a server starts, as an operator's probes see it: seconds from the process's start to the port opening
(uvicorn's "running on" line), to the first `/healthz` 200 (liveness) and to the first `/readyz` 200 (loaded
and warmed), the resident memory of the server's process tree when it turned ready, and the log's stage lines
with their times; then the seconds from SIGTERM to the process's exit (the drain with nobody connected: what
every test server's stop costs). With `--code DIR` (repeatable) the same start is
measured for another tree of the code (e.g. `git archive <commit> | tar -x -C DIR`), run before this
checkout's, so a change to the start-up order is seen on the same machine in one run.

    python -m bench.startup --backend minilm                     # a table; --record writes bench/results/
    python -m bench.startup --backend minilm --code /tmp/base    # the tree in /tmp/base, then this checkout
    python -m bench.startup --backend sim --repeat 10 --code /tmp/base   # medians of 10 starts and stops each
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # `python bench/startup.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import re
import statistics
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field

from bench import common, report, servers
from bench.procstat import tree_rss_mb

STAGE = re.compile(
    r"^(\S+ \S+) INFO batchserve\S* (converting .*|loading .*|loaded .*|set up .*|warm-up round .*|"
    r"warmed .*|deadlines .*|not loading .*|generation ready: .*|ready: .*)$"
)


@dataclass
class Start:
    code: str
    port_s: float = float("nan")  # uvicorn's "running on" line read
    healthz_s: float = float("nan")  # first GET /healthz 200
    ready_s: float = float("nan")  # first GET /readyz 200
    healthz_refused: int = 0  # /healthz tries refused before the port opened (one every poll interval)
    readyz_503: int = 0  # /readyz answered 503 (the port open, the models not ready)
    rss_mb: float = float("nan")  # resident memory of the server and its children at the first /readyz 200
    stop_s: float = float("nan")  # SIGTERM (once ready, nobody connected) to the process's exit
    stages: list[str] = field(default_factory=list)


def status(url: str) -> int:
    """The HTTP status, or 0 when the connection is refused."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except (urllib.error.URLError, OSError):
        return 0


def measure(code: str, cmd: list[str], pythonpath: str, log_path: Path, poll_s: float, timeout_s: float) -> Start:
    """One start, polled from the moment the process is spawned."""
    # cwd too: `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH
    server = servers.spawn(servers.Server(code, cmd, log_path), {"PYTHONPATH": pythonpath}, Path(pythonpath))
    assert server.proc is not None
    began = time.monotonic()
    out = Start(code)
    try:
        while time.monotonic() - began < timeout_s:
            if server.proc.poll() is not None:
                raise servers.ServerFailed(f"{code}: exited {server.proc.returncode}\n{server.log_tail()}")
            now = time.monotonic() - began
            if not server.port:
                found = servers.RUNNING.search(log_path.read_text(errors="replace"))
                if found:
                    server.port, out.port_s = int(found.group(1)), now
                else:
                    out.healthz_refused += 1
            if server.port:
                if out.healthz_s != out.healthz_s and status(server.base + "/healthz") == 200:  # NaN: not yet
                    out.healthz_s = time.monotonic() - began
                ready = status(server.base + "/readyz")
                if ready == 200:
                    out.ready_s = time.monotonic() - began
                    out.rss_mb = tree_rss_mb(server.proc.pid)
                    break
                out.readyz_503 += ready == 503
            time.sleep(poll_s)
        else:
            raise servers.ServerFailed(f"{code}: not ready within {timeout_s:g} s\n{server.log_tail()}")
    finally:
        stopping = time.monotonic()
        servers.stop(server)
        if out.ready_s == out.ready_s:  # ready (not NaN): a clean stop, timed
            out.stop_s = time.monotonic() - stopping
    out.stages = [
        " ".join(m.groups()) for line in log_path.read_text(errors="replace").splitlines() if (m := STAGE.match(line))
    ]
    return out


def markdown(rep: dict, runs: list[Start]) -> str:
    prov = rep["provenance"]
    lines = [
        f"# batchserve start-up — {prov['when_utc']}",
        "",
        f"Machine: {prov['machine']}.",
        f"Code: {prov['git']}.",
        f"Settings: {rep['settings']}.",
        "",
        report.table(
            [
                "code",
                "port open s",
                "first /healthz 200 s",
                "first /readyz 200 s",
                "RSS at ready MiB",
                "/healthz refused (polls)",
                "/readyz 503 (polls)",
                "SIGTERM to exit s",
            ],
            [
                [r.code, r.port_s, r.healthz_s, r.ready_s, r.rss_mb, r.healthz_refused, r.readyz_503, r.stop_s]
                for r in runs
            ],
        ),
    ]
    codes = list(dict.fromkeys(r.code for r in runs))
    if len(runs) > len(codes):
        lines += [
            "",
            "Medians:",
            "",
            report.table(
                ["code", "runs", "port open s", "first /readyz 200 s", "SIGTERM to exit s"],
                [
                    [
                        c,
                        len(mine := [r for r in runs if r.code == c]),
                        statistics.median(r.port_s for r in mine),
                        statistics.median(r.ready_s for r in mine),
                        statistics.median(r.stop_s for r in mine),
                    ]
                    for c in codes
                ],
            ),
        ]
    for c in codes:
        first = next(r for r in runs if r.code == c)
        lines += ["", f"Stages logged ({c}, first run):", "", "```", *first.stages, "```"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Seconds to port open, /healthz 200 and /readyz 200 of one start")
    p.add_argument("--backend", default="minilm", help="the backend to start (default %(default)s)")
    p.add_argument(
        "--code",
        action="append",
        default=[],
        metavar="DIR",
        help="another tree of the code to measure first (repeatable)",
    )
    p.add_argument("--repeat", type=int, default=1, help="starts of each tree, taken in turn (default %(default)s)")
    p.add_argument("--poll-s", type=float, default=0.05, help="probe interval (default %(default)g)")
    p.add_argument("--timeout", type=float, default=300.0, help="give up on a start after this long, s")
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for `batchserve serve`")
    common.add_output_flags(p, tag=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    name = common.run_name(a, "startup")
    logs = common.log_dir(a, name)
    logs.mkdir(parents=True, exist_ok=True)
    cmd = servers.serve_cmd(
        a.backend,
        "--jobs-db",
        "",
        "--log-level",
        "info",
        *a.server_arg,
    )
    trees = [(Path(d).name or d, str(Path(d).resolve())) for d in a.code] + [("this checkout", str(servers.REPO))]
    rep: dict = {
        "provenance": report.provenance(),
        "settings": {"backend": a.backend, "cmd": cmd[1:], "poll_s": a.poll_s, "code": a.code, "repeat": a.repeat},
    }
    runs: list[Start] = []
    with common.guarded(rep):
        for k in range(a.repeat):  # the trees in turn, so a change in the machine's load falls on each alike
            for i, (label, path) in enumerate(trees):
                print(f"-- {label}: {a.backend} ...", flush=True)
                run = measure(label, cmd, path, logs / f"{i}-{k}-{a.backend}.log", a.poll_s, a.timeout)
                print(
                    f"   port {run.port_s:.2f} s, /healthz {run.healthz_s:.2f} s, /readyz {run.ready_s:.2f} s, "
                    f"RSS {run.rss_mb:.0f} MiB, SIGTERM to exit {run.stop_s:.2f} s",
                    flush=True,
                )
                runs.append(run)
    rep["runs"] = [asdict(r) for r in runs]
    md = markdown(rep, runs)
    print()
    print(md)
    print(report.written(report.write(name, rep, md, common.out_dir(a)), logs))
    return 0 if runs and not rep.get("error") else 1


if __name__ == "__main__":
    sys.exit(main())
