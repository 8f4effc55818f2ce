"""Which model version serves a request: `"name"` picks a version by weight, `"name@version"` names one; and
each version's own latency objective and timeouts (`slo.Deadlines`)."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

from batchserve.config import ModelSpec
from batchserve.slo import Deadlines


@dataclass
class ModelRegistry:
    specs: list[ModelSpec]
    by_id: dict[str, ModelSpec] = field(default_factory=dict)
    by_name: dict[str, list[ModelSpec]] = field(default_factory=dict)
    # What a request naming no model, a name of one version or an id is answered by: its version's id, read by
    # one look-up on the hot path (`resolve_id`); names of several versions are split as `resolve` splits them.
    fixed_ids: dict[str, str] = field(default_factory=dict)
    # Each model id's own SLO and timeouts; the batcher, admission and the guard read this same dict (the
    # runtime shares it), so a figure derived after the warm-up is seen by all of them at once.
    deadlines: dict[str, Deadlines] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for spec in self.specs:
            if spec.id in self.by_id:
                raise ValueError(f"model {spec.id} is configured twice")
            self.by_id[spec.id] = spec
            self.by_name.setdefault(spec.name, []).append(spec)
        self.fixed_ids.update((model_id, model_id) for model_id in self.by_id)
        for name, versions in self.by_name.items():
            if len(versions) == 1 and "@" not in name:  # a name with "@" is read as an id by `resolve`
                self.fixed_ids[name] = versions[0].id
        if self.specs and self.default.name in self.fixed_ids:
            self.fixed_ids[""] = self.fixed_ids[self.default.name]

    @property
    def default(self) -> ModelSpec:
        return self.specs[0]

    def resolve(self, requested: str | None, sticky_key: str = "") -> ModelSpec | None:
        """The version to serve, or None when unknown. A caller with a key always lands on the same version
        of a name (sticky canary split); an anonymous caller is split at random by weight."""
        if not requested:
            requested = self.default.name
        if "@" in requested:
            return self.by_id.get(requested)
        versions = self.by_name.get(requested)
        if not versions:
            return None
        if len(versions) == 1:
            return versions[0]
        total = sum(v.weight for v in versions)
        if sticky_key:
            digest = hashlib.sha256(f"{sticky_key}|{requested}".encode()).digest()
            point = int.from_bytes(digest[:8], "big") / 2**64 * total
        else:
            point = random.random() * total
        for v in versions:
            point -= v.weight
            if point < 0:
                return v
        return versions[-1]

    def resolve_id(self, requested: str | None, sticky_key: str = "") -> str | None:
        """`resolve`'s version id: the id of the version that serves `requested`, or None when unknown."""
        found = self.fixed_ids.get(requested or "")
        if found is not None:
            return found
        spec = self.resolve(requested, sticky_key)
        return spec.id if spec is not None else None
