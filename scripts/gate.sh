#!/usr/bin/env bash
# The lint / format / type gate: ruff's lint and ruff's format check on every Python folder of the repository,
# mypy on the server and the benchmarks, each with the settings in pyproject.toml ([tool.ruff], [tool.mypy]).
# Runs all three, then exits non-zero if any found something, so one run shows every finding. Needs the `test`
# extra (ruff, mypy) in the active environment.
set -uo pipefail
cd "$(dirname "$0")/.."
# Folders named rather than `.`: ruff also formats the Markdown in README.md and docs/, which is not its to judge.
PY_DIRS=(batchserve tests bench scripts deploy examples)
failed=()
ruff check "${PY_DIRS[@]}" || failed+=("ruff check")
ruff format --check "${PY_DIRS[@]}" || failed+=("ruff format --check")
mypy || failed+=("mypy")  # files = ["batchserve", "bench"] in [tool.mypy]
if ((${#failed[@]})); then
    (IFS=,; echo "gate: findings from: ${failed[*]}" >&2)
    exit 1
fi
echo "gate: ruff check, ruff format --check and mypy: no findings"
