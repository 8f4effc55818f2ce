"""The static-KV decoder's batch buckets without a model (issue 13). The decoder itself, on a 2-layer random Llama and
on the real weights, is tests/integration/backends/test_static_decode.py."""

from __future__ import annotations

from batchserve.backends.static_decode import batch_buckets, bucket_up


def test_buckets() -> None:
    assert batch_buckets(100) == (1, 8, 16, 32, 64, 100)
    assert batch_buckets(40) == (1, 8, 16, 32, 40)
    assert batch_buckets(1) == (1,)
    assert bucket_up(64, (64, 128)) == 64 and bucket_up(65, (64, 128)) == 128 and bucket_up(129, (64, 128)) is None
