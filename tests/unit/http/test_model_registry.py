"""Which model version serves a request (`batchserve/config.py`): `resolve_id`, the hot path's look-up, names the
version `resolve` picks, for every kind of request: no model named, a name, an id, a canary split, an unknown."""

from __future__ import annotations

import collections

from batchserve.config import ModelSpec
from batchserve.http.model_choice import ModelRegistry


def test_resolve_id_names_the_version_resolve_picks() -> None:
    registry = ModelRegistry(
        [ModelSpec("echo"), ModelSpec("embed", "v2"), ModelSpec("chat", "a", weight=90), ModelSpec("chat", "b")]
    )
    for requested in (None, "", "echo", "echo@v1", "embed", "embed@v2", "chat@a", "chat@b"):
        spec = registry.resolve(requested, "key")
        assert spec is not None
        assert registry.resolve_id(requested, "key") == spec.id, requested
    for unknown in ("nope", "echo@v2", "@", "embed@"):
        assert registry.resolve(unknown) is None and registry.resolve_id(unknown) is None, unknown


def test_resolve_id_splits_a_name_of_several_versions_as_resolve_does() -> None:
    registry = ModelRegistry([ModelSpec("chat", "a", weight=90), ModelSpec("chat", "b", weight=10)])
    # A caller with a key always lands on the same version (sticky), the same one `resolve` gives it.
    for key in ("k1", "k2", "k3", "k4"):
        assert registry.resolve_id("chat", key) == registry.resolve("chat", key).id  # type: ignore[union-attr]
    # Anonymous callers are split at random by weight: both versions are served, the heavier one more often.
    seen = collections.Counter(registry.resolve_id("chat") for _ in range(2000))
    assert set(seen) == {"chat@a", "chat@b"} and seen["chat@a"] > seen["chat@b"]
    assert registry.resolve_id(None) in {"chat@a", "chat@b"}  # the default name is split too


def test_a_name_holding_an_at_sign_is_read_as_an_id_by_both() -> None:
    registry = ModelRegistry([ModelSpec("odd@name")])
    assert registry.resolve("odd@name") is None and registry.resolve_id("odd@name") is None
    assert registry.resolve_id("odd@name@v1") == "odd@name@v1"
    # No model named: the default's name, read as an id too (not served, as `resolve` says).
    assert registry.resolve(None) is None and registry.resolve_id(None) is None
