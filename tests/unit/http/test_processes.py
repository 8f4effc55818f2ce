"""How `--processes N` splits the devices, in process (the real processes are tests/integration/http/test_processes.py)."""

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
