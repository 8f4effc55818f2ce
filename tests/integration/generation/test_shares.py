"""The generation engine's shares by tenant and tier, and preemption by recompute (issue 33 item 3), through
HTTP on a live `--generation on` server with SmolLM2's real weights and keyed tenants:

- a tenant holding every slot with long chats does not lock another out: the other's 10 short chats are all
  answered, in a small multiple of their time alone (the issue measured 0 of 10: 9 x 503, 1 x 504);
- a chat batch (OpenAI Batch API, tier `batch`) beside another tenant's interactive chats: every valid line
  completes (the issue: 84 of 100 failed SERVICE_OVERLOADED), and the interactive chats stay near their time
  alone;
- a greedy sequence paused for another tenant and resumed by recompute answers token for token as alone.

Small on purpose (2 shared CPU cores): the full figures (100 lines x 160 tokens) are bench/gen_share.py's.
Timing bounds here are generous; the printed ratios are the measurement. Each failed before the change: the
hog's sequences held every slot, batch lines failed after a few quick retries, and nothing was ever paused."""

from __future__ import annotations

import statistics
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from bench.gen_share import Hog, chat, engine_stats, keyed, run_batch, timed_chats
from tests.conftest import LiveServer
from tests.integration.jobs.test_routes import wait_for

pytestmark = pytest.mark.slow  # the real model

def p50(xs: list[float]) -> float:
    return statistics.median(xs)


def test_a_tenant_holding_every_slot_does_not_lock_another_out(tmp_path: Path, server_factory: Callable) -> None:
    config, keys = keyed(tmp_path, ("hog", "small"))
    s: LiveServer = server_factory("--devices", "1", "--generation", "on", "--generation-max-seqs", "4",
                                   "--generation-max-context", "1024", "--config", str(config), timeout=180)
    shorts = [chat(f"What is {i} plus {i}?", 12) for i in range(10)]
    timed_chats(s.url, keys["small"], shorts[:1])  # warm
    alone, _ = timed_chats(s.url, keys["small"], shorts)
    with Hog(s.url, keys["hog"], 6, 900) as hog:  # more than the slots: 4 running, 2 waiting
        wait_for(lambda: engine_stats(s.url)["running"] == 4 and hog.streaming() >= 4,
                 timeout=120, every=0.1)
        beside, answers = timed_chats(s.url, keys["small"], shorts)
        stats = engine_stats(s.url)
    ratio = p50(beside) / p50(alone)
    print(f"\nshort chats p50 alone {p50(alone):.2f} s, beside a tenant holding every slot {p50(beside):.2f} s "
          f"(x{ratio:.2f}); preempted {stats['preempted']}")
    assert [r.status_code for r in answers] == [200] * 10, [r.text for r in answers if r.status_code != 200]
    assert stats["preempted"] >= 1  # the hog's sequences were paused for them, not failed
    assert ratio <= 6, ratio  # the goal is 3x (bench/gen_share.py measures it); generous on a shared machine


def test_a_preempted_greedy_sequence_answers_token_for_token_as_alone(tmp_path: Path,
                                                                      server_factory: Callable) -> None:
    config, keys = keyed(tmp_path, ("first", "second"))
    s: LiveServer = server_factory("--devices", "1", "--generation", "on", "--generation-max-seqs", "2",
                                   "--generation-max-context", "512", "--config", str(config), timeout=180)
    longs = [chat(f"Write a poem about the sea, number {i}.", 96, ignore_eos=True) for i in range(2)]
    _, alone = timed_chats(s.url, keys["first"], longs)
    got: dict[int, Any] = {}

    def run(i: int) -> None:
        _, (answer,) = timed_chats(s.url, keys["first"], [longs[i]])
        got[i] = answer

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    wait_for(lambda: engine_stats(s.url)["running"] == 2, timeout=60, every=0.02)  # first holds both slots
    before = engine_stats(s.url)["preempted"]
    _, (other,) = timed_chats(s.url, keys["second"], [chat("Say hi.", 8)])  # pauses one of first's
    for t in threads:
        t.join(240)
    assert other.status_code == 200
    assert engine_stats(s.url)["preempted"] > before
    for i in range(2):
        assert got[i].status_code == 200, got[i].text
        a, b = alone[i].json(), got[i].json()
        assert b["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
        assert b["usage"] == a["usage"]


def test_a_chat_batch_beside_interactive_chats_completes_every_line(tmp_path: Path,
                                                                   server_factory: Callable) -> None:
    config, keys = keyed(tmp_path, ("batcher", "caller"))
    s: LiveServer = server_factory("--devices", "1", "--generation", "on", "--generation-max-seqs", "4",
                                   "--generation-max-context", "512", "--config", str(config),
                                   "--jobs-db", str(tmp_path / "jobs.db"), timeout=180)
    interactive = [chat(f"Name a color, number {i}.", 12) for i in range(8)]
    timed_chats(s.url, keys["caller"], interactive[:1])  # warm
    alone, _ = timed_chats(s.url, keys["caller"], interactive)
    lines = [chat(f"Describe the number {i} in one sentence.", 40, ignore_eos=True) for i in range(16)]
    done: dict[str, Any] = {}
    batcher = threading.Thread(target=lambda: done.update(run_batch(s.url, keys["batcher"], lines, 600)))
    batcher.start()
    wait_for(lambda: engine_stats(s.url)["running"] >= 2, timeout=60, every=0.05)  # the batch is running
    beside, answers = timed_chats(s.url, keys["caller"], interactive)
    batcher.join(660)
    ratio = p50(beside) / p50(alone)
    print(f"\ninteractive chat p50 alone {p50(alone):.2f} s, beside a {len(lines)}-line chat batch "
          f"{p50(beside):.2f} s (x{ratio:.2f}); batch {done.get('request_counts')}")
    assert [r.status_code for r in answers] == [200] * len(interactive)
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": len(lines), "completed": len(lines), "failed": 0}
    assert ratio <= 4, ratio  # the goal is 1.5x (bench/gen_share.py measures it); generous here
