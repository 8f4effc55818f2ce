"""The TOML config file (`--config`): models and versions. Tiers and keys join it with tenancy."""

from __future__ import annotations

import tomllib

from batchserve.config import ModelSpec, Settings


def apply_config_file(settings: Settings, path: str) -> None:
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    models = data.get("models")
    if models:
        settings.models = [
            ModelSpec(
                name=str(m["name"]),
                version=str(m.get("version", "v1")),
                backend=str(m.get("backend", "sim")),
                sim_batch_ms=float(m.get("sim_batch_ms", settings.sim_batch_ms)),
                weight=float(m.get("weight", 100)),
            )
            for m in models
        ]
