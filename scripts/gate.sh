#!/usr/bin/env bash
# The lint / format / type gate on batchserve/ (issue 35): ruff's lint, ruff's format check and mypy, each with
# the settings in pyproject.toml ([tool.ruff], [tool.mypy]). Runs all three, then exits non-zero if any found
# something, so one run shows every finding. Needs the `test` extra (ruff, mypy) in the active environment.
set -uo pipefail
cd "$(dirname "$0")/.."
failed=()
ruff check batchserve || failed+=("ruff check")
ruff format --check batchserve || failed+=("ruff format --check")
mypy || failed+=("mypy")  # files = ["batchserve"] in [tool.mypy]
if ((${#failed[@]})); then
    (IFS=,; echo "gate: findings from: ${failed[*]}" >&2)
    exit 1
fi
echo "gate: ruff check, ruff format --check and mypy: no findings"
