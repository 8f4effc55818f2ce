"""Every knob of the server in one dataclass (`Settings`, the knob groups of `knobs.py` at once), with its flag and
its BATCHSERVE_* twin.

Each field's metadata carries its help text; `cli.py` turns the fields into argparse flags and `config_env.py`
reads their BATCHSERVE_* twins, so the flag list, the environment names and the defaults cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
from dataclasses import dataclass, field
from typing import Any

from batchserve.knobs import (
    GROUPS,
    BatchKnobs,
    DoorKnobs,
    GenerationKnobs,
    JobKnobs,
    ModelKnobs,
    Problems,
    SimKnobs,
)


def is_postgres_url(location: str) -> bool:
    """`--jobs-db` names a PostgreSQL database (shared by many nodes) rather than a SQLite file."""
    return location.startswith(("postgresql://", "postgres://"))


@dataclass
class ModelSpec:
    """One servable model version; batches never mix two of these."""

    name: str
    version: str = "v1"
    backend: str = "sim"
    sim_batch_ms: float = 100.0
    weight: float = 100.0  # share of its name's traffic among versions (canary split)
    options: dict[str, Any] = field(default_factory=dict)  # [models.options]: keyword arguments of the plugin
    path: str = ""  # backend "hf": a Hugging Face model folder, or a hub id in the local cache (--model)
    task: str = ""  # backend "hf": embeddings, generation, reranking or classification; "" = read from the folder
    # name@version: what batches, metrics and the ledger key the version by. Made once, not per read: every
    # request reads it.
    id: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.id = f"{self.name}@{self.version}"

    @property
    def generates(self) -> bool:
        """Whether the generation engine serves this model (smollm2, or a causal LM folder)."""
        return self.backend == "smollm2" or (self.backend == "hf" and self.task == "generation")


@dataclass(frozen=True)
class ChildPlace:
    """Which of `--processes` this server is, and the port where it alone answers."""

    index: int
    of: int
    own_port: int


@dataclass
class Settings(GenerationKnobs, JobKnobs, SimKnobs, ModelKnobs, BatchKnobs, DoorKnobs):
    """The knobs of every group (their flags in the groups' order: the door first), and what the config file and
    `--model` add, which have no flag."""

    models: list[ModelSpec] = field(default_factory=list, metadata={"cli": False})
    model_paths: list[str] = field(default_factory=list, metadata={"cli": False})  # --model [name=]PATH, repeated
    keys: list[dict] = field(default_factory=list, metadata={"cli": False})  # [[keys]] of the config file
    # [[keys]] storage_mb of the config file: a tenant's byte quota in place of --tenant-storage-mb
    tenant_storage_mb_by_tenant: dict[str, float] = field(default_factory=dict, metadata={"cli": False})
    tier_rates: dict[str, tuple[float, float]] = field(default_factory=dict, metadata={"cli": False})
    process_slot: ChildPlace | None = field(default=None, metadata={"cli": False})  # set in --processes' children
    # Where each value the user set came from ("--port", "BATCHSERVE_PORT", "bs.toml:3 models[0].backend"):
    # errors name it, and knobs the user did not set may be derived (slo_ms and timeout_ms from the warm-up).
    given: dict[str, str] = field(default_factory=dict, metadata={"cli": False})

    def __post_init__(self) -> None:
        if not self.model_name:
            self.model_name = default_model_name(self.backend)
        if not self.models:
            self.models = [ModelSpec(self.model_name, self.model_version, self.backend, self.sim_batch_ms)]

    def source(self, name: str) -> str:
        """How the user names a knob: where its value came from, else its flag."""
        return self.given.get(name) or flag_name(name)

    def check(self) -> None:
        """Refuse settings that cannot work, with a sentence a person can act on that names the flag, variable
        or config key the value came from: each group's own rules, then those across groups."""
        p = Problems(self, self.source)
        for group in GROUPS:
            group.check_knobs(self, p)
        for f in cli_fields():
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                p.found.append(
                    f"{self.source(f.name)} must be one of {', '.join(choices)} (got "
                    f"{getattr(self, f.name)!r}){did_you_mean(str(getattr(self, f.name)), choices)}"
                )
        if self.processes > 1 and "jobs_db" in self.given and self.jobs_db and not is_postgres_url(self.jobs_db):
            p.found.append(
                f"{self.source('jobs_db')} is a SQLite file, which belongs to one process: with "
                f"{self.source('processes')} {self.processes} use a postgresql:// URL the processes "
                f"share, or an empty value (no batch jobs)"
            )
        if self.processes > 1 and self.devices and self.devices % self.processes:
            p.found.append(
                f"{self.source('devices')} {self.devices} does not split evenly over "
                f"{self.source('processes')} {self.processes} (each process gets the same number)"
            )
        if not self.keys and not self.allow_anonymous and not is_loopback(self.host):
            p.found.append(f"serving on {self.host} with no API keys needs --allow-anonymous (or [[keys]] in --config)")
        if p.found:
            raise ValueError("; ".join(p.found))


def default_model_name(backend: str) -> str:
    """A model's name when none is given: the backend's name, or for `package.module:attribute` the module's
    last part (`examples.sentiment:KeywordSentiment` serves as `sentiment`)."""
    if ":" in backend:
        return backend.partition(":")[0].rpartition(".")[2] or backend
    return backend


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cli_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(Settings) if f.metadata.get("cli", True)]


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def did_you_mean(word: str, choices: Any) -> str:
    """' (did you mean 'x'?)' when a choice is close to `word`, else ''."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
