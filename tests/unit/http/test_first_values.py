"""How every listener reads a repeated header or metadata entry (`http/plumbing.first_values`): the first wins."""

from __future__ import annotations

from batchserve.http.plumbing import first_values


def test_a_repeated_header_or_metadata_entry_reads_as_its_first():
    """HTTP and gRPC read a caller's key alike: the first `authorization` entry, whichever followed it."""
    pairs = [("Authorization", "Bearer a"), ("x-request-id", "r1"), ("authorization", "Bearer b"), ("k-bin", b"\0")]
    assert first_values(pairs, ("authorization", "x-request-id", "k-bin")) == {
        "authorization": "Bearer a",
        "x-request-id": "r1",
    }
