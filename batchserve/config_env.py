"""A knob's value from the environment: each `Settings` field that has a flag has a BATCHSERVE_* twin (its name
upper-cased), read as the field's type; flags given on the command line win over these (`cli.py`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from batchserve.config import cli_fields


def env_name(field_name: str) -> str:
    return "BATCHSERVE_" + field_name.upper()


TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")
KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def coerce(f: dataclasses.Field, raw: str) -> Any:
    """A variable's text as the field's type; a ValueError says what was expected (the caller names where)."""
    kind: type[Any] = type(f.default)
    if kind is bool:
        word = raw.strip().lower()
        if word not in TRUE + FALSE:
            raise ValueError(f"expected {KIND_NAMES[bool]} (1/0, yes/no, on/off)")
        return word in TRUE
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"expected {KIND_NAMES[kind]}") from None


def env_values(environ: Mapping[str, str] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Values from BATCHSERVE_* variables, and the variable that set each; a bad value is a ValueError that names
    the variable."""
    env = os.environ if environ is None else environ
    values, given = {}, {}
    for f in cli_fields():
        name = env_name(f.name)
        if name in env:
            try:
                values[f.name] = coerce(f, env[name])
            except ValueError as exc:
                raise ValueError(f"{name}={env[name]!r}: {exc}") from None
            given[f.name] = name
    return values, given
