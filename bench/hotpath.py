"""CPU per request of the inference route's own code, in-process, without sockets (issue 10 §6).

Why: on a shared 2-core machine wall-clock latency swings with whatever else runs, but the CPU time the
process spends per request moves little. This drives the ASGI apps directly (scope / receive / send, as
uvicorn calls them, with uvicorn's per-request `disconnected` flag) with the same concurrency and body shape as
the load bench, and reports process CPU per request for batchserve (sim backend, 100 ms batches of at most 100, with
`--concurrency` 150 in flight as at 900 requests/s: ~0.16 s each x 900/s, so a batch runs while the next one queues)
beside the bare Starlette endpoint of `bench/bare_app.py` and the minimal batcher of
`bench/minimal_batcher.py` (a future per request and one task taking the waiting inputs: the least any batcher
on this stack pays for holding a request across a batch). The sockets and HTTP parsing (uvicorn +
httptools) are left out: they cost both apps the same. `--profile` writes a pyinstrument report of the
batchserve run. The ratio here is the route's overhead alone; the end-to-end ratio is `bench/cpu_compare.py`'s.

    python -m bench.hotpath                 # ~20 s: table of CPU µs per request
    python -m bench.hotpath --profile /tmp/hotpath.html
    python -m bench.hotpath --record        # the table and a text profile into bench/results/hotpath-<time>.*
    python -m bench.hotpath --floor         # also the bare endpoint and the minimal batcher as plain ASGI apps
                                            # (bench/raw_apps.py): the floor without Starlette's machinery
    python -m bench.hotpath --base /work/wt/base   # A/B: batchserve of this checkout and of another one

`--base DIR`: before/after in one run. Each checkout's batchserve runs in a process of its own (both import the
package by the same name), beside the minimal batcher and the bare endpoint in that process; the two processes
take turns app by app (the order alternating each round) while the other waits idle, and each batchserve is
quoted against its own process's minimal batcher, round by round, and against the other batchserve. The bench
harness is this checkout's in both: only the package under test differs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from typing import Any
from collections.abc import Awaitable, Callable

import orjson

BATCH_MS = 100.0  # the seed contract's batch time (batches of at most 100: the sim default)
ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


class Cycle:
    """Stands in for uvicorn's RequestResponseCycle: the body once, then a receive that waits, and the
    `disconnected` flag batchserve reads instead of watching receive()."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.disconnected = False
        self.sent = False
        self.status = 0

    async def receive(self) -> dict:
        if not self.sent:
            self.sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]


def scope_for(body: bytes) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/inference",
        "raw_path": b"/v1/inference",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"user-agent", b"bench"),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }


async def one(app: ASGIApp, i: int) -> int:
    body = orjson.dumps({"input": f"hotpath input number {i:08d}"})
    cycle = Cycle(body)
    await app(scope_for(body), cycle.receive, cycle.send)
    return cycle.status


async def drive(app: ASGIApp, total: int, concurrency: int) -> tuple[float, float, int]:
    """Send `total` requests, `concurrency` in flight; (CPU seconds, wall seconds, non-200 answers)."""
    # `concurrency` senders, each taking the next request number as it finishes one, and running each request
    # in a task of its own as uvicorn does. No semaphore: one with thousands of waiters cost the harness itself
    # ~5 µs a request on the batched app only (CPython 3.11's `_wake_up_next` scans past the waiters already
    # woken, ~50 per release when a batch answers 100 at once), and that was counted as the route's.
    bad = 0
    numbers = iter(range(total))
    loop = asyncio.get_running_loop()

    async def sender() -> None:
        nonlocal bad
        for i in numbers:
            if await loop.create_task(one(app, i)) != 200:
                bad += 1

    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(sender() for _ in range(concurrency)))
    return time.process_time() - cpu0, time.perf_counter() - wall0, bad


@contextlib.asynccontextmanager
async def running(app: Any) -> Any:
    starlette = getattr(app, "app", app)  # batchserve's FastPath wraps its Starlette app
    if not hasattr(starlette, "router"):  # a plain ASGI app of bench/raw_apps.py: no lifespan
        yield app
        stop = getattr(app, "stop", None)
        if stop is not None:
            stop()
        return
    async with starlette.router.lifespan_context(starlette):
        yield app


async def batchserve_app() -> Any:
    from batchserve.app import create_app
    from batchserve.config import Settings

    # A job store of its own: `--base` runs two of these at once, and the default ./batchserve-jobs.db is locked
    # by the first (the second then ran without jobs and logged that it could not open the store).
    jobs_db = os.path.join(tempfile.mkdtemp(prefix="hotpath-"), "jobs.db")
    settings = Settings(sim_batch_ms=BATCH_MS, slo_ms=5000, timeout_ms=30000, max_queue=100000, jobs_db=jobs_db)
    return create_app(settings)


async def prepare(make: Callable[[], Awaitable[Any]], stack: contextlib.AsyncExitStack) -> Any:
    app = await make()
    await stack.enter_async_context(running(app))
    rt = getattr(getattr(app, "state", None), "rt", None)
    while rt is not None and not rt.ready:
        await asyncio.sleep(0.01)
    return app


async def the_three_apps(stack: contextlib.AsyncExitStack) -> dict[str, Any]:
    """Bare Starlette, the minimal batcher and batchserve, started (and stopped with `stack`)."""
    from bench import bare_app, minimal_batcher

    async def bare() -> Any:
        return bare_app.create_app()

    async def minimal() -> Any:
        return minimal_batcher.create_app()

    return {
        "bare Starlette": await prepare(bare, stack),
        "minimal batcher": await prepare(minimal, stack),
        "batchserve": await prepare(batchserve_app, stack),
    }


async def main_async(a: argparse.Namespace) -> None:
    import os

    load_start = round(os.getloadavg()[0], 2)

    async with contextlib.AsyncExitStack() as stack:
        apps = await the_three_apps(stack)
        if a.floor:
            from bench import raw_apps

            async def bare_asgi() -> Any:
                return raw_apps.BareAsgi()

            async def minimal_asgi() -> Any:
                return raw_apps.MinimalAsgi()

            apps["bare ASGI"] = await prepare(bare_asgi, stack)
            apps["minimal batcher, ASGI"] = await prepare(minimal_asgi, stack)
        if not a.default_gc:
            # As `batchserve serve` runs (http/server.py): start-up frozen, young collections every 50,000
            # allocations. With CPython's default 700, a hundred requests held across a batch keep their objects
            # in the young generation's scans: ~25 µs a request of collector time for any batcher in-process
            # (the minimal one too), none for the bare app, whose requests end before a collection comes.
            from batchserve.gc_tuning import tune_gc

            tune_gc()
        for app in apps.values():
            await drive(app, min(a.requests, 2000), a.concurrency)  # warm-up
        runs: dict[str, list[float]] = {name: [] for name in apps}
        bad = dict.fromkeys(apps, 0)
        profiler = None
        for _ in range(a.repeats):  # interleaved, so a busy moment of the machine hits both alike
            for name, app in apps.items():
                cpu, _, non_200 = await drive(app, a.requests, a.concurrency)
                runs[name].append(cpu / a.requests * 1e6)
                bad[name] += non_200
        if a.profile:  # one more batchserve run, profiled, apart from the measured ones (the sampler costs CPU)
            from pyinstrument import Profiler

            profiler = Profiler(interval=0.0002, async_mode="disabled")
            profiler.start()
            await drive(apps["batchserve"], a.requests, a.concurrency)
            profiler.stop()
    profile_text = ""
    if profiler is not None:
        profile_text = profiler.output_text(unicode=True, show_all=False)
        if a.profile != "-":
            with open(a.profile, "w") as fh:
                fh.write(profiler.output_html() if a.profile.endswith(".html") else profile_text)
    base = statistics.median(runs["bare Starlette"])
    minimal_med = statistics.median(runs["minimal batcher"])
    lines = [
        f"| app | CPU µs/req (median of {a.repeats}) | ratio | ÷ minimal batcher | runs |",
        "|---|---|---|---|---|",
    ]
    for name, values in runs.items():
        med = statistics.median(values)
        lines.append(
            f"| {name} | {med:.1f} | {med / base:.2f} | {med / minimal_med:.2f} | "
            f"{[round(v, 1) for v in values]}" + (f" (non-200: {bad[name]})" if bad[name] else "") + " |"
        )
    md = "\n".join(
        [
            "# CPU per request of the inference route, in-process (bench/hotpath.py)",
            "",
            f"{a.requests} requests per run, {a.concurrency} in flight, sim batches of {BATCH_MS:g} ms; "
            "runs interleaved; process CPU time (the worker thread included); "
            f"{'default' if a.default_gc else 'the server'}'s GC settings; load average {load_start} at "
            "the start.",
            "",
            *lines,
        ]
    )
    if profile_text:
        md += "\n\n## Profile of the batchserve runs (pyinstrument)\n\n```\n" + profile_text + "\n```"
    print(md)
    from bench import common, report

    rep = {
        "provenance": report.provenance(),
        "settings": vars(a),
        "runs_us": runs,
        "non_200": bad,
        "loadavg_start": load_start,
    }
    print(report.written(report.write(common.run_name(a, "hotpath"), rep, md, common.out_dir(a))))


async def serve_runs(a: argparse.Namespace) -> None:
    """`--child`: prepare the apps, warm them, then run the one named on each stdin line and answer a JSON line
    (CPU µs per request, non-200 answers); the parent of `--base` drives two of these."""
    import sys

    import batchserve

    async with contextlib.AsyncExitStack() as stack:
        apps = await the_three_apps(stack)
        if not a.default_gc:
            from batchserve.gc_tuning import tune_gc

            tune_gc()
        for app in apps.values():
            await drive(app, min(a.requests, 2000), a.concurrency)
        print(orjson.dumps({"ready": True, "package": batchserve.__file__}).decode(), flush=True)
        loop = asyncio.get_running_loop()
        while line := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
            cpu, _, bad = await drive(apps[line], a.requests, a.concurrency)
            print(orjson.dumps({"cpu_us": cpu / a.requests * 1e6, "bad": bad}).decode(), flush=True)


def ab_main(a: argparse.Namespace) -> None:
    """`--base DIR`: this checkout's batchserve against DIR's, in two child processes taking turns (module
    docstring)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from bench import common, report

    here = Path(__file__).resolve().parent.parent
    trees = {"this checkout": here, "base": Path(a.base).resolve()}
    load_start = round(os.getloadavg()[0], 2)
    children: dict[str, subprocess.Popen] = {}
    packages: dict[str, str] = {}
    try:
        for label, tree in trees.items():
            # The harness (bench/) from this checkout, the package from `tree`: `--child` puts `tree` first on
            # the path before anything imports batchserve.
            cmd = [
                sys.executable,
                "-m",
                "bench.hotpath",
                "--child",
                str(tree),
                "--requests",
                str(a.requests),
                "--concurrency",
                str(a.concurrency),
            ] + (["--default-gc"] if a.default_gc else [])
            env = {**os.environ, "PYTHONPATH": str(here)}
            children[label] = subprocess.Popen(
                cmd, cwd=here, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            ready = orjson.loads(children[label].stdout.readline())  # type: ignore[union-attr]
            packages[label] = ready["package"]
        names = ("bare Starlette", "minimal batcher", "batchserve")
        runs: dict[str, dict[str, list[float]]] = {t: {n: [] for n in names} for t in trees}
        bad = {t: 0 for t in trees}
        for r in range(a.repeats):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in names:
                for label in order:
                    child = children[label]
                    child.stdin.write(name + "\n")  # type: ignore[union-attr]
                    child.stdin.flush()  # type: ignore[union-attr]
                    got = orjson.loads(child.stdout.readline())  # type: ignore[union-attr]
                    runs[label][name].append(got["cpu_us"])
                    bad[label] += got["bad"]
    finally:
        for child in children.values():
            if child.stdin is not None:
                child.stdin.close()
        for child in children.values():
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
    med = statistics.median
    head, base = runs["this checkout"], runs["base"]
    per_round = {t: [b / m for b, m in zip(runs[t]["batchserve"], runs[t]["minimal batcher"])] for t in trees}
    head_over_base = [h / b for h, b in zip(head["batchserve"], base["batchserve"])]
    commits = {
        t: subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=trees[t], capture_output=True, text=True, check=False
        ).stdout.strip()
        for t in trees
    }
    lines = [
        "| checkout | package | batchserve CPU µs/req | minimal batcher | bare Starlette | batchserve ÷ minimal "
        "(median of the rounds' ratios) | rounds (÷ minimal) |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in trees:
        lines.append(
            f"| {t} ({commits[t]}) | `{packages[t]}` | {med(runs[t]['batchserve']):.1f} | "
            f"{med(runs[t]['minimal batcher']):.1f} "
            f"| {med(runs[t]['bare Starlette']):.1f} | {med(per_round[t]):.2f} "
            f"| {[round(v, 2) for v in per_round[t]]}" + (f" (non-200: {bad[t]})" if bad[t] else "") + " |"
        )
    md = "\n".join(
        [
            "# CPU per request of the inference route, in-process, this checkout vs a base (bench/hotpath.py --base)",
            "",
            f"{a.requests} requests per run, {a.concurrency} in flight, sim batches of "
            f"{BATCH_MS:g} ms; {a.repeats} rounds, the two checkouts' processes taking turns app by app; "
            f"{'default' if a.default_gc else 'the server'}'s GC settings; load average {load_start} at the "
            "start.",
            "",
            *lines,
            "",
            f"- batchserve, this checkout ÷ base: **{med(head_over_base):.2f}** (rounds: "
            f"{[round(v, 2) for v in head_over_base]})",
            f"- batchserve ÷ minimal batcher: this checkout **{med(per_round['this checkout']):.2f}**, base "
            f"**{med(per_round['base']):.2f}** (goal of issue 35: ≤ 1.25)",
        ]
    )
    print(md)
    rep = {
        "provenance": report.provenance(),
        "settings": vars(a),
        "runs_us": runs,
        "non_200": bad,
        "packages": packages,
        "commits": commits,
        "ratio_to_minimal": per_round,
        "head_over_base": head_over_base,
        "loadavg_start": load_start,
    }
    print(report.written(report.write(common.run_name(a, "hotpath"), rep, md, common.out_dir(a))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=3000, help="requests per run")
    p.add_argument(
        "--concurrency",
        type=int,
        default=150,
        help="requests in flight at once (default %(default)s: "
        "900 requests/s x ~0.16 s; at 100 every request arrived while the worker was between batches)",
    )
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument(
        "--floor",
        action="store_true",
        help="also run the bare endpoint and the minimal batcher as "
        "plain ASGI apps (bench/raw_apps.py), as batchserve's route is: the floor under its hot path",
    )
    p.add_argument(
        "--default-gc",
        action="store_true",
        help="keep CPython's collector thresholds (700) instead of the server's (`batchserve.gc_tuning.tune_gc`)",
    )
    p.add_argument(
        "--profile",
        default="",
        help="profile the batchserve runs with pyinstrument: write it here "
        "(.html, else text; '-' only into the report)",
    )
    p.add_argument(
        "--base",
        default="",
        help="another checkout (a git worktree of main, say): run its batchserve "
        "and this one's in turn, in a process each, and quote both (module docstring)",
    )
    p.add_argument("--child", default="", help=argparse.SUPPRESS)  # a `--base` run's process: the package's tree
    from bench import common

    common.add_output_flags(p, tag=True)
    a = p.parse_args()
    if a.base:
        ab_main(a)
        return
    import uvloop

    uvloop.install()
    if a.child:
        import sys

        assert "batchserve" not in sys.modules, "batchserve was imported before its tree was chosen"
        sys.path.insert(0, a.child)
        asyncio.run(serve_runs(a))
        return
    asyncio.run(main_async(a))


if __name__ == "__main__":
    main()
