"""The generation engine's shares by tenant and tier, and preemption by recompute (issue 33 item 3), through
HTTP on a live `--generation on` server with SmolLM2's real weights and keyed tenants:

- a tenant holding every slot with long chats does not lock another out: the other's short chats are all
  answered, in a small multiple of their time alone (the issue measured 0 of 10: 9 x 503, 1 x 504);
- a greedy sequence paused for another tenant and resumed by recompute answers token for token as unpaused,
  and every answer's prompt and generated tokens count in the cost account (per tier at /internal/generation),
  as they do in the tenant's own /v1/usage;
- a chat batch (OpenAI Batch API, tier `batch`) beside another tenant's interactive chats: every valid line
  completes (the issue: 84 of 100 failed SERVICE_OVERLOADED), batch lines fill all but the headroom alone and
  are paused down to their cap (`--generation-batch-beside-interactive`) while the interactive chats run, the
  batch row sits out some decode steps (the slot stepper's duty cycle, `step_share`: /internal/generation counts
  steps of the interactive rows alone), and the chats stay near their time alone.

One server for the module and test_refusals (`keyed_generation` in conftest.py: 4 slots, one start: the model's
load and warm-up is most of a test's time), the tests in turn, each waiting for the engine to be idle first.
Small on purpose (2 shared CPU cores): the full figures (100 lines x 160 tokens) are bench/gen_share.py's. Timing
bounds here are generous; the printed ratios are the measurement. Each failed before its change: the hog's
sequences held every slot, batch lines failed after a few quick retries, nothing was ever paused, batch lines
held every spare row beside interactive chats, and the engine's answers were in no cost account."""

from __future__ import annotations

import statistics
import threading
from typing import Any

import httpx
import pytest

from bench.gen_share import Hog, chat, engine_stats, run_batch, timed_chats
from tests.conftest import LiveServer
from tests.integration.generation.conftest import KEYED_SLOTS
from tests.integration.jobs.test_routes import wait_for

pytestmark = pytest.mark.slow  # the real model

SLOTS = KEYED_SLOTS


def p50(xs: list[float]) -> float:
    return statistics.median(xs)


@pytest.fixture
def shared(keyed_generation: tuple[LiveServer, dict[str, str]]) -> tuple[LiveServer, dict[str, str]]:
    return keyed_generation  # conftest.py: one server for this module and test_refusals


def idle(url: str) -> dict[str, Any]:
    """The engine's stats once nothing runs or waits (the previous test's hung-up sequences are gone)."""
    wait_for(lambda: (lambda st: st["running"] == 0 and st["waiting"] == 0)(engine_stats(url)), timeout=120, every=0.1)
    return engine_stats(url)


def test_a_tenant_holding_every_slot_does_not_lock_another_out(shared: tuple[LiveServer, dict[str, str]]) -> None:
    s, keys = shared
    idle(s.url)
    shorts = [chat(f"What is {i} plus {i}?", 8) for i in range(6)]
    timed_chats(s.url, keys["small"], shorts[:1])  # warm
    alone, _ = timed_chats(s.url, keys["small"], shorts)
    before = engine_stats(s.url)["preempted"]
    with Hog(s.url, keys["hog"], SLOTS + 2, 900) as hog:  # more than the slots: 4 running, 2 waiting
        wait_for(lambda: engine_stats(s.url)["running"] == SLOTS and hog.streaming() >= SLOTS, timeout=120, every=0.1)
        beside, answers = timed_chats(s.url, keys["small"], shorts)
        stats = engine_stats(s.url)
    ratio = p50(beside) / p50(alone)
    print(
        f"\nshort chats p50 alone {p50(alone):.2f} s, beside a tenant holding every slot {p50(beside):.2f} s "
        f"(x{ratio:.2f}); preempted {stats['preempted'] - before}"
    )
    assert [r.status_code for r in answers] == [200] * len(shorts), [r.text for r in answers if r.status_code != 200]
    assert stats["preempted"] > before  # the hog's sequences were paused for them, not failed
    assert ratio <= 6, ratio  # the goal is 3x (bench/gen_share.py measures it); generous on a shared machine


def test_a_preempted_greedy_sequence_answers_token_for_token_and_every_answer_is_costed(
    shared: tuple[LiveServer, dict[str, str]],
) -> None:
    s, keys = shared
    cost_before = idle(s.url)["cost_served"].get("paid", {"inputs": 0, "cost": 0.0})
    longs = [chat(f"Write a poem about the sea, number {i}.", 32, ignore_eos=True) for i in range(SLOTS)]

    def all_at_once() -> tuple[dict[int, httpx.Response], threading.Thread]:
        got: dict[int, httpx.Response] = {}

        def run(i: int) -> None:
            _, (answer,) = timed_chats(s.url, keys["first"], [longs[i]])
            got[i] = answer

        threads = [threading.Thread(target=run, args=(i,)) for i in range(SLOTS)]
        for t in threads:
            t.start()
        return got, threads[0]

    # the answers unpaused: one tenant alone on the engine, nothing to take its slots
    reference, _ = all_at_once()
    wait_for(lambda: len(reference) == SLOTS, timeout=240, every=0.1)
    before = engine_stats(s.url)["preempted"]
    got, _ = all_at_once()
    wait_for(lambda: engine_stats(s.url)["running"] == SLOTS, timeout=60, every=0.02)  # first holds every slot
    _, (other,) = timed_chats(s.url, keys["second"], [chat("Say hi.", 8)])  # pauses one of first's
    wait_for(lambda: len(got) == SLOTS, timeout=240, every=0.1)
    assert other.status_code == 200, other.text
    assert engine_stats(s.url)["preempted"] > before
    for i in range(SLOTS):
        assert got[i].status_code == 200, got[i].text
        a, b = reference[i].json(), got[i].json()
        assert b["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
        assert b["usage"] == a["usage"]
    # every answer's prompt + generated tokens count in the engine's cost account (tier paid: every key's)
    answers = [*reference.values(), *got.values(), other]
    cost = engine_stats(s.url)["cost_served"]["paid"]
    assert cost["inputs"] - cost_before["inputs"] == len(answers)
    assert cost["cost"] - cost_before["cost"] == sum(r.json()["usage"]["total_tokens"] for r in answers)
    usage = httpx.get(s.url + "/v1/usage", headers={"Authorization": f"Bearer {keys['second']}"}).json()["data"][0]
    assert usage["since_start"]["cost_served"] == other.json()["usage"]["total_tokens"]


def test_a_chat_batch_beside_interactive_chats_keeps_to_its_rows_and_completes_every_line(
    shared: tuple[LiveServer, dict[str, str]],
) -> None:
    s, keys = shared
    cap = idle(s.url)["batch_rows_beside_interactive"]
    assert cap == 1  # a quarter of 4 slots
    interactive = [chat(f"Name a color, number {i}.", 8) for i in range(6)]
    timed_chats(s.url, keys["caller"], interactive[:1])  # warm
    alone, _ = timed_chats(s.url, keys["caller"], interactive)
    # 6 lines: 3 fill the slots the headroom leaves, 2 of those are paused for the cap, 3 more wait, so a batch
    # row is live through all the chats below; every line it runs after them is suite time that checks nothing
    lines = [chat(f"Describe the number {i} in one sentence.", 24, ignore_eos=True) for i in range(6)]
    done: dict[str, Any] = {}
    batcher = threading.Thread(target=lambda: done.update(run_batch(s.url, keys["batcher"], lines, 600)))
    batcher.start()
    # alone, the batch fills every slot but the headroom
    wait_for(lambda: engine_stats(s.url)["batch_running"] == SLOTS - 1, timeout=120, every=0.05)
    before = engine_stats(s.url)["preempted"]
    seen: list[tuple[int, int]] = []  # (running, batch lines running) while the interactive chats run
    chatting = threading.Event()

    def sample() -> None:
        while not chatting.is_set():
            st = engine_stats(s.url)
            seen.append((st["running"], st["batch_running"]))
            chatting.wait(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    steps_before = engine_stats(s.url)["steps"]
    beside, answers = timed_chats(s.url, keys["caller"], interactive)
    steps = {k: v - steps_before[k] for k, v in engine_stats(s.url)["steps"].items()}
    chatting.set()
    sampler.join()
    batcher.join(660)
    ratio = p50(beside) / p50(alone)
    print(
        f"\ninteractive chat p50 alone {p50(alone):.2f} s, beside a {len(lines)}-line chat batch "
        f"{p50(beside):.2f} s (x{ratio:.2f}); batch {done.get('request_counts')}; (running, batch running) "
        f"seen {sorted(set(seen))}; steps while both ran {steps}"
    )
    assert [r.status_code for r in answers] == [200] * len(interactive)
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": len(lines), "completed": len(lines), "failed": 0}
    # from the first interactive arrival on, the batch held its cap at most (its other lines were paused)
    assert engine_stats(s.url)["preempted"] >= before + SLOTS - 1 - cap
    beside_interactive = [batch for running, batch in seen if running > batch]
    assert beside_interactive and max(beside_interactive) <= cap, seen
    # the batch row took part in steps, and (on a CPU, where a second row lengthens a step far more than
    # --generation-batch-slowdown allows) sat out others: steps of the interactive row alone (`step_share`)
    assert steps["full"] > 0, steps
    if engine_stats(s.url)["engine"].endswith("on cpu"):
        assert steps["interactive_only"] > 0, steps
    assert ratio <= 4, ratio  # the goal is 1.5x (bench/gen_share.py measures it); generous here
