"""What can be checked of the Docker image without a Docker engine (issue 9 §2), and the test venv's own health.

The image once pinned torch 2.5.1 while transformers 5.x needs 2.6: transformers disabled PyTorch with a warning,
the model never loaded, and a HEALTHCHECK on /healthz called the container healthy. These tests read the
Dockerfile and .dockerignore as Docker would and hold them to the installed packages' requirements.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import posixpath
import re
import shlex
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def all_of(name: str) -> list[str]:
    return [args for word, args in instructions() if word == name]


def assignments(name: str) -> dict[str, str]:
    """KEY=value pairs of every ENV (or ARG) instruction."""
    pairs: dict[str, str] = {}
    for args in all_of(name):
        for token in shlex.split(args):
            key, _, value = token.partition("=")
            pairs[key] = value
    return pairs


def torch_pin() -> Version:
    pinned = re.findall(r"torch==([^\s\"']+)", " ".join(all_of("RUN")))
    assert pinned, "the Dockerfile installs no pinned torch"
    version = pinned[0].replace("${TORCH_VERSION}", assignments("ARG").get("TORCH_VERSION", ""))
    return Version(version)


def pyproject_torch() -> SpecifierSet:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["optional-dependencies"]["model"]]
    return next(r.specifier for r in reqs if r.name == "torch")


def torch_requirements() -> list[tuple[str, SpecifierSet]]:
    """Every installed distribution's requirement on torch, under any of its extras (ours come from
    pyproject.toml, not from the possibly stale installed metadata)."""
    found = []
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name.lower() == "batchserve":
            continue
        extras = [""] + (dist.metadata.get_all("Provides-Extra") or [])
        for raw in dist.requires or []:
            req = Requirement(raw)
            if req.name == "torch" and (req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras)):
                found.append((name, req.specifier))
    return found


def test_the_image_torch_satisfies_every_requirement_and_is_what_ci_tests() -> None:
    pin = torch_pin()
    assert pyproject_torch().contains(pin), (pin, pyproject_torch())
    requirements = torch_requirements()
    assert any(name == "transformers" for name, _ in requirements), requirements
    unmet = [(name, str(spec)) for name, spec in requirements if not spec.contains(pin)]
    assert not unmet, f"torch {pin} does not satisfy {unmet}"
    installed = Version(importlib.metadata.version("torch"))
    assert installed.public == pin.public, "CI must test the torch the image runs"


def test_no_torch_our_range_admits_is_one_transformers_disables() -> None:
    floors = [Version(s.version) for s in pyproject_torch() if s.operator in (">=", ">")]
    assert floors, "pyproject's torch range needs a floor"
    unmet = [(name, str(spec)) for name, spec in torch_requirements() if not spec.contains(min(floors))]
    assert not unmet, f"pyproject admits torch {min(floors)}, which does not satisfy {unmet}"


def test_the_jobs_database_lives_in_a_volume_the_service_user_owns() -> None:
    env = assignments("ENV")
    db = env.get("BATCHSERVE_JOBS_DB", "")
    volumes = [v for args in all_of("VOLUME") for v in (shlex.split(args.strip("[]").replace(",", " ")))]
    home = next((v for v in volumes if posixpath.commonpath([v, db]) == v), None) if db.startswith("/") else None
    assert home, f"BATCHSERVE_JOBS_DB={db!r} is not under a VOLUME ({volumes})"
    users = all_of("USER")
    assert users and users[-1] != "root", "the image must not serve as root"
    chowned = [args for args in all_of("RUN") if re.search(rf"chown\s+(-R\s+)?{users[-1]}(:\S+)?\s+{home}\b", args)]
    assert chowned, f"nothing gives {home} to {users[-1]}"
    # Declared after the chown, the volume keeps its ownership (Docker copies it into a new volume); a change
    # made after VOLUME would be thrown away.
    order = [word for word, _ in instructions()]
    last_chown = max(i for i, (word, args) in enumerate(instructions()) if word == "RUN" and args in chowned)
    assert last_chown < order.index("VOLUME")


def test_the_healthcheck_probes_readiness() -> None:
    checks = all_of("HEALTHCHECK")
    assert len(checks) == 1 and "/readyz" in checks[0] and "/healthz" not in checks[0], checks
    start = re.search(r"--start-period=(\d+)s", checks[0])
    assert start and int(start.group(1)) >= 60, "the start period must cover loading and warming the model"


def dockerignore() -> list[tuple[bool, str]]:
    rules = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            rules.append((line.startswith("!"), line.lstrip("!").rstrip("/")))
    return rules


def ignored(path: str) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parent directories decides."""
    parts = path.split("/")
    verdict = False
    for negated, pattern in dockerignore():
        if any(fnmatch.fnmatchcase("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1)):
            verdict = not negated
    return verdict


@pytest.mark.parametrize(
    "path",
    [
        ".venv/lib/python3.11/site-packages/torch/__init__.py",
        ".git/HEAD",
        "bench/results/standard.json",
        "batchserve/__pycache__/app.cpython-311.pyc",
        "batchserve-jobs.db",
        "tests/test_api.py",
        ".pytest_cache/README.md",
    ],
)
def test_dockerignore_keeps_out(path: str) -> None:
    assert ignored(path)


def test_dockerignore_keeps_what_the_build_copies() -> None:
    sources = [src for args in all_of("COPY") for src in shlex.split(args)[:-1]]
    assert sources
    for src in sources:
        for path in (
            [str(p.relative_to(ROOT)) for p in (ROOT / src).rglob("*.py") if "__pycache__" not in p.parts]
            if (ROOT / src).is_dir()
            else [src]
        ):
            assert not ignored(path), path
