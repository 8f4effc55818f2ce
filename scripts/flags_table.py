"""Print the markdown table of every `batchserve serve` flag, for README.md (kept in step by tests/unit/test_docs.py);
`--write` puts it in README.md in place of the table there. The flags come in their groups (`knobs.py`), each
under a row that names it, as `batchserve serve -h` shows them."""

import dataclasses
import sys
from pathlib import Path

from batchserve.config import Settings
from batchserve.config_env import env_name
from batchserve.knobs import GROUPS

HEADER = "| flag | environment | default | what it does |"


MODEL_ROW = (
    "| `--model` | `BATCHSERVE_MODEL` | (none) | serve a Hugging Face model folder, or a hub id from the "
    "local cache (offline): `[name=]PATH`, repeatable (the variable: comma-separated); its task read from "
    "the folder, --task overrides (docs/backends.md) |"
)


def table() -> str:
    defaults = Settings()
    rows = [HEADER, "| --- | --- | --- | --- |"]
    for group in GROUPS:
        title, _, what = (group.__doc__ or "").partition(": ")
        rows.append(f"| **{title.lower()}** | | | {what} |")
        for f in dataclasses.fields(group):
            value = getattr(defaults, f.name)
            shown = "(backend's name)" if f.name == "model_name" else repr(value)
            rows.append(f"| `--{f.name.replace('_', '-')}` | `{env_name(f.name)}` | `{shown}` | {f.metadata['help']} |")
            if f.name == "model_version":  # the one repeatable flag, not a Settings knob (cli.py adds it)
                rows.append(MODEL_ROW)
    return "\n".join(rows)


def write(readme: Path) -> None:
    lines = readme.read_text().splitlines()
    start = lines.index(HEADER)
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    readme.write_text("\n".join([*lines[:start], table(), *lines[end:]]) + "\n")


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        write(Path(__file__).resolve().parent.parent / "README.md")
    else:
        print(table())
