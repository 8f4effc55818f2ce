"""How the integration tests share the machine in parallel workers (pytest-xdist, `.ci/run`), and a guard for
the checkout; the fixtures themselves live in tests/conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest

DEFAULT_JOBS_DB = Path("batchserve-jobs.db")  # --jobs-db's default, relative to the servers' working directory


@pytest.fixture(autouse=True)
def no_job_store_in_the_checkout():
    """A server started without --jobs-db keeps its jobs in ./batchserve-jobs.db, and every server started
    after the file exists opens and `flock`s it: the servers of tests running in parallel (pytest-xdist)
    would take it from each other (503s) and resume each other's jobs. A test that submits jobs passes a
    --jobs-db of its own (a temporary file or a PostgreSQL schema)."""
    existed = DEFAULT_JOBS_DB.exists()
    yield
    if not existed and DEFAULT_JOBS_DB.exists():
        pytest.fail(f"a server started by this test (or one running beside it) created {DEFAULT_JOBS_DB.resolve()}: "
                    "give the test's servers a --jobs-db of its own")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for `--dist loadgroup`: the real-model tests (`slow`) are one group, so they run one at a time on
    one worker (each keeps the CPU busy; several at once only push each other past their timeouts), and they go
    first since together they take longest; every other module is a group of its own, so a module-scoped
    server starts once. Those tests mostly wait on servers and sleeps: the other workers overlap them."""
    for item in items:
        group = "models" if item.get_closest_marker("slow") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: each group keeps its order
