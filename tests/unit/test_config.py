"""The configuration file read in process; its mistakes through the real CLI are tests/integration/test_config.py."""

from __future__ import annotations

from pathlib import Path


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bs.toml"
    path.write_text(text)
    return path


def test_a_plugin_style_backend_name_is_left_to_the_loader(tmp_path: Path) -> None:
    # `package.module:attr` names a plugin backend (issue 11): not refused as an unknown built-in.
    config = write(tmp_path, '[[models]]\nname = "p"\nbackend = "my_pkg.backends:Thing"\n')
    from batchserve.config_file import load

    assert load(str(config)).models[0].backend == "my_pkg.backends:Thing"


def test_the_settings_line_marks_unset_deadlines_provisional() -> None:
    """It showed `slo_ms=200.0 timeout_ms=2000.0`, and a later line the derived 16160 / 53865: an unset SLO and
    timeout are now marked provisional; a set one is shown as set."""
    from batchserve.cli import effective
    from batchserve.config import Settings

    line = effective(Settings())
    assert "slo_ms=200.0(provisional)" in line and "timeout_ms=2000.0(provisional)" in line
    assert "slo_ms and timeout_ms provisional" in line
    given = effective(Settings(slo_ms=300.0, given={"slo_ms": "--slo-ms"}))
    assert " slo_ms=300.0 " in given and "timeout_ms=2000.0(provisional)" in given
    assert "; timeout_ms provisional" in given
