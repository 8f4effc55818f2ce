"""The ledger adds up (issue 33): a real sim server overloaded by two keyed tenants with real HTTP clients
(bench/ledger_drill.py's drill, each client counting its own answers), then the server's books read back over
HTTP: /metrics' `batchserve_slo_requests_total` and each key's GET /v1/usage.

`met` is compared with the clients' count of 2xx answers whose `latency_ms` is within the SLO: that is the
server's own time for the request (route to answer), the one it holds to `--slo-ms`. The client's own clock
adds the connection, uvicorn's parsing and its event loop, which on this shared machine under overload is not
the server's to keep; it is printed beside, not asserted (bench/ledger_drill.py records both)."""

from __future__ import annotations

import jsonschema
import pytest

from bench.ledger_drill import OUTCOMES, Tenant, by_outcome, drill, ledger_of, write_keys

SLO_MS = 150.0
TIMEOUT_MS = 600.0


def agree_within_1_percent(server: int, client: int) -> bool:
    return abs(server - client) <= max(1, 0.01 * client)


@pytest.fixture
def overloaded(server_factory, tmp_path):
    """A sim server of ~100 requests/s (one device, 40 ms batches of 4, 8 queued at most), keys for two
    tenants of two tiers (beta's own rate limit is 40/s, so it meets 429s too) and an admin."""
    tenants = [Tenant("alpha", "paid", 120.0, key_rate=10000), Tenant("beta", "free", 60.0, key_rate=40)]
    config = tmp_path / "keys.toml"
    admin = Tenant("ops", "enterprise", 0.0)
    write_keys(config, [*tenants, admin])
    config.write_text(config.read_text().replace('tenant = "ops"', 'tenant = "ops"\nadmin = true'))
    server = server_factory(
        "--config",
        str(config),
        "--backend",
        "sim",
        "--devices",
        "1",
        "--sim-batch-ms",
        "40",
        "--max-batch-size",
        "4",
        "--max-queue",
        "8",
        "--slo-ms",
        f"{SLO_MS:g}",
    )
    return server, tenants, admin


def test_the_ledger_adds_up(overloaded):
    server, tenants, admin = overloaded
    result = drill(server.url, tenants, 3.0, SLO_MS, TIMEOUT_MS)
    tallies = result["tallies"]
    sent = sum(t.sent for t in tallies.values())
    print(
        {n: (t.sent, t.statuses, t.met_by_server_latency, t.met_by_client_clock) for n, t in tallies.items()},
        result["server"],
    )
    assert all(t.transport_errors == 0 for t in tallies.values()), "every request got an HTTP answer"
    clients = {o: sum(t.outcomes()[o] for t in tallies.values()) for o in OUTCOMES}
    assert clients["refused"] > 0 and clients["met"] > 0, f"not an overload drill: {clients}"
    server_counts = result["server"]
    assert sum(server_counts.values()) == sent  # the sum over outcomes is the requests the clients sent
    assert agree_within_1_percent(server_counts["met"], clients["met"]), (server_counts, clients)
    for outcome in ("refused", "expired", "failed"):  # by status: exact
        assert server_counts[outcome] == clients[outcome], (outcome, server_counts, clients)
    for t in tenants:  # one tier each: the /metrics aggregate of its tier is that client's
        by_tier, mine = result["server_by_tier"][t.tier], tallies[t.name].outcomes()
        assert sum(by_tier.values()) == tallies[t.name].sent
        assert agree_within_1_percent(by_tier["met"], mine["met"]), (t.name, by_tier, mine)
    for t in tenants:  # each key's /v1/usage against that client's own counts
        usage, tally = result["usage"][t.name], tallies[t.name]
        mine = tally.outcomes()
        assert usage["tenant"] == t.name and usage["tier"] == t.tier
        assert sum(usage["requests"].values()) == tally.sent
        assert agree_within_1_percent(usage["requests"]["met"], mine["met"]), (t.name, usage, mine)
        for outcome in ("refused", "expired", "failed"):
            assert usage["requests"][outcome] == mine[outcome], (t.name, outcome, usage, mine)
        served = mine["met"] + mine["slow"]
        assert usage["inputs"]["met"] + usage["inputs"]["slow"] == served
        assert usage["cost_served"] == served  # the sim backend costs 1 an input
        assert usage["since_start"]["requests"] == usage["requests"]
        if served:
            assert usage["latency_ms"]["count"] == served and usage["latency_ms"]["p50"] is not None
    with server.client() as c:
        everyone = c.get("/v1/usage", headers={"Authorization": f"Bearer {admin.key}"}).json()["data"]
        assert {u["tenant"] for u in everyone} == {"alpha", "beta"}  # the admin itself sent nothing
        assert {u["tenant"]: u["requests"] for u in everyone} == {n: u["requests"] for n, u in result["usage"].items()}
        assert c.get("/v1/usage").status_code == 401  # keys configured: no anonymous figures
        bad = c.get("/v1/usage?window_s=nope", headers={"Authorization": f"Bearer {admin.key}"})
        assert bad.status_code == 400 and bad.json()["error"] == "INVALID_REQUEST"
        assert "alpha" not in c.get("/metrics").text  # no tenant in /metrics (docs/contract.md#observability)


def test_anonymous_callers_see_the_anonymous_tenant(server_factory):
    server = server_factory("--slo-ms", "5000", "--timeout-ms", "10000")
    with server.client() as c:
        for i in range(3):
            assert c.post("/v1/inference", json={"input": f"x{i}"}).status_code == 200
        assert c.post("/v1/inference", json={"input": ""}).status_code == 400  # the caller's mistake: no outcome
        answer = c.get("/v1/usage", params={"window_s": 60}).json()
        doc = c.get("/openapi.json").json()  # the answer is what the published document says
        jsonschema.Draft202012Validator({**doc, "$ref": "#/components/schemas/UsageList"}).validate(answer)
        (mine,) = answer["data"]
        assert mine["tenant"] == "anonymous" and mine["window_s"] == 60
        assert mine["requests"] == {"met": 3, "slow": 0, "refused": 0, "expired": 0, "failed": 0}


def test_usage_has_each_models_percentiles_beside_the_tenants(server_factory, tmp_path):
    """A fast and a slow model called by one tenant: the tenant's figures mix them, `by_model` has each one's
    own (the slow model's p50 is at least its batch time), with the sample bound said in the answer."""
    config = tmp_path / "bs.toml"
    config.write_text('[[models]]\nname = "fast"\nsim_batch_ms = 5\n\n[[models]]\nname = "slow"\nsim_batch_ms = 300\n')
    server = server_factory("--config", str(config), "--slo-ms", "5000", "--timeout-ms", "10000")
    with server.client() as c:
        for i in range(4):
            assert c.post("/v1/inference", json={"input": f"f{i}", "model": "fast"}).status_code == 200
        assert c.post("/v1/inference", json={"input": "s", "model": "slow"}).status_code == 200
        answer = c.get("/v1/usage").json()
        doc = c.get("/openapi.json").json()
        jsonschema.Draft202012Validator({**doc, "$ref": "#/components/schemas/UsageList"}).validate(answer)
    latency = answer["data"][0]["latency_ms"]
    assert latency["count"] == 5 and latency["sample_max"] == 2048
    by_model = latency["by_model"]
    assert set(by_model) == {"fast@v1", "slow@v1"}, by_model
    assert by_model["fast@v1"]["count"] == 4 and by_model["slow@v1"]["count"] == 1
    assert by_model["slow@v1"]["p50"] >= 300 > by_model["fast@v1"]["p50"], by_model


def test_a_deadline_shorter_than_possible_is_the_callers_own_outcome(server_factory, tmp_path):
    """Issue 46 item 5: a tenant asking for deadlines no batch can meet is refused at the door (400
    TIMEOUT_TOO_SHORT) and books nothing: no SLO outcome of its own, of its tier, or of another tenant beside it."""
    tenants = [Tenant("hasty", "paid", 0.0), Tenant("steady", "paid", 0.0)]
    config = tmp_path / "keys.toml"
    write_keys(config, tenants)
    server = server_factory("--config", str(config), "--sim-batch-ms", "40", "--slo-ms", "1000")
    hasty, steady = ({"Authorization": f"Bearer {t.key}"} for t in tenants)
    with server.client() as c:
        for i in range(10):
            r = c.post("/v1/inference", json={"input": f"h{i}", "timeout_ms": 1}, headers=hasty)
            assert r.status_code == 400 and r.json()["error"] == "TIMEOUT_TOO_SHORT", r.text
        for i in range(3):
            assert c.post("/v1/inference", json={"input": f"s{i}"}, headers=steady).status_code == 200
        mine = c.get("/v1/usage", headers=hasty).json()["data"][0]["requests"]
        theirs = c.get("/v1/usage", headers=steady).json()["data"][0]["requests"]
        text = c.get("/metrics").text
    assert mine == dict.fromkeys(OUTCOMES, 0), mine
    assert theirs == {**dict.fromkeys(OUTCOMES, 0), "met": 3}, theirs
    assert by_outcome(ledger_of(text), "paid") == {**dict.fromkeys(OUTCOMES, 0), "met": 3}  # the tier: steady's alone
