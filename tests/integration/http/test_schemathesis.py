"""A property-based run of the API against its own `/openapi.json` (issue 35): schemathesis generates requests
from the document's declared shapes for every operation and checks each answer: no 5xx, a documented status, a
body of the documented shape. A real server (sim backend, plugins that embed, rerank and classify so those routes answer
too),
a few examples per operation, a fixed derandomized generation: a bounded, repeatable run (well under a minute)."""

from __future__ import annotations

import os

import hypothesis
import hypothesis.errors
import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, Phase
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

from tests.conftest import LiveServer, start_server

# 503 is an answer of the contract, not a fault: a burst of generated work may be refused (503
# SERVICE_OVERLOADED). It must still be documented and in the documented shape (the two conformance checks); any
# other 5xx is a server fault, 504 included: a generated `timeout_ms` of 0.003 ms is refused at the door (400
# TIMEOUT_TOO_SHORT, naming the least timeout), never admitted to expire.
CONTRACT_5XX = {503: {"SERVICE_OVERLOADED", "NO_HEALTHY_WORKER"}}


@schemathesis.check
def no_server_fault(ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case):
    """not_a_server_error, less the contract's 503 and 504 (in any dialect: the code, or OpenAI's lower-case
    code, or KServe's message)."""
    if response.status_code in CONTRACT_5XX:
        return None
    return not_a_server_error(ctx, response, case)


# No operation has a `default` answer (tests/unit/http/test_openapi.py), so status_code_conformance fails on any
# status an operation does not declare.
CHECKS = [no_server_fault, status_code_conformance, response_schema_conformance]
EXAMPLES = 6  # per operation; derandomized, so the same cases every run

PLUGIN = '''
class Embed:
    """Two numbers per input: so /v1/embeddings has a model."""

    output_kind = "embedding"
    max_batch_size = 8

    def batch(self, inputs):
        return [[float(len(text)), 1.0] for text in inputs]


class Rerank:
    """A score per (query, document) pair: so /v1/rerank has a model."""

    output_kind = "json"
    max_batch_size = 8

    def batch(self, inputs):
        return [1.0 / (1 + len(text)) for text in inputs]


class Classify:
    """Two classes' {label, score, logit} per input: so /v1/classify and /predict have a model."""

    output_kind = "json"
    max_batch_size = 8

    def batch(self, inputs):
        long = {"label": "long", "score": 0.5, "logit": 1.0}
        return [[{"label": "short", "score": 1.0 / (1 + len(t)), "logit": 0.0}, long] for t in inputs]
'''

# Swagger UI's static files (megabytes of JavaScript, no JSON shape) are left out; everything else is run.
SKIPPED = {"GET /docs/assets/{name}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> LiveServer:
    folder = tmp_path_factory.mktemp("plugin")
    (folder / "schemaplug.py").write_text(PLUGIN)
    config = folder / "bs.toml"
    config.write_text(
        '[[models]]\nname = "sim"\nbackend = "sim"\nsim_batch_ms = 2\n\n'
        '[[models]]\nname = "embed"\nbackend = "schemaplug:Embed"\n\n'
        '[[models]]\nname = "rr"\nbackend = "schemaplug:Rerank"\ntask = "reranking"\n\n'
        '[[models]]\nname = "clf"\nbackend = "schemaplug:Classify"\ntask = "classification"\n'
    )
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}
    jobs_db = str(folder / "jobs.db")  # its generated batches and files, not ./batchserve-jobs.db
    s = start_server("--config", str(config), "--timeout-ms", "5000", "--jobs-db", jobs_db, env=env)
    yield s
    s.stop()


def check_all(strategy, base_url: str) -> None:
    @hypothesis.given(case=strategy)
    @hypothesis.settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case: schemathesis.Case) -> None:
        case.call_and_validate(base_url=base_url, checks=CHECKS, timeout=30)

    try:
        run()
    except hypothesis.errors.Unsatisfiable:  # no invalid case could be made (nothing in the body to break)
        pass


def test_every_operation_keeps_its_documented_shapes(server: LiveServer) -> None:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    failures: dict[str, str] = {}
    ran = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        label = f"{operation.method.upper()} {operation.path}"
        if label in SKIPPED:
            continue

        # The declared examples first (a served model's name, a body that reaches the model), then generated
        # cases: valid ones, and invalid ones (which must be refused in the documented shape, never with a 5xx).
        strategies = [*operation.get_strategies_from_examples(), operation.as_strategy()]
        if "requestBody" in operation.definition.raw:  # invalid bodies: what the parsers must refuse well
            strategies.append(operation.as_strategy(GenerationMode.NEGATIVE))
        try:
            for strategy in strategies:
                check_all(strategy, server.url)
        except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 - every operation's failures, reported together
            failures[label] = str(exc)[:1500]
        ran += 1
    assert ran >= 30, f"only {ran} operations were run: the document lost routes"
    assert not failures, "\n\n".join(f"{label}:\n{text}" for label, text in failures.items())
    with server.client() as c:  # and the server is still well
        assert c.get("/readyz").status_code == 200
