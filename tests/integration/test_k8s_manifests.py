"""deploy/k8s's configuration serving batch jobs on a real PostgreSQL (the manifests' offline checks are
tests/unit/test_k8s_manifests.py)."""

from __future__ import annotations

from pathlib import Path

from tests.unit.test_k8s_manifests import rendered_env


def test_the_manifest_configuration_serves_batch_jobs_on_postgresql(pg_server, tmp_path: Path):
    """The pod's environment as rendered above, with only the node's parts swapped for this machine (the sim
    for the GPU model, a loopback port, this test's PostgreSQL for the docs' URL, a keys file made as the docs
    say): the server starts on it and a batch job runs to the end on the postgresql:// store."""

    from batchserve.client import Client
    from tests.conftest import add_key, start_server

    config = tmp_path / "config.toml"
    key = add_key(config, "acme", "paid")
    env = rendered_env()
    assert env["BATCHSERVE_JOBS_DB"].startswith("postgresql://") and env["BATCHSERVE_BACKEND"] == "smollm2"
    env.update(
        BATCHSERVE_BACKEND="sim",
        BATCHSERVE_HOST="127.0.0.1",
        BATCHSERVE_CONFIG=str(config),
        BATCHSERVE_JOBS_DB=pg_server.fresh_url(),
        BATCHSERVE_DRAIN_GRACE_S="0",
    )
    server = start_server(env=env)  # --port 0 wins over the manifest's BATCHSERVE_PORT
    try:
        with Client(server.url, api_key=key) as bs:
            job = bs.wait_job(bs.submit_job(["ab", "cde"])["id"], poll_s=0.1, timeout_s=60)
            assert job["status"] == "completed"
            assert [r["output"] for r in bs.job_results(job["id"])] == ["ba", "edc"]
        assert "pg_store" in server.log() or "postgresql://" in server.log()
    finally:
        server.stop()
