"""The adapter from a user's plugin (docs/backends.md) to the server's `Backend` protocol.

Everything a plugin may get wrong in its shape (constructor options, the batch callable's or an optional method's
parameters, `max_batch_size`) is found here, once, before the server turns ready; what it gets wrong at run time
is the worker pool's business (`backends.check_outputs`).

What the plugin names may be:
- a function taking `inputs` (and optionally `device`): the batch function itself;
- a function taking no positional argument: a factory, called with the options as keyword arguments;
- a class: instantiated with the options as keyword arguments, or through its classmethod
  `from_settings(spec, settings)` when it has one (batchserve-aware plugins, such as the built-ins, read the
  server's flags so);
- any other object: used as it is.
The object's batch method is `batch`, or the object itself when it is callable.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, TypeGuard
from collections.abc import Callable

from batchserve.backends import OUTPUT_KINDS, Backend, PluginError, Resolved, describe, resolve_backend
from batchserve.config import ModelSpec, Settings

WARM_UP_INPUTS = ["warm-up"]  # what a plugin without its own warm() is warmed with
# The plugin's own methods the backend takes as they are, with the parameter each must take: no extra frame on the
# hot path (bucket_of, cost_of), and only a plugin that declares cost_of_batch or tokenize has the attribute the
# door looks for (core/service.BatchCoster, core/tokenize_stage.py).
OWN_METHODS = (
    ("bucket_of", "text"),
    ("count_tokens", "texts"),
    ("cost_of", "text"),
    ("cost_of_batch", "texts"),
    ("tokenize", "texts"),
)


def _accepts(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return False
    except ValueError:  # no signature to read (some builtins): trust it
        return True
    return True


def _shows(fn: Callable[..., Any]) -> str:
    try:
        return f"{getattr(fn, '__qualname__', type(fn).__name__)}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return repr(fn)


def _takes_device(fn: Callable[..., Any]) -> bool:
    try:
        return "device" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _needs_an_argument(fn: Callable[..., Any]) -> bool:
    """True for `def batch(inputs)`, False for a factory such as `def make(*, threshold=0.5)` or `make(**kw)`."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params)


def _is_function(obj: object) -> TypeGuard[Callable[..., Any]]:
    return inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.ismethod(obj)


@dataclass
class PluginBackend:
    """`Backend` over a plugin object: device indices become the plugin's device names; the plugin's own
    `OWN_METHODS` replace the defaults below (`adapt` sets them on the instance)."""

    source: Resolved
    plugin: object
    devices: list[str]
    batch_fn: Callable[..., list]
    output_kind: str = "json"
    max_batch_size: int | None = None
    initial_batch_s: float | None = None
    setup_fn: Callable[[str], Any] | None = None
    warm_fn: Callable[..., Any] | None = None
    warm_takes_device: bool = False
    _runs: list[Callable[[list[str]], list]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # One bound callable per device, so a batch costs one call, not a signature decision.
        takes_device = _takes_device(self.batch_fn)
        self._runs = [
            functools.partial(self.batch_fn, device=d) if takes_device else self.batch_fn for d in self.devices
        ]

    def device_names(self) -> list[str]:
        return list(self.devices)

    def setup(self, device: int) -> None:
        if self.setup_fn is not None:
            self.setup_fn(self.devices[device])

    def warm(self, device: int) -> dict[int, float] | None:
        if self.warm_fn is None:
            self.run(device, list(WARM_UP_INPUTS))
            return None
        timings = self.warm_fn(self.devices[device]) if self.warm_takes_device else self.warm_fn()
        if isinstance(timings, dict) and all(
            isinstance(k, int) and isinstance(v, int | float) for k, v in timings.items()
        ):
            return {k: float(v) for k, v in timings.items()}
        return None

    def run(self, device: int, inputs: list[str]) -> list:
        return self._runs[device](inputs)

    def bucket_of(self, text: str) -> int:
        return 0

    def cost_of(self, text: str) -> float:
        return 1.0

    def count_tokens(self, texts: list[str]) -> list[int] | None:
        return None


def build(resolved: Resolved, spec: ModelSpec, settings: Settings, shell: bool = False) -> object:
    """The plugin object built with the model's options. `shell`: the server-side twin of a plugin whose batches
    run elsewhere, a class's `shell(settings)` (no model) when it has one, else the plugin itself."""
    target, options = resolved.target, spec.options
    if inspect.isclass(target):
        if shell and callable(make_shell := getattr(target, "shell", None)):
            # shell(settings), or shell(settings, spec) for a backend that serves many models (`hf`: a folder)
            args = (settings, spec) if _accepts(make_shell, settings, spec) else (settings,)
            maker: Callable[..., object] = functools.partial(make_shell, *args)
        elif callable(from_settings := getattr(target, "from_settings", None)):
            maker = functools.partial(from_settings, spec, settings)
        else:
            if not _accepts(target, **options):
                raise resolved.error(
                    f"the options {sorted(options)} do not fit the constructor "
                    f"{target.__name__}{inspect.signature(target)}"
                )
            maker = functools.partial(target, **options)
    elif _is_function(target):
        if _needs_an_argument(target):  # the batch function itself (its signature is checked in adapt)
            if options:
                raise resolved.error(f"a plain batch function takes no options, got {sorted(options)}")
            return target
        if not _accepts(target, **options):
            raise resolved.error(
                f"wrong signature {_shows(target)}: a batch function takes (inputs) or "
                f"(inputs, device); a factory takes the options {sorted(options)} as keywords"
            )
        maker = functools.partial(target, **options)
    else:
        if options:
            raise resolved.error(f"an object instance takes no options, got {sorted(options)}")
        return target
    try:
        return maker()
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - reported in one line, then exit 2
        raise resolved.error(f"building the plugin raised {describe(exc)}") from None


def adapt(resolved: Resolved, spec: ModelSpec, settings: Settings, shell: bool = False) -> PluginBackend:
    """Build the plugin and check its shape; PluginError names what does not fit."""
    obj = build(resolved, spec, settings, shell)
    err = resolved.error
    plain = _is_function(obj)
    batch_fn = _batch_function(obj, plain, err)

    def optional(name: str, *args: Any) -> Callable[..., Any] | None:
        fn = None if plain else getattr(obj, name, None)
        if fn is None:
            return None
        if not callable(fn):
            raise err(f"{name} is not callable")
        if args and not _accepts(fn, *args):
            raise err(f"wrong signature {_shows(fn)}: {name} takes ({', '.join(args)})")
        return fn

    setup_fn = optional("setup", "device")
    own = {name: optional(name, arg) for name, arg in OWN_METHODS}
    warm_fn = optional("warm")
    warm_takes_device = warm_fn is not None and _accepts(warm_fn, "device")
    if warm_fn is not None and not warm_takes_device and not _accepts(warm_fn):
        raise err(f"wrong signature {_shows(warm_fn)}: warm takes () or (device)")

    max_batch, kind, initial = _declared(obj, err)
    devices = _devices(None if plain else obj, settings, err)
    backend = PluginBackend(
        resolved, obj, devices, batch_fn, kind, max_batch, initial, setup_fn, warm_fn, warm_takes_device
    )
    for name, fn in own.items():
        if fn is not None:
            setattr(backend, name, fn)
    return backend


def _batch_function(obj: object, plain: bool, err: Callable[[str], Exception]) -> Callable[..., list]:
    """The plugin's batch function: a plain function itself, else its batch method, else the object if callable."""
    if plain:
        batch_fn: Callable[..., list] = obj  # type: ignore[assignment]  # a plain function is the batch function
    else:
        found = getattr(obj, "batch", None)
        if found is None and callable(obj) and not inspect.isclass(obj):
            found = obj
        if not callable(found):
            raise err(f"{type(obj).__name__} has no batch(inputs) method and is not callable")
        batch_fn = found
    if not (_accepts(batch_fn, []) or _accepts(batch_fn, [], device="")):
        raise err(f"wrong signature {_shows(batch_fn)}: the batch method takes (inputs) or (inputs, device)")
    return batch_fn


def _declared(obj: object, err: Callable[[str], Exception]) -> tuple[int | None, str, float | None]:
    """What the plugin declares of itself: max_batch_size, output_kind, initial_batch_s (each checked)."""
    max_batch = getattr(obj, "max_batch_size", None)
    if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1):
        raise err(f"max_batch_size must be a positive integer, not {max_batch!r}")
    kind = getattr(obj, "output_kind", "json")  # undeclared: any JSON value (a plugin may answer objects)
    if kind not in OUTPUT_KINDS:
        raise err(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, not {kind!r}")
    initial = getattr(obj, "initial_batch_s", None)
    if initial is not None and (isinstance(initial, bool) or not isinstance(initial, int | float) or initial <= 0):
        raise err(f"initial_batch_s must be a positive number of seconds, not {initial!r}")
    return max_batch, kind, float(initial) if initial is not None else None


def _devices(obj: object | None, settings: Settings, err: Callable[[str], Exception]) -> list[str]:
    """The plugin's devices (a list, or a method returning one); by default `--devices` CPU workers."""
    given = getattr(obj, "devices", None)
    if given is None:
        n = max(1, settings.devices)
        return ["cpu"] if n == 1 else [f"cpu:{i}" for i in range(n)]
    if callable(given):
        try:
            given = given()
        except (Exception, SystemExit) as exc:  # noqa: BLE001
            raise err(f"devices() raised {describe(exc)}") from None
    if not isinstance(given, list | tuple) or not given or not all(isinstance(d, str) and d for d in given):
        raise err(f"devices must be a non-empty list of device names, not {given!r}")
    return list(given)


def make_backend(spec: ModelSpec, settings: Settings, shell: bool = False) -> Backend:
    """Resolve, build and adapt one model version's backend; PluginError when it cannot be served. With
    `--executor process` its batches run in a process per device (process.py); `shell`: see `build`."""
    resolved = resolve_backend(spec.backend)
    if shell:
        return adapt(resolved, spec, settings, shell=True)
    if settings.executor == "process":
        from batchserve.backends.process import ProcessBackend

        try:
            return ProcessBackend.start(spec, settings, adapt(resolved, spec, settings, shell=True), make_local_backend)
        except PluginError:
            raise
        except Exception as exc:  # noqa: BLE001 - a child that could not build the backend: one line
            raise resolved.error(f"the device process failed: {describe(exc)}") from None
    return adapt(resolved, spec, settings)


def make_local_backend(spec: ModelSpec, settings: Settings) -> PluginBackend:
    """The backend in this process (what a device process builds for its one device)."""
    return adapt(resolve_backend(spec.backend), spec, settings)
