"""CLI mistakes print the one line that matters (and a hint), never the ~60-flag usage; the usage is for -h.
Real processes: `python -m batchserve ...`, as a user types it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

WITHOUT = (
    "import importlib.util as u, sys\n"
    "real = u.find_spec\n"
    "u.find_spec = lambda name, *a, **k: None if name == {missing!r} else real(name, *a, **k)\n"
    "from batchserve.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def run(*args: str, env: dict[str, str] | None = None, code: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "batchserve", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


@pytest.mark.parametrize(
    "args,env,fragment",
    [
        (["serve", "--slo-ms", "-5"], {}, "--slo-ms"),
        (["serve"], {"BATCHSERVE_SLO_MS": "fast"}, "BATCHSERVE_SLO_MS"),
        (["serve", "--backend", "smolm2"], {}, "did you mean 'smollm2'"),
        (["serve", "--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
        (["serve", "--decode", "fast"], {}, "invalid choice: 'fast'"),
    ],
    ids=["flag", "env", "backend", "unknown-flag", "choice"],
)
def test_a_mistake_is_one_line_without_the_usage(args: list[str], env: dict[str, str], fragment: str):
    done = run(*args, env=env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("batchserve serve: error:"), done.stderr
    assert fragment in lines[0] and "usage:" not in done.stderr


def test_an_argparse_mistake_points_at_help():
    done = run("serve", "--no-such-flag")
    assert "(see 'batchserve serve -h')" in done.stderr


def test_help_still_shows_the_usage():
    done = run("serve", "-h")
    assert done.returncode == 0 and done.stdout.startswith("usage: batchserve serve")


@pytest.mark.parametrize("backend", ["smollm2", "minilm"])
def test_a_model_backend_without_torch_says_what_to_install(backend: str):
    done = run("serve", "--backend", backend, code=WITHOUT.format(missing="torch"))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"backend {backend!r} needs torch" in lines[0] and "pip install 'batchserve[model]'" in lines[0]


def test_a_postgresql_job_store_without_psycopg_says_what_to_install():
    done = run("serve", "--jobs-db", "postgresql://u@db/jobs", code=WITHOUT.format(missing="psycopg"))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("batchserve serve: error: --jobs-db: a postgresql://"), lines
    assert "pip install 'batchserve[postgres]'" in lines[0]


@pytest.mark.parametrize(
    "args,hint",
    [
        (["serve", "--max-batch-sise", "10"], "(did you mean '--max-batch-size'?)"),
        (["plan", "--rate", "1", "--batchms", "3"], "(did you mean '--batch-ms'?)"),
        (["infer", "--urll", "http://x"], "(did you mean '--url'?)"),
    ],
    ids=["serve", "plan", "infer"],
)
def test_a_mistyped_flag_gets_a_did_you_mean(args: list[str], hint: str):
    done = run(*args)
    assert done.returncode == 2 and hint in done.stderr, done.stderr
    assert done.stderr.startswith(f"batchserve {args[0]}: error: unrecognized arguments:"), done.stderr


def test_plan_help_shows_its_defaults_and_what_is_required():
    done = run("plan", "-h")
    text = " ".join(done.stdout.split())  # argparse wraps to the terminal's width
    assert done.returncode == 0
    assert "target requests/s across the service (required)" in text
    assert "p95 latency objective [200, or with --measure the server's]" in text and "(default: 5.0)" in text
    assert "exactly one of --batch-ms, --batch-ms-by-size or --measure URL" in text
