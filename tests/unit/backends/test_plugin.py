"""Fast unit tests of the plugin adapter, the output check and the token bucket's count (issue 11). The same
behaviour through a live server and the real CLI is in tests/integration/backends/test_plugin.py."""

from __future__ import annotations

import sys
import types

import pytest

from batchserve.backends import PluginError, resolve_backend
from batchserve.backends.plugin import make_backend
from batchserve.backends.sim import SimBackend
from batchserve.config import ModelSpec, Settings, default_model_name
from batchserve.gpu_pool import check_outputs
from batchserve.http.guards import TokenBucket


@pytest.fixture
def module(monkeypatch: pytest.MonkeyPatch):
    """A throwaway module `unitplug` the tests fill with plugin shapes."""
    mod = types.ModuleType("unitplug")
    monkeypatch.setitem(sys.modules, "unitplug", mod)
    return mod


def backend(attr: str, options: dict | None = None, **settings: object):
    return make_backend(ModelSpec("m", backend=f"unitplug:{attr}", options=options or {}), Settings(**settings))


def test_check_outputs_one_encode_for_a_good_batch_and_names_each_bad_output():
    assert check_outputs(["a", [0.5, 1.0], {"k": None}, 3, True], 5) == (None, {})
    assert check_outputs(("a",), 1)[0] == "backend returned tuple, not a list"
    assert check_outputs(["a"], 2)[0] == "backend returned 1 outputs for 2 inputs"
    problem, bad = check_outputs(["ok", {1, 2}, "fine", object(), "\ud800"], 5)
    assert problem is None and sorted(bad) == [1, 3, 4]
    assert "set is not JSON-encodable" in bad[1] and "str is not JSON-encodable" in bad[4]


def test_outputs_are_held_to_their_kind():
    from batchserve.backends import OutputRule, check_warm_answer

    nan, inf = float("nan"), float("inf")
    assert check_outputs(["a", 5, None], 3, OutputRule("text"))[1].keys() == {1, 2}
    problem, bad = check_outputs([{"a": nan}, None, {"a": None}, [1.0, [inf]], "fine"], 5, OutputRule("json"))
    assert problem is None and bad.keys() == {0, 1, 3} and "null" in bad[1]
    vectors = [
        [1.0, 2, 3],
        [1.0, 2.0],
        ["a", "b", "c"],
        [True, 1.0, 2.0],
        [nan, 1.0, 1.0],
        [1e308, 1e308, 1e308],
        "x",
        [0.5, 0.5, 0.5],
    ]
    problem, bad = check_outputs(vectors, len(vectors), OutputRule("embedding", dims=3))
    assert problem is None and bad.keys() == {1, 2, 3, 4, 6}  # 1e308 x 3: finite, though their sum is not
    rule = OutputRule("embedding")
    assert check_warm_answer([[0.1] * 4, [0.2] * 4], 2, rule) is None and rule.dims == 4
    assert "3 outputs for 2 inputs" in (check_warm_answer(["a", "b", "c"], 2, OutputRule("text")) or "")


def test_token_bucket_takes_a_count_or_nothing():
    bucket = TokenBucket(rate=1.0, burst=10.0, tokens=10.0, updated=0.0)
    assert bucket.take(0.0, 7) and bucket.tokens == 3.0
    assert not bucket.take(0.0, 4) and bucket.tokens == 3.0  # refused: nothing taken
    assert bucket.take(1.0, 4) and bucket.tokens == 0.0  # a second later, one more token


def test_a_function_gets_the_device_name_only_when_it_asks_for_it(module):
    module.plain = lambda inputs: [len(inputs)] * len(inputs)

    def named(inputs, device):
        return [device] * len(inputs)

    module.named = named
    assert backend("plain").run(0, ["a", "b"]) == [2, 2]
    b = backend("named", devices=3)
    assert b.device_names() == ["cpu:0", "cpu:1", "cpu:2"] and b.run(2, ["x"]) == ["cpu:2"]


def test_factory_class_instance_and_callable_shapes(module):
    class Model:
        output_kind = "embedding"
        max_batch_size = 4
        devices = ["gpu-a", "gpu-b"]  # a list attribute works as well as a method

        def __init__(self, scale: float = 1.0) -> None:
            self.scale = scale
            self.set_up: list[str] = []

        def setup(self, device: str) -> None:
            self.set_up.append(device)

        def warm(self, device: str) -> None:
            assert device in self.set_up

        def count_tokens(self, texts: list[str]) -> list[int]:
            return [len(t) for t in texts]

        def batch(self, inputs: list[str]) -> list[list[float]]:
            return [[self.scale * len(t)] for t in inputs]

    def make(*, scale: float = 1.0) -> Model:
        return Model(scale)

    class Call:
        def __call__(self, inputs: list[str]) -> list[str]:
            return [t + "!" for t in inputs]

    module.Model, module.make, module.instance = Model, make, Call()
    for attr in ("Model", "make"):
        b = backend(attr, {"scale": 2.0})
        b.setup(1)
        b.warm(1)
        assert b.run(1, ["abc"]) == [[6.0]] and b.device_names() == ["gpu-a", "gpu-b"]
        assert (b.output_kind, b.max_batch_size, b.count_tokens(["ab", "c"])) == ("embedding", 4, [2, 1])
    assert backend("instance").run(0, ["hi"]) == ["hi!"] and backend("instance").output_kind == "json"


def test_shape_errors_name_module_attribute_and_cause(module):
    class NoBatch:
        pass

    class BadWarm:
        def warm(self, a, b):
            pass

        def batch(self, inputs):
            return inputs

    module.NoBatch, module.BadWarm, module.fn = NoBatch, BadWarm, lambda inputs: inputs
    with pytest.raises(PluginError, match=r"module 'unitplug', attribute 'NoBatch': NoBatch has no batch"):
        backend("NoBatch")
    with pytest.raises(PluginError, match=r"warm takes \(\) or \(device\)"):
        backend("BadWarm")
    with pytest.raises(PluginError, match=r"a plain batch function takes no options, got \['x'\]"):
        backend("fn", {"x": 1})


def test_names_resolve_through_entry_points_or_module_attribute():
    assert resolve_backend("sim").target is SimBackend
    assert resolve_backend("batchserve.backends.sim:SimBackend").target is SimBackend
    with pytest.raises(PluginError, match="unknown backend"):
        resolve_backend("not-installed-anywhere")
    assert default_model_name("examples.sentiment:KeywordSentiment") == "sentiment"
    assert default_model_name("minilm") == "minilm"
    assert Settings(backend="pkg.mod:batch").models[0].id == "mod@v1"


def test_the_built_in_names_match_pyproject_and_resolve_without_installed_metadata(monkeypatch):
    import importlib.metadata
    import tomllib
    from pathlib import Path

    from batchserve import backends

    pyproject = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())
    assert backends.BUILTIN == pyproject["project"]["entry-points"][backends.ENTRY_POINT_GROUP]
    # A source tree never pip-installed (the copy the GPU check runs on) has no entry points at all.
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kwargs: [])
    assert resolve_backend("sim").target is SimBackend
    assert backends.installed_names() == ["hf", "minilm", "sim", "smollm2"]
    with pytest.raises(PluginError, match="unknown backend"):
        resolve_backend("not-installed-anywhere")


def test_a_warm_up_that_times_its_batches_by_size_gives_the_batch_time_not_the_round(module):
    # smollm2 on a GPU captures graphs, then times a batch of each bucket in one warm-up round: the round takes
    # far longer than any batch, and deadlines derived from it were ~20x too long on an H100.
    import time as _time

    from batchserve.backends.loading import load_models

    class Timed:
        def batch(self, inputs: list[str]) -> list[str]:
            return inputs

        def warm(self) -> dict[int, float]:
            _time.sleep(0.3)  # a round that captures, then times each size
            return {1: 0.01, 8: 0.05}

    module.Timed = Timed
    settings = Settings(backend="unitplug:Timed")
    loaded = load_models(settings)
    model = settings.models[0].id
    assert loaded.batch_s[model] == pytest.approx(0.05)
    assert loaded.batch_s_by_size[model] == {1: 0.01, 8: 0.05}
