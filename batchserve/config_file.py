"""The TOML config file (`--config`): models and versions, tier rates, API keys, in the format docs/configuration.md
shows (`[[models]]` with their `[models.options]`, `[tiers.<tier>]`, `[[keys]]`).

Strict: an unknown table or key, or a value of the wrong kind, is an error that names the file, the line and
the key (with a "did you mean" when a known key is close), so a misspelled `wieght` is not silently ignored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import tomllib
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

from batchserve.config import ModelSpec, Settings, cli_fields, did_you_mean, flag_name
from batchserve.core import tiers

HEX64 = re.compile(r"^[0-9a-f]{64}$")
ARRAY_HEADER = re.compile(r"^\[\[\s*(.+?)\s*\]\]")
TABLE_HEADER = re.compile(r"^\[\s*([^\[\]]+?)\s*\]")
KEY_LINE = re.compile(r"""^((?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*'))*)\s*=""")
KEY_PART = re.compile(r"""[A-Za-z0-9_-]+|"[^"]*"|'[^']*'""")

Path = tuple[str | int, ...]  # ("models", 0, "weight"), ("tiers", "free", "rate")


def _parts(dotted: str) -> list[str]:
    return [p.strip("\"'") for p in KEY_PART.findall(dotted)]


class Lines:
    """The line of each table and key of a TOML file, for error messages (tomllib keeps no positions). A key
    it cannot place (inside a multi-line value, an inline table) falls back to its enclosing table's line."""

    def __init__(self, text: str) -> None:
        self.at: dict[Path, int] = {}
        table: Path = ()
        arrays: dict[tuple[str, ...], int] = {}
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if m := ARRAY_HEADER.match(line):
                name = tuple(_parts(m.group(1)))
                arrays[name] = arrays.get(name, -1) + 1
                table = (*name, arrays[name])
            elif m := TABLE_HEADER.match(line):
                table = tuple(_parts(m.group(1)))
            elif m := KEY_LINE.match(line):
                self.at.setdefault((*table, *_parts(m.group(1))), number)
                continue
            else:
                continue
            self.at.setdefault(table, number)

    def line(self, path: Path) -> int | None:
        """The path's own line, else the first line inside it (`[a.b]` for a), else its table's line."""
        if path in self.at:
            return self.at[path]
        inside = [n for p, n in self.at.items() if p[: len(path)] == path]
        if inside:
            return min(inside)
        return next((self.at[path[:end]] for end in range(len(path) - 1, 0, -1) if path[:end] in self.at), None)


def show(path: Path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


@dataclass
class Checker:
    """Reads one parsed file against the schema, raising the first problem as `file:line: key: problem`."""

    path: str
    lines: Lines

    def fail(self, where: Path, problem: str) -> ValueError:
        line = self.lines.line(where)
        return ValueError(f"{self.path}:{line if line is not None else '?'}: {show(where)}: {problem}")

    def known(self, table: dict, where: Path, allowed: dict[str, Any]) -> None:
        for key in table:
            if key not in allowed:
                hint = did_you_mean(key, allowed)
                if not hint and key in {f.name for f in cli_fields()}:
                    hint = f" (server settings are flags or BATCHSERVE_* variables: {flag_name(key)})"
                where_word = f"in {show(where)}" if where else "at the top level"
                raise self.fail((*where, key), f"unknown key {key!r} {where_word}{hint}; known: {', '.join(allowed)}")

    def value(
        self,
        table: dict,
        where: Path,
        key: str,
        rule: Callable[[Any], str | None],
        default: Any = None,
        required: bool = False,
    ) -> Any:
        if key not in table:
            if required:
                raise self.fail(where, f"missing {key!r}")
            return default
        problem = rule(table[key])
        if problem is not None:
            raise self.fail((*where, key), f"{problem}, got {table[key]!r}")
        return table[key]

    def tables(self, data: dict, key: str) -> list[dict]:
        items = data.get(key, [])
        if not isinstance(items, list) or not all(isinstance(t, dict) for t in items):
            raise self.fail((key,), f"must be tables written [[{key}]]")
        return items


def expect(ok: Callable[[Any], object], expected: str) -> Callable[[Any], str | None]:
    """A rule: None when `ok(value)`, else what was expected."""
    return lambda value: None if ok(value) else f"expected {expected}"


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


text = expect(lambda v: isinstance(v, str) and v, "a non-empty string")
positive = expect(lambda v: _number(v) and v > 0, "a positive number")
non_negative = expect(lambda v: _number(v) and v >= 0, "a number, 0 or more")
boolean = expect(lambda v: isinstance(v, bool), "true or false")
a_table = expect(lambda v: isinstance(v, dict), "a table ([models.options])")
sha256_hex = expect(lambda v: isinstance(v, str) and HEX64.match(v), "64 lowercase hex digits")


def one_of(choices: tuple[str, ...]) -> Callable[[Any], str | None]:
    def rule(value: Any) -> str | None:
        if value in choices:
            return None
        return f"expected one of {', '.join(choices)}{did_you_mean(str(value), choices)}"

    return rule


def backend_name(value: Any) -> str | None:
    from batchserve.backends import backend_name_problem

    return text(value) or backend_name_problem(value)


# backends/folder.py's TASKS (config stays below backends)
FOLDER_TASKS = ("embeddings", "generation", "reranking", "classification")
TOP = {"models": "[[models]]", "tiers": "[tiers.<tier>]", "keys": "[[keys]]"}
MODEL_KEYS = {f.name: f for f in dataclasses.fields(ModelSpec) if f.init}
TIER_KEYS = {"rate": positive, "burst": positive}
KEY_KEYS = {
    "tenant": text,
    "tier": one_of(tiers.NAMES),
    "sha256": sha256_hex,
    "rate": positive,
    "burst": positive,
    "admin": boolean,
    "storage_mb": positive,
    "best_tier": one_of(tiers.CALLER_NAMES),  # the highest tier a request may ask for (`priority`); its tier if absent
}  # storage_mb: the tenant's byte quota, in place of --tenant-storage-mb


@dataclass
class ConfigFile:
    models: list[ModelSpec]
    tier_rates: dict[str, tuple[float, float]]
    keys: list[dict]
    storage_mb: dict[str, float] = field(default_factory=dict)  # tenant -> its byte quota ([[keys]] storage_mb)


def load(path: str, sim_batch_ms: float = 100.0) -> ConfigFile:
    """Parse and check the file; a ValueError names the file, the line and the key of the first problem."""
    with open(path, "rb") as fh:
        raw = fh.read()
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    c = Checker(path, Lines(raw.decode("utf-8")))
    c.known(data, (), TOP)
    keys, storage = read_keys(c, data)
    return ConfigFile(read_models(c, data, sim_batch_ms), read_tiers(c, data), keys, storage)


def read_models(c: Checker, data: dict[str, Any], sim_batch_ms: float) -> list[ModelSpec]:
    """[[models]]: each a version of its own, a folder only with backend "hf"."""
    models: dict[str, ModelSpec] = {}  # by id
    for i, m in enumerate(c.tables(data, "models")):
        where: Path = ("models", i)
        c.known(m, where, MODEL_KEYS)
        path = c.value(m, where, "path", text, "")
        spec = ModelSpec(
            name=c.value(m, where, "name", text, required=True),
            version=c.value(m, where, "version", text, "v1"),
            backend=c.value(m, where, "backend", backend_name, "hf" if path else "sim"),
            path=path,
            task=c.value(m, where, "task", one_of(FOLDER_TASKS), ""),
            sim_batch_ms=float(c.value(m, where, "sim_batch_ms", positive, sim_batch_ms)),
            weight=float(c.value(m, where, "weight", non_negative, 100)),
            options=dict(c.value(m, where, "options", a_table, {})),
        )
        if spec.backend == "hf" and not path:
            raise c.fail(where, "backend 'hf' serves a model folder: give its path = \"...\"")
        if path and spec.backend != "hf":
            raise c.fail((*where, "path"), f"path is for a model folder (backend 'hf'), not backend {spec.backend!r}")
        if spec.id in models:
            raise c.fail(where, f"{spec.id} is already [[models]] number {list(models).index(spec.id) + 1}")
        models[spec.id] = spec
    return list(models.values())


def read_tiers(c: Checker, data: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """[tiers.<tier>]: a tier's rate and burst."""
    tier_tables = data.get("tiers", {})
    if not isinstance(tier_tables, dict):
        raise c.fail(("tiers",), "must be tables written [tiers.<tier>]")
    tier_rates = {}
    for tier, limits in tier_tables.items():
        where = ("tiers", tier)
        if tier not in tiers.NAMES:
            raise c.fail(
                where, f"unknown tier {tier!r}{did_you_mean(tier, tiers.NAMES)} (tiers: {', '.join(tiers.NAMES)})"
            )
        if not isinstance(limits, dict):
            raise c.fail(where, "must be a table with rate (and burst)")
        c.known(limits, where, TIER_KEYS)
        rate = float(c.value(limits, where, "rate", positive, required=True))
        tier_rates[tier] = (rate, float(c.value(limits, where, "burst", positive, rate)))
    return tier_rates


def read_keys(c: Checker, data: dict[str, Any]) -> tuple[list[dict], dict[str, float]]:
    """[[keys]], and the byte quotas some of them set (storage_mb, by tenant)."""
    keys = []
    storage: dict[str, float] = {}
    for i, k in enumerate(c.tables(data, "keys")):
        where = ("keys", i)
        c.known(k, where, KEY_KEYS)
        for name, rule in KEY_KEYS.items():  # the required ones first
            c.value(k, where, name, rule, required=name in ("tenant", "tier", "sha256"))
        entry = dict(k)
        if "storage_mb" in entry:
            storage[entry["tenant"]] = float(entry.pop("storage_mb"))
        keys.append(entry)
    return keys, storage


def apply_config_file(settings: Settings, path: str) -> None:
    loaded = load(path, settings.sim_batch_ms)
    if loaded.models:
        settings.models = loaded.models
    settings.tier_rates.update(loaded.tier_rates)
    settings.keys.extend(loaded.keys)
    settings.tenant_storage_mb_by_tenant.update(loaded.storage_mb)


def append_key(
    path: str,
    tenant: str,
    tier: str,
    sha256: str,
    rate: float | None,
    admin: bool = False,
    best_tier: str | None = None,
) -> None:
    """Add a [[keys]] table to the file (created if missing); TOML basic strings are JSON strings. A file that
    does not pass `load` is left alone (ValueError): appending would bury its mistake under a new key."""
    with contextlib.suppress(FileNotFoundError):
        load(path)
    fields = {"tenant": tenant, "tier": tier, "sha256": sha256, "rate": rate, "admin": admin or None}
    fields["best_tier"] = best_tier  # each optional key written only when given
    lines = ["", "[[keys]]", *(f"{key} = {json.dumps(value)}" for key, value in fields.items() if value is not None)]
    with open(path, "a", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
