"""`batchserve infer TEXT` and `batchserve jobs submit|get|results|cancel`: the client (`batchserve.client`)
from a shell, with its retries, and a progress bar on a terminal while `jobs submit --wait` watches a job."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:  # imported when a command runs: `batchserve serve` need not load httpx
    from batchserve.client import Client

DEFAULT_URL = "http://127.0.0.1:8000"


def add_connection_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        default=os.environ.get("BATCHSERVE_URL", DEFAULT_URL),
        help=f"the server [env BATCHSERVE_URL; default {DEFAULT_URL}]",
    )
    p.add_argument(
        "--api-key", default=os.environ.get("BATCHSERVE_API_KEY"), help="bearer key [env BATCHSERVE_API_KEY]"
    )
    p.add_argument(
        "--deadline-s",
        type=float,
        default=60.0,
        help="keep retrying 503/429 answers (as long as the server's retry_after_ms) this long",
    )


def add_infer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("text", help="the input")
    p.add_argument("--model", default=None, help="name or name@version (default: the server's first)")
    p.add_argument("--timeout-ms", type=int, default=None, help="the request's deadline on the server")
    p.add_argument("--json", action="store_true", help="print the whole answer as JSON, not only the output")
    add_connection_arguments(p)


def add_jobs_arguments(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = p.add_subparsers(dest="jobs_command", metavar="{submit,get,results,cancel}")
    submit = sub.add_parser("submit", help="submit a file of inputs as a batch job")
    submit.add_argument(
        "file", help="one input per line (blank lines skipped), a JSON array of strings (.json), or - for stdin"
    )
    submit.add_argument("--model", default=None)
    submit.add_argument(
        "--wait",
        action="store_true",
        help="watch the job to its end (a progress bar on a terminal), then print its results",
    )
    submit.add_argument("--poll-s", type=float, default=0.5, help="with --wait: how often to ask")
    submit.add_argument("--idempotency-key", default=None, help="a resubmit with this key returns the same job")
    add_connection_arguments(submit)
    parsers = {"submit": submit}
    for name, what in (
        ("get", "the job's status and counts"),
        ("results", "the results, NDJSON in input order"),
        ("cancel", "cancel the job's pending items"),
    ):
        one = sub.add_parser(name, help=what)
        one.add_argument("job_id")
        add_connection_arguments(one)
        parsers[name] = one
    return parsers


def read_inputs(path: str, stdin: TextIO = sys.stdin) -> list[str]:
    text = stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    if path.endswith(".json"):
        inputs = json.loads(text)
        if not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs):
            raise ValueError(f"{path}: expected a JSON array of strings")
        return inputs
    return [line for line in text.splitlines() if line.strip()]


class NoProgress:
    def update(self, job: dict) -> None:
        pass

    def close(self) -> None:
        pass


class LineProgress:
    """One line, redrawn in place: `batch_x: running 40/100 (2 failed)`."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def update(self, job: dict) -> None:
        done = job["completed"] + job["failed"] + job["cancelled"]
        failed = f" ({job['failed']} failed)" if job["failed"] else ""
        self.stream.write(f"\r{job['id']}: {job['status']} {done}/{job['total']}{failed}")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


class TqdmProgress:
    def __init__(self, stream: TextIO) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=None, unit="item", file=stream, dynamic_ncols=True)

    def update(self, job: dict) -> None:
        self.bar.total = job["total"]
        self.bar.n = job["completed"] + job["failed"] + job["cancelled"]
        self.bar.set_description(f"{job['id']} {job['status']}")
        self.bar.set_postfix(failed=job["failed"], refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def progress_for(stream: TextIO, use_tqdm: bool | None = None) -> NoProgress | LineProgress | TqdmProgress:
    """A bar on a terminal (tqdm if installed), nothing in a pipe or a log file."""
    if not stream.isatty():
        return NoProgress()
    if use_tqdm is None:
        import importlib.util

        use_tqdm = importlib.util.find_spec("tqdm") is not None
    return TqdmProgress(stream) if use_tqdm else LineProgress(stream)


def client_of(args: argparse.Namespace) -> Client:
    from batchserve.client import Client, Retry

    return Client(args.url, api_key=args.api_key, retry=Retry(deadline_s=args.deadline_s))


def print_results(results: list[dict]) -> None:
    for item in results:
        print(json.dumps(item))


def infer_main(args: argparse.Namespace) -> int:
    with client_of(args) as bs:
        answer = bs.infer(args.text, model=args.model, timeout_ms=args.timeout_ms)
    output = json.dumps(answer) if args.json else answer["output"]
    print(output if isinstance(output, str) else json.dumps(output))
    return 0


def jobs_main(args: argparse.Namespace) -> int:
    """0 when the job completed (items may still have failed: see each result), 1 when it failed or was
    cancelled; without --wait, 0 once it is stored (its JSON on stdout)."""
    with client_of(args) as bs:
        if args.jobs_command == "submit":
            job = bs.submit_job(read_inputs(args.file), model=args.model, idempotency_key=args.idempotency_key)
            if not args.wait:
                print(json.dumps(job))
                return 0
            progress = progress_for(sys.stderr)
            try:
                job = bs.wait_job(job["id"], poll_s=args.poll_s, on_progress=progress.update)
            finally:
                progress.close()
            print_results(bs.job_results(job["id"]))
            return 0 if job["status"] == "completed" else 1
        if args.jobs_command == "results":
            print_results(bs.job_results(args.job_id))
            return 0
        job = bs.get_job(args.job_id) if args.jobs_command == "get" else bs.cancel_job(args.job_id)
        print(json.dumps(job))
        return 0


def run(prog: str, args: argparse.Namespace) -> int:
    """The command, with the server's refusal (or an unreachable server) as one line and status 1."""
    import httpx

    from batchserve.client import BatchserveError

    try:
        return infer_main(args) if args.command == "infer" else jobs_main(args)
    except (BatchserveError, httpx.HTTPError, OSError, ValueError) as exc:  # OSError, ValueError: the inputs file
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, BatchserveError | httpx.HTTPError) else 2
