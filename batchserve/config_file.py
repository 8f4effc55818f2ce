"""The TOML config file (`--config`): models and versions, tier rates, API keys. See docs/configuration.md.

```toml
[[models]]             # one table per model version
name = "echo"
version = "v1"
backend = "sim"        # or "smollm2", "minilm", an installed plugin's name, "package.module:attribute"
sim_batch_ms = 100
weight = 90            # share of its name's traffic among versions (canary), sticky per API key
[models.options]       # keyword arguments for the plugin of the [[models]] table above (docs/backends.md)
threshold = 0.5
[tiers.free]           # also paid, enterprise: requests per second and burst per key
rate = 10
burst = 20
[[keys]]               # written by `batchserve keys add`; only the digest is stored
tenant = "acme"
tier = "paid"
sha256 = "<hex digest of the key>"
rate = 50              # optional per-key override (and burst)
```
"""

from __future__ import annotations

import json
import re
import tomllib

from batchserve.config import ModelSpec, Settings
from batchserve.core import tiers

HEX64 = re.compile(r"^[0-9a-f]{64}$")


def apply_config_file(settings: Settings, path: str) -> None:
    with open(path, "rb") as fh:
        try:
            data = tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: {exc}") from None
    models = data.get("models")
    if models:
        for m in models:
            if not isinstance(m.get("options", {}), dict):
                raise ValueError(f"{path}: options of model {m.get('name')!r} must be a table ([models.options])")
        settings.models = [
            ModelSpec(
                name=str(m["name"]),
                version=str(m.get("version", "v1")),
                backend=str(m.get("backend", "sim")),
                sim_batch_ms=float(m.get("sim_batch_ms", settings.sim_batch_ms)),
                weight=float(m.get("weight", 100)),
                options=dict(m.get("options", {})),
            )
            for m in models
        ]
    for tier, limits in data.get("tiers", {}).items():
        if tier not in tiers.NAMES:
            raise ValueError(f"{path}: unknown tier {tier!r} (tiers: {', '.join(tiers.NAMES)})")
        settings.tier_rates[tier] = (float(limits["rate"]), float(limits.get("burst", limits["rate"])))
    for k in data.get("keys", []):
        if k.get("tier") not in tiers.NAMES or not HEX64.match(str(k.get("sha256", ""))) or not k.get("tenant"):
            raise ValueError(f"{path}: each [[keys]] needs tenant, tier (one of {', '.join(tiers.NAMES)}) and a "
                             f"64-hex-digit sha256")
        settings.keys.append(dict(k))


def append_key(path: str, tenant: str, tier: str, sha256: str, rate: float | None) -> None:
    """Add a [[keys]] table to the file (created if missing); TOML basic strings are JSON strings."""
    lines = ["", "[[keys]]", f"tenant = {json.dumps(tenant)}", f"tier = {json.dumps(tier)}",
             f"sha256 = {json.dumps(sha256)}"]
    if rate is not None:
        lines.append(f"rate = {rate}")
    with open(path, "a", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
