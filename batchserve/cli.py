"""`batchserve serve`: flags generated from `config.Settings`, each with a BATCHSERVE_* twin.

Exit codes: 0 after a clean stop, 1 when the server could not start (one line says why), 2 for a usage or
configuration mistake (caught before the port opens) and for `batchserve` with no command (it prints help).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import sys

from batchserve import plan
from batchserve.config import Settings, cli_fields, env_defaults, env_name, env_sources, flag_name
from batchserve.core.tiers import CALLER_NAMES
from batchserve.jobs.store import redact_url

log = logging.getLogger("batchserve")


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    defaults = Settings()
    for f in cli_fields():
        flag = flag_name(f.name)
        help_text = f"{f.metadata['help']} [env {env_name(f.name)}; default {getattr(defaults, f.name)!r}]"
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, type=type(f.default), default=None, choices=f.metadata.get("choices"),
                                help=help_text)


def settings_from(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Settings:
    """Defaults, then BATCHSERVE_* variables, then flags; every mistake is a ValueError naming its source."""
    from batchserve.backends import backend_name_problem

    values = env_defaults(environ)
    given = env_sources(environ)
    for f in cli_fields():
        value = getattr(args, f.name, None)
        if value is not None:
            values[f.name] = value
            given[f.name] = flag_name(f.name)
    settings = Settings(**values, given=given)
    if settings.config:
        from batchserve.config_file import apply_config_file

        apply_config_file(settings, settings.config)  # its [[models]] are checked there, with their lines
    problem = backend_name_problem(settings.backend)
    if problem:
        raise ValueError(f"{settings.source('backend')}: {problem}")
    settings.check()
    return settings


def effective(settings: Settings) -> str:
    shown = {f.name: getattr(settings, f.name) for f in cli_fields() if f.name != "config" or settings.config}
    shown["models"] = [m.id for m in settings.models]
    shown["jobs_db"] = redact_url(settings.jobs_db)  # a postgresql:// URL may carry a password
    return " ".join(f"{k}={v}" for k, v in shown.items())


def version() -> str:
    try:
        return importlib.metadata.version("batchserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        from batchserve import __version__

        return __version__


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog="batchserve", description="Dynamic-batching inference server")
    parser.add_argument("--version", action="version", version=f"batchserve {version()}")
    sub = parser.add_subparsers(dest="command", metavar="{serve,keys,plan}")
    serve_parser = sub.add_parser("serve", help="run the HTTP server")
    add_settings_flags(serve_parser)
    keys_parser = sub.add_parser("keys", help="manage API keys in the config file")
    keys_sub = keys_parser.add_subparsers(dest="keys_command", metavar="{add}")
    add = keys_sub.add_parser("add", help="create a key, print it once, store only its SHA-256 digest")
    add.add_argument("--config", required=True, help="TOML config file to append the key to")
    add.add_argument("--tenant", required=True)
    add.add_argument("--tier", required=True, choices=CALLER_NAMES)
    add.add_argument("--rate", type=float, default=None, help="requests per second, overriding the tier's")
    plan_parser = sub.add_parser("plan", help="nodes needed for a target rate at the SLO, predicted p50/p95 and "
                                              "headroom (docs/capacity.md)")
    plan.add_arguments(plan_parser)
    return parser, {"serve": serve_parser, "keys": keys_parser, "add": add}


def main(argv: list[str] | None = None) -> int:
    parser, parsers = build_parser()
    args = parser.parse_args(argv)

    if args.command is None or (args.command == "keys" and args.keys_command is None):
        # A bare command shows what it can do, on stderr, with the usage-error status.
        (parser if args.command is None else parsers["keys"]).print_help(sys.stderr)
        return 2

    if args.command == "plan":
        return plan.main(args)

    if args.command == "keys":
        from batchserve.config_file import append_key
        from batchserve.tenancy import digest, new_key

        key = new_key()
        try:
            append_key(args.config, args.tenant, args.tier, digest(key), args.rate)
        except (ValueError, OSError) as exc:
            parsers["add"].error(f"{exc} (the file was not changed)")
        print(key)
        print(f"(stored only its SHA-256 digest in {args.config}; this is the one time the key is shown)",
              file=sys.stderr)
        return 0

    try:
        settings = settings_from(args)
    except (ValueError, OSError) as exc:
        parsers["serve"].error(str(exc))
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    log.info("settings: %s", effective(settings))
    if settings.processes > 1:  # the children load the models, each on its share of the devices
        from batchserve.http.processes import serve_processes

        try:
            return serve_processes(settings)
        except (ValueError, OSError) as exc:
            print(f"batchserve: error: {exc}", file=sys.stderr)
            return 2 if isinstance(exc, ValueError) else 1
    from batchserve.backends.loading import PluginError, load_models

    if os.getcwd() not in sys.path:  # `--backend mymodel:batch` finds mymodel.py here (searched last)
        sys.path.append(os.getcwd())
    # Backends are built, set up and warmed before the port opens: a plugin that cannot serve says why in one
    # line and the process exits 2, instead of listening with /readyz 503 forever.
    try:
        loaded = load_models(settings)
    except PluginError as exc:
        print(f"batchserve: error: {exc}", file=sys.stderr)
        return 2
    from batchserve.http.server import serve

    return serve(settings, loaded)


if __name__ == "__main__":
    sys.exit(main())
