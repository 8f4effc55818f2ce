"""Which model answers a request for work only some models do (embeddings, reranking, classification): the one it
names, or the first served that does that work. One function for every such route and for batch lines, so a batch
line lands on the model its online route would pick."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from batchserve import errors
from batchserve.backends import Backend
from batchserve.config import ModelSpec, Settings
from batchserve.core.service import InferenceService
from batchserve.http.endpoint import Call
from batchserve.http.guards import Guard
from batchserve.http.openai_error import bad, no_model, unknown_model
from batchserve.slo import Deadlines


# Which model version serves a request: `"name"` picks a version by weight, `"name@version"` names one.
@dataclass
class ModelRegistry:
    specs: list[ModelSpec]
    by_id: dict[str, ModelSpec] = field(default_factory=dict)
    by_name: dict[str, list[ModelSpec]] = field(default_factory=dict)
    # No model, a name of one version, or an id -> its version's id: one look-up on the hot path (`resolve_id`).
    fixed_ids: dict[str, str] = field(default_factory=dict)
    # Shared by the batcher, admission and the guard, so a figure derived after warm-up is seen by all at once.
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
        """The id of the version that serves `requested`, or None when unknown."""
        found = self.fixed_ids.get(requested or "")
        if found is not None:
            return found
        spec = self.resolve(requested, sticky_key)
        return spec.id if spec is not None else None


class Models(Protocol):
    """What the choice reads from the runtime: the configured versions and the loaded backends."""

    registry: ModelRegistry
    backends: dict[str, Backend]


class EncoderHost(Models, Protocol):
    """What the encoder wings read from `app.state.rt`."""

    settings: Settings
    guard: Guard
    service: InferenceService


@dataclass(frozen=True)
class Task:
    """A kind of work: which versions do it (`does`), and the words of its refusals (`none_served`: the 404;
    `not_this`: the 400 for a version that does not; `reason`: OpenAI's finer code of that 400)."""

    does: Callable[[ModelSpec, Backend | None], bool]
    none_served: str
    not_this: Callable[[str, Backend], str]
    reason: str
    # Whether a version whose backend is still loading may turn out to do the task (its spec's word until then).
    may_do: Callable[[ModelSpec], bool] = lambda spec: True


def pick_model(rt: Models, task: Task, requested: str | None, sticky_key: str) -> tuple[str, Backend]:
    """The id of the model version that answers and its backend: 404 when unknown (or none does the task), 503
    while it warms up, 400 when it does not do the task."""
    if requested is None:
        by_id = rt.registry.by_id.items()
        doing = [spec for model_id, spec in by_id if task.does(spec, rt.backends.get(model_id))]
        if not doing:
            if any(model_id not in rt.backends and task.may_do(spec) for model_id, spec in by_id):
                raise errors.warming_up()  # which model embeds is known once the backends are loaded
            raise no_model(task.none_served)
        requested = doing[0].name
    spec = rt.registry.resolve(requested, sticky_key)
    if spec is None:
        raise unknown_model(requested)
    model_id = spec.id
    backend = rt.backends.get(model_id)
    if backend is None:
        raise errors.warming_up()
    if not task.does(spec, backend):
        raise bad("model", task.not_this(model_id, backend), task.reason)
    return model_id, backend


EMBEDDING = Task(
    does=lambda spec, backend: backend is not None and backend.output_kind == "embedding",
    none_served="no model serves embeddings here (see GET /v1/models)",
    not_this=lambda model_id, backend: (
        f"the model '{model_id}' does not produce embeddings (its outputs are {backend.output_kind}); use "
        "POST /v1/inference"
    ),
    reason="model_not_embedding",
    may_do=lambda spec: spec.task in ("", "embeddings"),  # a folder read as generation or reranking does not
)
RERANKING = Task(
    does=lambda spec, backend: spec.task == "reranking",
    none_served="no model serves reranking here (serve a cross-encoder folder with --model; see GET /v1/models)",
    not_this=lambda model_id, backend: f"the model '{model_id}' does not rerank (a cross-encoder folder does)",
    reason="model_not_reranker",
)
CLASSIFICATION = Task(
    does=lambda spec, backend: spec.task == "classification",
    none_served="no model serves classification here (serve a sequence-classification folder with --model; see "
    "GET /v1/models)",
    not_this=lambda model_id, backend: (
        f"the model '{model_id}' does not classify (a sequence-classification folder with its labels does)"
    ),
    reason="model_not_classifier",
)


def choose(
    rt: EncoderHost, call: Call, task: Task, model: str | None, timeout_s: float | None, tier: str | None
) -> Backend:
    """Pick the model (`pick_model`) and set it on the request's work, with the deadline (the body's `timeout_s`,
    else the model's default) and the tier it asked for."""
    model_id, backend = pick_model(rt, task, model, call.who.key_id)
    call.work.model = model_id
    call.work.due_in(rt.registry.deadlines[model_id].timeout_s if timeout_s is None else timeout_s)
    call.run_at(tier, "service_tier")
    return backend
