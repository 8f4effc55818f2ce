"""How `--processes N` splits the devices, in process (the real processes are
tests/integration/http/test_processes.py)."""

from __future__ import annotations

import sys

import pytest


def test_devices_split_evenly_and_cuda_children_see_only_their_gpus(monkeypatch: pytest.MonkeyPatch):
    """The split itself, without GPUs: sim devices are a count each; on CUDA each child gets its own slice of
    the visible GPUs (here a stand-in torch that reports four)."""
    import types

    from batchserve.config import Settings
    from batchserve.http.processes import Share, device_shares

    assert device_shares(Settings(processes=2, devices=4)) == [Share(2, None)] * 2
    assert device_shares(Settings(processes=3)) == [Share(1, None)] * 3  # sim, devices 0: one each
    cuda = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 4)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    gpu = Settings(processes=2, backend="minilm")
    assert device_shares(gpu) == [Share(2, "3,5"), Share(2, "6,7")]
    assert device_shares(Settings(processes=2, devices=2, backend="minilm")) == [Share(1, "3"), Share(1, "5")]
    with pytest.raises(ValueError, match="do not split evenly"):
        device_shares(Settings(processes=3, backend="minilm"))


# -- a hung child (issue 34, item 3): the verdict from the probes' answers, with an injected clock --------------
def test_a_child_is_hung_only_after_the_whole_threshold_of_silence():
    from batchserve.http.liveness import ChildLiveness

    live = ChildLiveness(hang_s=3.0, last_answer=100.0)
    assert not live.hung(102.9) and live.silent_for(102.9) == pytest.approx(2.9)
    assert live.hung(103.0)
    live.answered(102.95)  # a late answer still counts: the loop turned
    assert not live.hung(105.9) and live.hung(105.95)
    live.answered(101.0)  # an answer older than the newest changes nothing
    assert live.last_answer == 102.95
    assert not ChildLiveness(hang_s=0.0, last_answer=0.0).hung(1e9)  # 0: never


def test_a_busy_child_answering_slowly_within_the_threshold_is_never_hung():
    """A loop that answers every probe 2.5 s late (the prober waits up to the threshold for each) is alive;
    one that stops answering is hung the threshold after its last answer, whatever a probe in flight does."""
    from batchserve.http.liveness import PROBE_EVERY_S, ChildLiveness

    now, live = 0.0, ChildLiveness(hang_s=3.0, last_answer=0.0)
    for _ in range(20):  # each probe: sent, answered 2.5 s later, the next sent PROBE_EVERY_S after the send
        for t in (0.5, 1.0, 1.5, 2.0, 2.5):
            assert not live.hung(now + t)
        now += 2.5
        live.answered(now)
        now += max(0.0, PROBE_EVERY_S - 2.5)
    stopped_at = now
    assert not live.hung(stopped_at + 2.99) and live.hung(stopped_at + 3.0)


def test_the_prober_counts_only_silence_and_stops_when_told():
    """Its thread with a stand-in probe: answers (and refusals, which `probe` reports as answers) keep the
    child alive; silence makes it hung after hang_s; the host 0.0.0.0 is probed on loopback."""
    import threading
    import time

    from batchserve.http.liveness import Prober

    answering = threading.Event()
    answering.set()
    asked: list[tuple[str, int]] = []

    def ask(host: str, port: int, timeout_s: float) -> bool:
        asked.append((host, port))
        return answering.is_set()

    prober = Prober("0.0.0.0", 9999, hang_s=1.0, ask=ask).start()
    try:
        time.sleep(1.3)
        assert not prober.hung() and asked[0] == ("127.0.0.1", 9999)
        answering.clear()
        deadline = time.monotonic() + 10
        while not prober.hung() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert prober.hung() and prober.silent_for() >= 1.0
    finally:
        prober.stop()
    n = len(asked)
    time.sleep(1.2)
    assert len(asked) <= n + 1  # stopped: at most the probe in flight


def test_a_real_probe_tells_silence_from_an_answer_and_a_closed_port():
    """`probe` against real sockets: a listener that never answers (what a stopped process's port does: the
    kernel accepts, nobody reads) is silence; a closed port is not; an HTTP answer is an answer."""
    import socket
    import threading

    from batchserve.http.liveness import probe

    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    talker = socket.socket()
    talker.bind(("127.0.0.1", 0))
    talker.listen()

    def answer() -> None:
        conn, _ = talker.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
        conn.close()

    t = threading.Thread(target=answer)
    t.start()
    try:
        assert probe("127.0.0.1", talker.getsockname()[1], 5.0) is True
        assert probe("127.0.0.1", closed_port, 1.0) is True
        assert probe("127.0.0.1", mute.getsockname()[1], 0.3) is False
    finally:
        t.join(5)
        mute.close()
        talker.close()
