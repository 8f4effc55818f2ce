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
