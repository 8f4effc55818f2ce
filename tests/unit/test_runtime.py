"""Each wing reads the server through a Protocol of its own (issue 23), never `Runtime`: this checks, in
process, that the runtime has every member each of them declares, so a renamed runtime attribute fails here
rather than on a request."""

from __future__ import annotations

import typing

import pytest

from batchserve.config import Settings
from batchserve.http.model_choice import EncoderHost
from batchserve.generation.serving import GenerationHost
from batchserve.http.endpoint import Served
from batchserve.ops.routes import OpsHost
from batchserve.inference.routes import InferenceHost
from batchserve.jobs.routes import JobsHost
from batchserve.kserve.routes import KServeHost
from batchserve.runtime import Runtime

HOSTS = (InferenceHost, OpsHost, EncoderHost, KServeHost, GenerationHost, JobsHost, Served)


def members(protocol: type) -> set[str]:
    """What a Protocol declares: its annotated attributes and its methods and properties."""
    declared = set(typing.get_type_hints(protocol))
    declared |= {
        name
        for name, value in vars(protocol).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }
    return declared


@pytest.fixture(scope="module")
def runtime() -> Runtime:
    return Runtime.create(Settings(devices=1))


@pytest.mark.parametrize("host", HOSTS, ids=lambda h: h.__name__)
def test_the_runtime_is_every_wings_host(host: type, runtime: Runtime):
    wanted = members(host)
    assert wanted, f"{host.__name__} declares nothing: the check reads nothing"
    missing = sorted(name for name in wanted if not hasattr(runtime, name))
    assert not missing, f"Runtime lacks {missing} that {host.__name__} declares"


def test_the_check_sees_a_missing_member():
    class Wants(typing.Protocol):
        settings: Settings

        def not_on_the_runtime(self) -> None: ...

    assert members(Wants) == {"settings", "not_on_the_runtime"}
    assert not hasattr(Runtime.create(Settings(devices=1)), "not_on_the_runtime")
