"""Keys, tiers, rate limits, fairness, models and versions (issue 4), through real HTTP on live servers."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
from pathlib import Path

import aiohttp

from tests.conftest import add_key
from tests.integration.inference.test_routes import metric


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def post(s: aiohttp.ClientSession, url: str, text: str, key: str | None = None, **body) -> tuple[int, dict]:
    async with s.post(url + "/v1/inference", json={"input": text, **body}, headers=bearer(key) if key else {}) as r:
        return r.status, await r.json()


def test_keys_add_prints_once_and_stores_only_the_digest(tmp_path):
    config = tmp_path / "bs.toml"
    key = add_key(config, "acme", "paid", "--rate", "50")
    stored = config.read_text()
    assert key.startswith("bs_") and key not in stored
    assert hashlib.sha256(key.encode()).hexdigest() in stored
    assert 'tenant = "acme"' in stored and "rate = 50" in stored
    assert add_key(config, "acme", "paid") != key


def test_auth_401_and_anonymous_rules(tmp_path, server_factory):
    config = tmp_path / "bs.toml"
    key = add_key(config, "acme", "paid")
    server = server_factory("--config", str(config))
    with server.client() as c:
        r = c.post("/v1/inference", json={"input": "abc"})
        assert r.status_code == 401 and r.json()["error"] == "UNAUTHORIZED"
        assert r.headers["www-authenticate"] == "Bearer"
        assert c.post("/v1/inference", json={"input": "abc"}, headers=bearer("bs_wrong")).status_code == 401
        assert c.post("/v1/inference", json={"input": "abc"}, headers={"Authorization": key}).status_code == 401
        ok = c.post("/v1/inference", json={"input": "abc"}, headers=bearer(key))
        assert ok.status_code == 200 and ok.json()["output"] == "cba"
    # No keys and a non-loopback address: refused at start-up unless --allow-anonymous.
    refused = subprocess.run(
        [sys.executable, "-m", "batchserve", "serve", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0 and "--allow-anonymous" in refused.stderr


def test_rate_limit_429_with_headers(tmp_path, server_factory):
    config = tmp_path / "bs.toml"
    config.write_text("[tiers.free]\nrate = 1\nburst = 3\n")
    key = add_key(config, "cheap", "free")
    rich = add_key(config, "rich", "free", "--rate", "1000")
    server = server_factory("--config", str(config))
    with server.client() as c:
        answers = [c.post("/v1/inference", json={"input": "x"}, headers=bearer(key)) for _ in range(4)]
        assert [a.status_code for a in answers] == [200, 200, 200, 429]
        assert answers[0].headers["x-ratelimit-limit"] == "3"  # the bucket's size: the burst
        assert answers[0].headers["x-ratelimit-remaining"] == "2"
        limited = answers[3]
        assert limited.json()["error"] == "RATE_LIMITED" and limited.json()["retry_after_ms"] > 0
        assert int(limited.headers["retry-after"]) >= 1
        assert limited.headers["x-ratelimit-remaining"] == "0" and int(limited.headers["x-ratelimit-reset"]) >= 1
        # The per-key override and other keys are untouched by one key's limit.
        assert all(
            c.post("/v1/inference", json={"input": "y"}, headers=bearer(rich)).status_code == 200 for _ in range(5)
        )


def test_rate_limit_headers_never_show_more_remaining_than_the_limit(tmp_path, server_factory):
    # The default paid tier: 100 requests/s, a bucket of 200. Limit is the bucket's size (what may be sent at
    # once); it once said the rate (100) beside a Remaining of 199.
    config = tmp_path / "bs.toml"
    key = add_key(config, "acme", "paid")
    server = server_factory("--config", str(config))
    with server.client() as c:
        answers = [c.post("/v1/inference", json={"input": "x"}, headers=bearer(key)) for _ in range(5)]
    for a in answers:
        assert a.status_code == 200
        assert int(a.headers["x-ratelimit-remaining"]) <= int(a.headers["x-ratelimit-limit"]) == 200
    assert answers[0].headers["x-ratelimit-remaining"] == "199"
    assert int(answers[-1].headers["x-ratelimit-reset"]) >= 0


def busy_worker_server(server_factory, config: Path, *extra: str):
    """One device held by a HANG batch, so what queues behind it shows the order batches are filled in."""
    return server_factory(
        "--config",
        str(config),
        "--allow-anonymous",
        "--devices",
        "1",
        "--sim-hang-marker",
        "HANG",
        "--sim-hang-ms",
        "700",
        "--gpu-timeout-ms",
        "60000",
        "--slo-ms",
        "20000",
        "--timeout-ms",
        "20000",
        *extra,
    )


def behind_a_hang(
    url: str, first: list[tuple[str, str]], then: list[tuple[str, str]]
) -> tuple[list[tuple[int, dict]], list[tuple[int, dict]]]:
    """A HANG batch takes the one device; `first` (input, key) queue behind it, `then` 0.1 s later: their answers."""

    async def scenario():
        async with aiohttp.ClientSession() as s:
            hang = asyncio.ensure_future(post(s, url, "HANG"))
            await asyncio.sleep(0.2)
            early = [asyncio.ensure_future(post(s, url, text, key)) for text, key in first]
            await asyncio.sleep(0.1)
            late = [asyncio.ensure_future(post(s, url, text, key)) for text, key in then]
            await hang
            return await asyncio.gather(*early), await asyncio.gather(*late)

    return asyncio.run(scenario())


def test_higher_tier_is_batched_first(tmp_path, server_factory):
    config = tmp_path / "bs.toml"
    free = add_key(config, "f", "free")
    ent = add_key(config, "e", "enterprise")
    server = busy_worker_server(server_factory, config, "--max-batch-size", "4")

    frees, ents = behind_a_hang(
        server.url, [(f"free-{i}", free) for i in range(4)], [(f"ent-{i}", ent) for i in range(4)]
    )
    assert all(s == 200 for s, _ in frees + ents)
    # Enterprise arrived later yet ran in the first batch after the hang; free waited one batch more.
    assert max(b["queue_ms"] for _, b in ents) < min(b["queue_ms"] for _, b in frees)


def test_tenants_of_a_tier_take_turns(tmp_path, server_factory):
    config = tmp_path / "bs.toml"
    heavy = add_key(config, "heavy", "paid")
    light = add_key(config, "light", "paid")
    server = busy_worker_server(server_factory, config, "--max-batch-size", "4")

    flood, lights = behind_a_hang(
        server.url, [(f"h-{i}", heavy) for i in range(16)], [(f"l-{i}", light) for i in range(2)]
    )
    assert all(s == 200 for s, _ in flood + lights)
    # The light tenant arrived after 16 heavy items but shares the first batch half and half.
    first_batch_heavy = sorted(b["queue_ms"] for _, b in flood)[:2]
    assert max(b["queue_ms"] for _, b in lights) <= max(first_batch_heavy) + 20
    assert sum(1 for _, b in flood if b["queue_ms"] > max(b2["queue_ms"] for _, b2 in lights)) >= 12


def test_lower_tier_is_delayed_never_starved(tmp_path, server_factory):
    config = tmp_path / "bs.toml"
    free = add_key(config, "f", "free")
    ent = add_key(config, "e", "enterprise", "--rate", "10000")
    # A 200 ms SLO (free's head start 0.5 s), and a slack so wide that the growing backlog is never refused.
    server = server_factory(
        "--config",
        str(config),
        "--devices",
        "1",
        "--max-batch-size",
        "2",
        "--slo-ms",
        "200",
        "--admission-slack",
        "500",
        "--timeout-ms",
        "60000",
    )

    async def scenario():
        order: list[str] = []
        async with aiohttp.ClientSession() as s:

            async def tracked(text: str, key: str):
                result = await post(s, server.url, text, key)
                order.append(text)
                return result

            tasks = []
            for i in range(60):  # 30 enterprise items/s against a capacity of 20/s: a growing backlog
                tasks.append(asyncio.ensure_future(tracked(f"ent-{i}", ent)))
                if i == 3:
                    tasks.append(asyncio.ensure_future(tracked("free-0", free)))
                await asyncio.sleep(1 / 30)
            results = await asyncio.gather(*tasks)
        return results, order

    results, order = asyncio.run(scenario())
    assert all(s == 200 for s, _ in results)
    # Strict priority would leave the free item last; aging lets it overtake enterprise items that arrived
    # more than free's head start after it.
    assert order.index("free-0") < len(order) - 5


def test_lower_tiers_are_shed_first(tmp_path, server_factory):
    config = tmp_path / "bs.toml"
    free = add_key(config, "f", "free")
    ent = add_key(config, "e", "enterprise")
    server = server_factory(
        "--config",
        str(config),
        "--allow-anonymous",
        "--devices",
        "1",
        "--max-batch-size",
        "1",
        "--slo-ms",
        "1000",
        "--sim-hang-marker",
        "HANG",
        "--sim-hang-ms",
        "2500",
        "--gpu-timeout-ms",
        "60000",
        "--timeout-ms",
        "20000",
    )

    async def scenario():
        async with aiohttp.ClientSession() as s:
            # The hang holds the device while the burst arrives, and must not end before it: its 2.5 s batch,
            # once finished, is learned as the batch time and would refuse all but one (seen once, 800 ms long,
            # on a loaded machine).
            hang = asyncio.ensure_future(post(s, server.url, "HANG"))
            await asyncio.sleep(0.3)
            # 30 arrivals in a moment against a capacity of 10/s: pressure, so the tiers' bounds apply.
            paid = [asyncio.ensure_future(post(s, server.url, f"p-{i}")) for i in range(30)]
            await asyncio.sleep(0.2)
            free_answer = await post(s, server.url, "f", free)
            ent_answer = await post(s, server.url, "e", ent)
            await hang
            return free_answer, ent_answer, await asyncio.gather(*paid)

    free_answer, ent_answer, paid = asyncio.run(scenario())
    # Anonymous callers are tier "paid" by default: admitted up to their bound (1250 ms), then refused.
    assert sum(1 for s, _ in paid if s == 200) >= 10 and {s for s, _ in paid} <= {200, 503}
    assert free_answer[0] == 503 and free_answer[1]["error"] == "SERVICE_OVERLOADED"
    assert ent_answer[0] == 200 and ent_answer[1]["output"] == "e"


MODELS = """
[[models]]
name = "echo"
version = "v1"
sim_batch_ms = 50
weight = 50
[[models]]
name = "echo"
version = "v2"
sim_batch_ms = 50
weight = 50
[[models]]
name = "other"
version = "v1"
sim_batch_ms = 80
"""


def test_models_versions_and_batches_never_mix(tmp_path, server_factory):
    config = tmp_path / "bs.toml"
    config.write_text(MODELS)
    keys = [add_key(config, f"t{i}", "enterprise", "--rate", "10000") for i in range(6)]
    server = server_factory("--config", str(config), "--allow-anonymous", "--devices", "2", "--slo-ms", "5000")
    with server.client() as c:
        listed = c.get("/v1/models").json()
    assert listed["object"] == "list"
    assert sorted(m["id"] for m in listed["data"]) == ["echo@v1", "echo@v2", "other@v1"]

    async def scenario():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=600)) as s:
            names = ["echo", "echo@v1", "echo@v2", "other", "other@v1"]
            burst = [post(s, server.url, f"in-{i}", None, model=names[i % 5]) for i in range(500)]
            sticky = [post(s, server.url, f"k-{k}-{j}", keys[k], model="echo") for k in range(6) for j in range(8)]
            return await asyncio.gather(*burst), await asyncio.gather(*sticky)

    burst, sticky = asyncio.run(scenario())
    served: dict[str, int] = {}
    for i, (status, body) in enumerate(burst):
        assert status == 200 and body["output"] == f"in-{i}"[::-1]
        served[body["model"]] = served.get(body["model"], 0) + 1
        wanted = ["echo", "echo@v1", "echo@v2", "other", "other@v1"][i % 5]
        assert body["model"].startswith(wanted.split("@")[0]) and ("@" not in wanted or body["model"] == wanted)
    assert served["echo@v1"] > 100 and served["echo@v2"] > 100  # the 50/50 split, plus explicit picks
    for k in range(6):  # one key always lands on the same version
        assert len({b["model"] for s, b in sticky[k * 8 : (k + 1) * 8]}) == 1
    for status, body in sticky:
        assert status == 200
        served[body["model"]] += 1
    with server.client() as c:
        text = c.get("/metrics").text
    for model, count in served.items():
        # Each batch is labelled with its one model: per-model item counts match per-model answers exactly,
        # which a batch holding two models would break.
        assert metric(text, "batchserve_batch_size_sum", model=model) == count
        assert metric(text, "batchserve_requests_total", model=model, status="200") == count


def test_a_quiet_model_is_not_kept_behind_a_busy_one(tmp_path, server_factory):
    config = tmp_path / "bs.toml"
    config.write_text('[[models]]\nname = "busy"\n[[models]]\nname = "quiet"\n')
    server = server_factory(
        "--config",
        str(config),
        "--devices",
        "1",
        "--max-batch-size",
        "10",
        "--sim-hang-marker",
        "HANG",
        "--sim-hang-ms",
        "600",
        "--gpu-timeout-ms",
        "60000",
        "--slo-ms",
        "20000",
        "--timeout-ms",
        "20000",
    )

    async def scenario():
        async with aiohttp.ClientSession() as s:
            hang = asyncio.ensure_future(post(s, server.url, "HANG", None, model="busy"))
            await asyncio.sleep(0.2)
            busy = [asyncio.ensure_future(post(s, server.url, f"b{i}", None, model="busy")) for i in range(5)]
            await asyncio.sleep(0.1)
            quiet = asyncio.ensure_future(post(s, server.url, "q", None, model="quiet"))
            await hang
            return await asyncio.gather(*busy), await quiet

    busy, (q_status, q_body) = asyncio.run(scenario())
    assert q_status == 200 and q_body["model"] == "quiet@v1" and q_body["output"] == "q"
    assert all(s == 200 and b["model"] == "busy@v1" for s, b in busy)
    # Both queues were due when the device came back; the busy model had just been served, so the quiet
    # model's later item went first rather than waiting behind the busy model's older ones.
    assert q_body["queue_ms"] < min(b["queue_ms"] for _, b in busy)
