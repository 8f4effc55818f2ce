"""The flags and the run guard every bench script shares.

Why a module: the same flag (client timeout, sim batch time, seed, where results go, ...) was written out in up
to nine scripts, and copies drift apart. A script passes its own default where it differs, or None to leave a
flag out. And a bench that leaves a server behind poisons the next run, so every script guards its run alike.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from bench import servers

RESULTS = Path(__file__).resolve().parent / "results"


def add_load_flags(
    p: argparse.ArgumentParser,
    *,
    duration: float | None = 20.0,
    warmup: float | None = 5.0,
    seed: int | None = 1,
    timeout: float | None = 10.0,
    procs: bool = False,
    connections: bool = False,
) -> None:
    """The load window and the client: --duration, --warmup, --seed, --timeout (None leaves one out), and
    --procs / --connections when asked."""
    if duration is not None:
        p.add_argument(
            "--duration", type=float, default=duration, help="seconds of measured load (per row; default %(default)g)"
        )
    if warmup is not None:
        p.add_argument(
            "--warmup",
            type=float,
            default=warmup,
            help="load before each measured window, not counted, s (default %(default)g)",
        )
    if seed is not None:
        p.add_argument(
            "--seed", type=int, default=seed, help="seed of the arrivals: a rerun replays them (default %(default)s)"
        )
    if timeout is not None:
        p.add_argument("--timeout", type=float, default=timeout, help="client timeout per request, s")
    if procs:
        p.add_argument("--procs", type=int, default=1, help="client processes sharing the schedule (default 1)")
    if connections:
        p.add_argument("--connections", type=int, default=4096, help="connection limit per client process")


def add_sim_flags(
    p: argparse.ArgumentParser,
    *,
    devices: int | None = None,
    max_batch_size: int | None = 100,
    slo_ms: float | None = 200.0,
    deadlines: bool = False,
    server_arg: bool = True,
) -> None:
    """The sim server's flags: --sim-batch-ms, and (None / False leaves one out) --devices, --max-batch-size,
    --slo-ms, --margin-ms with --request-timeout-ms (`deadlines`), --server-arg."""
    if devices is not None:
        p.add_argument("--devices", type=int, default=devices)
    p.add_argument("--sim-batch-ms", type=float, default=100.0)
    if max_batch_size is not None:
        p.add_argument("--max-batch-size", type=int, default=max_batch_size)
    if slo_ms is not None:
        p.add_argument("--slo-ms", type=float, default=slo_ms, help="the server's --slo-ms (default %(default)g)")
    if deadlines:
        p.add_argument("--margin-ms", type=float, default=5.0, help="the server's --dispatch-margin-ms")
        p.add_argument(
            "--request-timeout-ms",
            type=float,
            default=2000.0,
            help="the server's --timeout-ms, the request deadline (default %(default)g)",
        )
    if server_arg:
        p.add_argument(
            "--server-arg",
            action="append",
            default=[],
            help="extra argument for `batchserve serve` (repeatable, e.g. --server-arg=--log-level=warning)",
        )


def sim_server_flags(a: argparse.Namespace) -> list[str]:
    """--slo-ms, --dispatch-margin-ms and --timeout-ms for the server, those of them the script has."""
    flags = {"slo_ms": "--slo-ms", "margin_ms": "--dispatch-margin-ms", "request_timeout_ms": "--timeout-ms"}
    return [f"{flag}={getattr(a, k):g}" for k, flag in flags.items() if hasattr(a, k)]


def add_output_flags(p: argparse.ArgumentParser, *, name: str | None = None, tag: bool = False) -> None:
    """--record / --out DIR: the only ways a bench writes its results (default: print only); with `name`,
    --name (the result file's name, default <name>-<UTC time>); with `tag`, --tag (a suffix of it)."""
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--record",
        action="store_true",
        help="write the results (markdown + JSON) and the server logs to bench/results/",
    )
    where.add_argument(
        "--out",
        "--out-dir",
        dest="out_dir",
        type=Path,
        default=None,
        help="write them to this directory instead (default: print only)",
    )
    if name is not None:
        p.add_argument("--name", default="", help=f"result file name (default {name}-<UTC time>)")
    if tag:
        p.add_argument("--tag", default="", help="suffix for the result file names")


def stamp() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")


def run_name(a: argparse.Namespace, prefix: str) -> str:
    """The result files' name: --name if given, else <prefix>-<UTC time>[-<tag>]."""
    tag = getattr(a, "tag", "")
    return getattr(a, "name", "") or f"{prefix}-{stamp()}{'-' + tag if tag else ''}"


def out_dir(a: argparse.Namespace) -> Path | None:
    """Where the results go, or None: print only."""
    return RESULTS if a.record else a.out_dir


def log_dir(a: argparse.Namespace, name: str) -> Path:
    """Server logs: beside the results when they are written, else in a fresh temporary directory."""
    base = out_dir(a)
    return base / "logs" / name if base is not None else Path(tempfile.mkdtemp(prefix=f"{name}-logs-"))


@contextlib.contextmanager
def guarded(
    rep: dict | None = None, catch: tuple[type[BaseException], ...] = (servers.ServerFailed,)
) -> Iterator[list[int]]:
    """Stop every server started in the block, by PID, however it ends (return, error, Ctrl-C, SIGTERM).

    Yields the list the received signals go to, so a run loop starts no new row after one. With `rep`, an
    interrupt or a `catch` error ends the block instead of the run: it is noted in `rep` ("interrupted",
    "error"), so the rows measured so far are still reported.
    """
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stopping = servers.stop_on_signals()
    try:
        yield stopping
    except KeyboardInterrupt:
        if rep is None:
            raise
        print("interrupted: stopping servers", file=sys.stderr)
        rep["interrupted"] = True
    except catch as exc:
        if rep is None:
            raise
        print(f"failed: {exc}", file=sys.stderr)
        rep["error"] = str(exc)
    finally:
        servers.stop_all()
        for s, handler in handlers.items():
            signal.signal(s, handler)
