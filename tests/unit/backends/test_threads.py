"""The CPU thread defaults every torch backend reads (backends/__init__.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchserve import backends


def test_default_threads_are_every_core_this_process_may_use_split_among_processes() -> None:
    cores = len(os.sched_getaffinity(0))
    assert backends.default_threads() == cores
    assert backends.default_threads(2) == max(1, cores // 2)
    assert backends.default_threads(cores + 1) == 1
    assert backends.default_threads(decode=True) == max(1, cores - 1)  # a decoder leaves the loop a core


def test_idle_openmp_threads_sleep_unless_the_environment_says_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    backends.sleeping_idle_threads()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    backends.sleeping_idle_threads()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_serve_sets_the_wait_policy_before_it_imports_a_model(tmp_path: Path) -> None:
    """`batchserve serve` sets it before any backend module is imported: this plugin says what it saw and stops
    its own import, which the server reports as a plugin that cannot load (exit 2)."""
    (tmp_path / "probe.py").write_text(
        "import os, sys\n"
        "print('OMP_WAIT_POLICY=' + os.environ.get('OMP_WAIT_POLICY', 'unset'), flush=True)\n"
        "sys.exit(3)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    for given, seen in ((None, "PASSIVE"), ("ACTIVE", "ACTIVE")):
        run = subprocess.run(
            [sys.executable, "-m", "batchserve", "serve", "--backend", "probe:batch"],
            cwd=tmp_path,
            env={**env, **({"OMP_WAIT_POLICY": given} if given else {})},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 2, run.stderr  # the probe stopped the import: a plugin that cannot load
        assert f"OMP_WAIT_POLICY={seen}" in run.stdout
