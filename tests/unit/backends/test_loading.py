"""`load_models` with a model whose batches run elsewhere (smollm2 while the generation engine's stepper answers its
`/v1/inference`): its plugin is built as its `shell` and never set up, warmed or checked, while the other models
load as before and every model keeps a backend for the door, the routes and the model cards to read."""

from __future__ import annotations

import sys
import types

import pytest

from batchserve.backends.loading import load_models
from batchserve.config import ModelSpec, Settings


class Heavy:
    """A plugin that counts what loading did to it: built in full or as a shell, set up, warmed, run."""

    calls: list[str] = []
    output_kind = "text"

    def __init__(self, shell: bool = False) -> None:
        self.calls.append("shell" if shell else "built")

    @classmethod
    def shell(cls, settings: Settings) -> Heavy:
        return cls(shell=True)

    def setup(self, device: str) -> None:
        self.calls.append("setup")

    def warm(self, device: str) -> None:
        self.calls.append("warm")

    def batch(self, inputs: list[str]) -> list[str]:
        self.calls.append("batch")
        return inputs


@pytest.fixture
def plugins(monkeypatch: pytest.MonkeyPatch) -> type[Heavy]:
    mod = types.ModuleType("loadplug")
    mod.Heavy = Heavy
    monkeypatch.setitem(sys.modules, "loadplug", mod)
    Heavy.calls = []
    return Heavy


def settings() -> Settings:
    return Settings(models=[ModelSpec("gen", backend="loadplug:Heavy"), ModelSpec("sim", backend="sim")])


def test_a_model_answered_elsewhere_is_a_shell_never_set_up_warmed_or_run(plugins: type[Heavy]) -> None:
    s = settings()
    loaded = load_models(s, elsewhere=["gen@v1"])
    assert plugins.calls == ["shell"]
    assert list(loaded.backends) == ["gen@v1", "sim@v1"]  # the models' order: the first is the default one
    assert loaded.backends["gen@v1"].output_kind == "text" and loaded.devices == ["cpu"]
    assert "gen@v1" not in loaded.batch_s and "sim@v1" in loaded.batch_s  # nothing measured of it
    assert loaded.measured == {}  # the sim declares its batch time: no deadline is derived from it


def test_without_elsewhere_the_same_model_loads_and_warms(plugins: type[Heavy]) -> None:
    loaded = load_models(settings())
    assert plugins.calls[:3] == ["built", "setup", "warm"] and "batch" in plugins.calls  # the answer check
    assert loaded.measured == {"gen@v1": loaded.batch_s["gen@v1"]}  # the sim's is declared, not measured
    assert loaded.measured["gen@v1"] > 0
