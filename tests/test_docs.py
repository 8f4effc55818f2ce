"""The README documents every flag, as the code defines it."""

from pathlib import Path

from scripts.flags_table import table

ROOT = Path(__file__).resolve().parent.parent


def test_readme_flag_table_matches_the_code():
    readme = (ROOT / "README.md").read_text()
    generated = table().splitlines()
    missing = [row for row in generated if row not in readme]
    assert not missing, "README.md flag table is out of date; regenerate with python scripts/flags_table.py:\n" + \
        "\n".join(missing)
    stale = [row for row in readme.splitlines() if row.startswith("| `--") and row not in generated]
    assert not stale, "README.md documents flags the code does not have (or no longer describes so):\n" + \
        "\n".join(stale)


def test_readme_opens_with_the_two_setup_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text().splitlines()
    commands = [line for line in readme[:30] if line.startswith("python3 -m venv")]
    assert len(commands) == 2 and "batchserve serve --backend smollm2" in commands[0]
    assert "pytest" in commands[1]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()
