"""Backends: where a batch runs. Two faces, one adapter between them (`plugin.PluginBackend`, signatures checked
once at start-up):

- the plugin contract (docs/backends.md, "Serve your own model") is what a user writes: a plain function
  `batch(inputs: list[str]) -> list`, or an object with `batch(inputs[, device])` and optional methods. The
  built-ins (`sim`, `smollm2`, `minilm`, `hf`) are plugins too;
- `Backend` below is what the worker pool, the batcher and the routes call: device indices, every method present.

Batches are budgeted, timed and admitted by cost (`cost_of`: tokens for the built-ins, 1 per input for a plugin
that declares none); a backend may also declare `cost_of_batch(texts)` (`core/service.BatchCoster`) when a batch's
cost is not rows x its longest input's.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol
from collections.abc import Callable, Iterator

import orjson

from batchserve.config import did_you_mean

if TYPE_CHECKING:
    from batchserve.config import Settings

ENTRY_POINT_GROUP = "batchserve.backends"
OUTPUT_KINDS = ("text", "json", "embedding")  # "embedding": each output is a list of floats (/v1/embeddings)


@dataclass
class RunningBatch:
    """The batch a worker thread runs; `stopped_early` (the backend was told its callers are gone) means its
    time says nothing about the model."""

    callers_gone: Callable[[], bool]
    stopped_early: bool = False


_current = threading.local()


@contextlib.contextmanager
def running_batch(callers_gone: Callable[[], bool]) -> Iterator[RunningBatch]:
    """Set by the worker thread around `backend.run`: the batch `all_callers_gone` reports on."""
    batch = RunningBatch(callers_gone)
    _current.batch = batch
    try:
        yield batch
    finally:
        _current.batch = None


def default_threads(processes: int = 1, decode: bool = False) -> int:
    """torch's intra-op threads on a CPU: every usable core, split among `processes` (at least one each). The
    event loop needs little beside the model (docs/backends.md), so it gets no core of its own;
    `sleeping_idle_threads` keeps the threads off its core between ops. `decode`: a causal LM's decode steps (a
    few rows of small products) keep one core free, since on 2 cores a second thread made them slower."""
    cores = max(1, len(os.sched_getaffinity(0)) // processes)
    return max(1, cores - 1) if decode else cores


def cache_root(settings: Settings | None = None) -> Path:
    """Where extracted weights live: `--weights-cache`, else $BATCHSERVE_CACHE_DIR (an alias), else
    $XDG_CACHE_HOME/batchserve, else ~/.cache/batchserve."""
    if settings is not None and "weights_cache" in settings.given and settings.weights_cache:
        return Path(os.path.expanduser(settings.weights_cache))
    if os.environ.get("BATCHSERVE_CACHE_DIR"):
        return Path(os.environ["BATCHSERVE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "batchserve"


def sleeping_idle_threads() -> None:
    """Let OpenMP threads sleep between ops (OMP_WAIT_POLICY=PASSIVE) unless the environment says otherwise: a
    spinning thread holds a core the event loop or a neighbour needs (on a loaded 2-core machine spinning
    threads served a third as many inputs). Call it before torch loads: the OpenMP runtime reads it once."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pick_devices(requested: int) -> list[str]:
    """The first `requested` CUDA GPUs (0 = all of them), or the CPU when there is none."""
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        n = requested or count
        if n > count:
            raise ValueError(f"--devices {n} but only {count} CUDA devices are visible")
        return [f"cuda:{i}" for i in range(n)]
    return ["cpu"]


def all_callers_gone() -> bool:
    """True when no caller of the running batch waits for its output any more; False outside a batch. A backend
    that works in steps may ask between steps and return early (any outputs: they are thrown away)."""
    batch: RunningBatch | None = getattr(_current, "batch", None)
    if batch is None or not batch.callers_gone():
        return False
    batch.stopped_early = True
    return True


class Backend(Protocol):
    """A model as the server drives it. `run` is called from device `device`'s own thread, one batch at a
    time per device; `setup` and `warm` run on that same thread before the first batch. `warm` may return the
    batch seconds by batch cost it measured, which seed the learned batch time (`core/batch.py`)."""

    # Read-only (properties): a plain attribute fits.
    @property
    def source(self) -> Resolved: ...  # what the configured name pointed at, for messages
    @property
    def output_kind(self) -> str: ...  # one of OUTPUT_KINDS
    @property
    def max_batch_size(self) -> int | None: ...  # the most inputs this model takes in one batch, or None for none
    @property
    def initial_batch_s(self) -> float | None: ...  # a known batch time; None: learned, from the warm-up's duration

    def device_names(self) -> list[str]: ...
    def setup(self, device: int) -> None: ...
    def warm(self, device: int) -> dict[int, float] | None: ...
    def run(self, device: int, inputs: list[str]) -> list: ...
    def bucket_of(self, text: str) -> int: ...
    def cost_of(self, text: str) -> float: ...
    def count_tokens(self, texts: list[str]) -> list[int] | None: ...


class PluginError(ValueError):
    """A backend that cannot be served, said in one line: which backend, module, attribute, and why."""

    def __init__(self, backend: str, module: str, attribute: str, cause: str) -> None:
        self.backend, self.module, self.attribute = backend, module, attribute
        self.cause = " ".join(cause.split())  # one line, whatever the plugin's exception said
        where = f"module {module!r}, attribute {attribute!r}: " if module else ""
        super().__init__(f"backend {backend!r}: {where}{self.cause}")


@dataclass(frozen=True)
class Resolved:
    """What a backend name points at: the object, and where it came from (for messages)."""

    name: str
    module: str
    attribute: str
    target: object

    def error(self, cause: str) -> PluginError:
        return PluginError(self.name, self.module, self.attribute, cause)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# The built-in backends as pyproject.toml registers them (a test checks), so a source tree that was never
# pip-installed (no entry-point metadata) finds them too.
BUILTIN = {
    "sim": "batchserve.backends.sim:SimBackend",
    "smollm2": "batchserve.backends.smollm2:SmolLM2Backend",
    "minilm": "batchserve.backends.minilm:MiniLM",
    "hf": "batchserve.backends.hf:HFModel",
}


def installed_names() -> list[str]:
    return sorted({ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)} | set(BUILTIN))


def resolve_backend(name: str) -> Resolved:
    """Import what `package.module:attribute` (the attribute may be dotted) or an installed entry point names;
    PluginError when it cannot."""
    if ":" in name:
        module, _, attribute = name.partition(":")
        if not module or not attribute:
            raise PluginError(name, module, attribute, "expected package.module:attribute")
    else:
        found = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP, name=name))
        if found:
            module, attribute = found[0].module, found[0].attr
        elif name in BUILTIN:
            module, _, attribute = BUILTIN[name].partition(":")
        else:
            raise PluginError(
                name,
                "",
                "",
                f"unknown backend: not an installed entry point of group "
                f"{ENTRY_POINT_GROUP!r} (installed: {', '.join(installed_names())}), "
                f"nor package.module:attribute",
            )
    try:
        target: object = importlib.import_module(module)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any import failure is reported, not raised
        raise PluginError(name, module, attribute, f"cannot import the module: {describe(exc)}") from None
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise PluginError(name, module, attribute, f"the module has no attribute {part!r}") from None
    return Resolved(name, module, attribute, target)


# What each built-in model backend needs from the `model` extra, so a missing one fails the start at once with
# the install command rather than later with "No module named 'torch'".
NEEDS_MODEL_EXTRA = {
    "smollm2": ("torch", "transformers", "gguf"),
    "minilm": ("torch", "transformers", "tokenizers"),
    "hf": ("torch", "transformers", "tokenizers"),
}
MODEL_EXTRA_HINT = "pip install 'batchserve[model]' (README: Install)"


def backend_name_problem(name: str) -> str | None:
    """Why `name` cannot name a backend, or None, checked before anything is imported (a name with ':' is left to
    `resolve_backend`)."""
    if ":" in name:
        return None
    installed = installed_names()
    if name not in installed:
        return f"unknown backend {name!r}{did_you_mean(name, installed)} (installed: {', '.join(installed)})"
    missing = [m for m in NEEDS_MODEL_EXTRA.get(name, ()) if importlib.util.find_spec(m) is None]
    if missing:
        return f"backend {name!r} needs {', '.join(missing)}, not installed here: {MODEL_EXTRA_HINT}"
    return None


# -- checking what a backend answered ------------------------------------------------------------------------------
# What a backend's answer to a batch must be, per output kind, checked once per batch on the worker thread: an
# output goes to its caller as it is, so without this a NaN would become a wrong 200 or break the encoding. The
# same rules check the warm-up batch (`check_warm_answer`), so a wrong plugin fails at start, not on a caller:
#
# - `text`: a string (encodable as UTF-8: no lone surrogate);
# - `json`: any JSON value but a top-level null, with no NaN or infinity anywhere in it;
# - `embedding`: a list of finite numbers, every one of the model's dimension (the warm-up's vector length).
#
# The common case costs one pass (json: one `orjson.dumps`, walking the outputs only when it holds a `null`,
# where orjson puts NaN and infinity). A batch that is not a list of n outputs fails whole (bisected by the
# pool); a bad output fails its own input only.
NUMBER_TYPES = frozenset({float, int})


@dataclass
class OutputRule:
    """The rule a model's outputs are held to; `dims` (embeddings) is None until the warm-up batch shows it."""

    kind: str = "json"
    dims: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in OUTPUT_KINDS:
            raise ValueError(f"output kind {self.kind!r} is not one of {', '.join(OUTPUT_KINDS)}")


ANY_JSON = OutputRule("json")


def check_outputs(outputs: object, n: int, rule: OutputRule = ANY_JSON) -> tuple[str | None, dict[int, str]]:
    """Why `outputs` is no answer to n inputs at all (or None), and the outputs that break the rule, by index
    (short messages, never the output itself). An exception in an output's place is the backend's verdict on
    that input (docs/backends.md): its text is the message."""
    if not isinstance(outputs, list):
        return f"backend returned {type(outputs).__name__}, not a list", {}
    if len(outputs) != n:
        return f"backend returned {len(outputs)} outputs for {n} inputs", {}
    problem, bad = _check_kind(outputs, rule)
    for i in bad:
        if isinstance(outputs[i], BaseException):
            bad[i] = f"{type(outputs[i]).__name__}: {outputs[i]}"
    return problem, bad


def _check_kind(outputs: list, rule: OutputRule) -> tuple[str | None, dict[int, str]]:
    if rule.kind == "embedding":
        return None, _bad_vectors(outputs, rule.dims)
    if rule.kind == "text":
        bad = {i: f"output is {type(o).__name__}, not text" for i, o in enumerate(outputs) if type(o) is not str}
        if bad:
            return None, bad
    try:
        encoded = orjson.dumps(outputs)
    except orjson.JSONEncodeError:
        return _bad_encodings(outputs)
    if b"null" in encoded:  # a None, or a NaN or infinity (orjson writes those as null too): find which
        return None, {i: why for i, o in enumerate(outputs) if (why := _not_finite_json(o))}
    return None, {}


def _bad_encodings(outputs: list) -> tuple[str | None, dict[int, str]]:
    bad: dict[int, str] = {}
    for i, output in enumerate(outputs):
        try:
            orjson.dumps([output])  # nested one level, as in the answer's body
        except orjson.JSONEncodeError as exc:
            bad[i] = f"output {type(output).__name__} is not JSON-encodable ({str(exc)[:200]})"
    if not bad:  # only the whole fails (nesting depth): no single culprit
        return "backend returned outputs that cannot be JSON-encoded together", {}
    return None, bad | {i: why for i, o in enumerate(outputs) if i not in bad and (why := _not_finite_json(o))}


def _not_finite_json(output: object) -> str:
    """Why an encodable output is still no answer (a top-level null, a NaN or infinity inside), or ""."""
    if output is None:
        return "output is null"
    stack = [output]
    while stack:
        value = stack.pop()
        if type(value) is float and not math.isfinite(value):
            return f"output holds {value!r}, which JSON cannot carry"
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)
    return ""


def _bad_vectors(outputs: list, dims: int | None) -> dict[int, str]:
    bad: dict[int, str] = {}
    # No dimension known (the warm-up check raised): the first vector sets it, so a batch never mixes lengths.
    want = dims if dims is not None else next((len(o) for o in outputs if isinstance(o, list)), 0)
    for i, v in enumerate(outputs):
        if not isinstance(v, list):
            bad[i] = f"output is {type(v).__name__}, not a vector (a list of floats)"
        elif len(v) != want or not v:
            bad[i] = f"output is a vector of {len(v)} numbers; this model's have {want}"
        elif not set(map(type, v)) <= NUMBER_TYPES:  # bool is its own type: True is not a number here
            kinds = sorted(t.__name__ for t in set(map(type, v)) - NUMBER_TYPES)
            bad[i] = f"output is a vector holding {', '.join(kinds)}, not only numbers"
        elif not math.isfinite(sum(v)) and not all(map(math.isfinite, v)):  # the sum may overflow: then look
            bad[i] = "output is a vector holding NaN or infinity"
    return bad


def check_warm_answer(outputs: object, n: int, rule: OutputRule) -> str | None:
    """What is wrong with the warm-up batch's answer (its first bad output), or None; learns an embedding
    model's dimension from its first vector."""
    first = outputs[0] if isinstance(outputs, list) and outputs else None
    if rule.kind == "embedding" and rule.dims is None and isinstance(first, list) and first:
        rule.dims = len(first)
    problem, bad = check_outputs(outputs, n, rule)
    if problem is not None:
        return f"the warm-up batch of {n} input(s) got a wrong answer: {problem}"
    if bad:
        i, why = next(iter(bad.items()))
        return f"the warm-up batch got a wrong answer for input {i} of {n} (output kind {rule.kind!r}): {why}" + (
            f" ({len(bad) - 1} more)" if len(bad) > 1 else ""
        )
    return None
