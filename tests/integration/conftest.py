"""A guard that keeps the integration tests safe to run in parallel (pytest-xdist workers, `.ci/run`); the
fixtures themselves live in tests/conftest.py."""

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
        pytest.fail(
            f"a server started by this test (or one running beside it) created {DEFAULT_JOBS_DB.resolve()}: "
            "give the test's servers a --jobs-db of its own"
        )


@pytest.hookimpl(trylast=True)  # after `-m` has deselected: the order of what runs
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules that load a real model first, then those with the most tests, each module's tests kept together
    and in their order. pytest-xdist (`--dist loadfile --no-loadscope-reorder`, .ci/run) hands modules out in
    this order as workers free up: a 30 s real-model module handed out last would run alone at the end while
    the other workers idle (its default order, by test count alone, put single-test modules last)."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    ordered = sorted(
        modules.values(), key=lambda tests: (not any(t.get_closest_marker("slow") for t in tests), -len(tests))
    )
    items[:] = [item for tests in ordered for item in tests]
