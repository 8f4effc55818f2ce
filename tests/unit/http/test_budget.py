"""The descriptor budget split between the listeners (`http/budget.py`): with gRPC on, HTTP's cap leaves gRPC's
share, so the two together stay under the descriptor limit; a configured cap is taken as it is."""

from __future__ import annotations

from batchserve.http.budget import split


def test_a_limit_of_20000_split_between_http_and_grpc():
    both = split(20000, 0, 0, grpc_on=True)
    assert (both.total, both.http, both.grpc) == (17500, 13125, 4375)
    assert split(20000, 0, 0, grpc_on=False).http == 17500  # gRPC off: HTTP holds the whole budget


def test_together_they_stay_under_the_limit_whatever_the_limit():
    for limit in (64, 256, 1024, 4096, 20000, 1 << 20):
        b = split(limit, 0, 0, grpc_on=True)
        assert b.http + b.grpc <= b.total < limit and b.grpc >= 16, (limit, b)


def test_configured_caps_are_taken_as_they_are():
    assert split(20000, 0, 50, grpc_on=True).http == 17450  # HTTP takes what gRPC's configured cap leaves
    b = split(20000, 1000, 0, grpc_on=True)
    assert (b.http, b.grpc) == (1000, 4375)
    assert split(None, 0, 0, grpc_on=True).grpc == 16384  # unlimited descriptors: a budget of 65,536
