"""What a backend's answer to a batch must be, per output kind, checked once per batch on the worker thread.

Why: an output goes to its caller as it is, so a wrong one used to become a wrong 200: a NaN or a None
became `"output": null`, an "embedding" of strings or of the wrong length went out, and an infinite float
broke the base64 encoding with a 500 in the wrong shape. Each kind has one rule, and the same rules check
the warm-up batch before the port opens (`check_warm_answer`), so a plugin that answers wrongly fails at
start with one line rather than on the first caller:

- `text`: a string (encodable as UTF-8: no lone surrogate);
- `json`: any JSON value but a top-level null, with no NaN or infinity anywhere in it;
- `embedding`: a list of finite numbers, every one of the model's dimension (the warm-up's vector length).

The common case costs one pass: a type check per output (text), one `orjson.dumps` of the batch (json; the
outputs are walked only when the encoding holds a `null`, which is where orjson puts NaN and infinity), or a
set of element types and a sum per vector (embedding). A batch that is not a list of n outputs is a problem
of the whole batch (bisected by the pool); a bad output fails its own input only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import orjson

from batchserve.backends import OUTPUT_KINDS

NUMBER_TYPES = frozenset({float, int})


@dataclass
class OutputRule:
    """The rule a model's outputs are held to: its kind, and for embeddings the vector length (None until
    the warm-up batch has shown it)."""

    kind: str = "json"
    dims: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in OUTPUT_KINDS:
            raise ValueError(f"output kind {self.kind!r} is not one of {', '.join(OUTPUT_KINDS)}")


ANY_JSON = OutputRule("json")


def check_outputs(outputs: object, n: int, rule: OutputRule = ANY_JSON) -> tuple[str | None, dict[int, str]]:
    """Why `outputs` is not an answer to n inputs at all (None when it is), and the outputs among it that
    break the rule, by index (each message short: a type and an index, never the output itself). An exception
    object in an output's place is the backend's own verdict on that input (docs/backends.md): its text is
    the message."""
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
    for i, output in enumerate(outputs):
        if i not in bad and (why := _not_finite_json(output)):
            bad[i] = why
    return None, bad


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
    # No dimension known (the warm-up check raised): the batch's first vector sets it, so at least a batch
    # never mixes lengths.
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
    """The warm-up batch's answer checked as every batch's will be; a sentence saying what is wrong with it
    (the first bad output), or None. An embedding model's dimension is learned here, from its first vector."""
    if (
        rule.kind == "embedding"
        and rule.dims is None
        and isinstance(outputs, list)
        and outputs
        and isinstance(outputs[0], list)
        and outputs[0]
    ):
        rule.dims = len(outputs[0])
    problem, bad = check_outputs(outputs, n, rule)
    if problem is not None:
        return f"the warm-up batch of {n} input(s) got a wrong answer: {problem}"
    if bad:
        i, why = next(iter(bad.items()))
        return f"the warm-up batch got a wrong answer for input {i} of {n} (output kind {rule.kind!r}): {why}" + (
            f" ({len(bad) - 1} more)" if len(bad) > 1 else ""
        )
    return None
