"""What the KServe v2 surfaces read of the runtime, over HTTP and gRPC alike, and the model a call names."""

from __future__ import annotations

from typing import Protocol

from batchserve import errors
from batchserve.backends import Backend
from batchserve.config import ModelSpec
from batchserve.http.model_choice import ModelRegistry
from batchserve.core.service import InferenceService
from batchserve.errors import ApiError
from batchserve.http.endpoint import Served


class KServeHost(Served, Protocol):
    """The runtime as both v2 surfaces see it (app.py wires `app.state.rt`; `start_grpc` takes the same): this
    much only."""

    registry: ModelRegistry
    service: InferenceService
    backends: dict[str, Backend]

    def not_ready_reason(self) -> str | None: ...  # /readyz's reason; None when ready


def find_model(rt: KServeHost, name: str, version: str | None, where: str = "", field: str = "name") -> ModelSpec:
    """The model named: `name` (its versions split by weight, as `model` on /v1/inference) or `name` + `version`
    (an empty version is none); a 404 in v2's words when unknown, ending with `where` (where to look). An empty
    name (only gRPC can send one: HTTP's v2 paths always name a model) is a 400 naming `field`: none is picked."""
    if not name:
        raise errors.invalid(f"'{field}' is required: the model to call (see ServerMetadata and ModelMetadata)")
    spec = rt.registry.by_id.get(f"{name}@{version}") if version else rt.registry.resolve(name)
    if spec is None:
        raise ApiError(
            404,
            "MODEL_NOT_FOUND",
            f"unknown model '{errors.short(name)}'"
            + (f" version '{errors.short(version)}'" if version else "")
            + where,
        )
    return spec
