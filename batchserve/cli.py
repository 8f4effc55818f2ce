"""`batchserve serve`: flags generated from `config.Settings`, each with a BATCHSERVE_* twin.

Exit codes: 0 after a clean stop, 1 when the server could not start (one line says why), 2 for a usage or
configuration mistake (caught before the port opens), for a backend that cannot load or warm (after the port
opened: /healthz answers while the models load) and for `batchserve` with no command (it prints help).

A mistake prints one line (`batchserve serve: error: ...`), never the whole usage: with ~60 flags the usage
buries the line that matters.

`batchserve infer` and `batchserve jobs` are the client side (client_cli.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import logging
import os
import sys
from typing import NoReturn

from batchserve import client_cli, logsafe, plan_command
from batchserve.config import Settings, cli_fields, did_you_mean, flag_name
from batchserve.config_env import env_name, env_values
from batchserve.core.tiers import CALLER_NAMES
from batchserve.jobs.store import is_postgres_url, redact_url
from batchserve.knobs import GROUPS

log = logging.getLogger("batchserve")


MODEL_ENV = "BATCHSERVE_MODEL"  # --model's twin: [name=]PATH, several separated by commas


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        action="append",
        metavar="[NAME=]PATH",
        help="serve a Hugging Face model folder, or a hub id from the local cache (offline), by "
        "task: embeddings, generation, reranking or classification, read from the folder (--task overrides); "
        "repeatable; the first is the default model unless --backend is given "
        f"(docs/backends.md) [env {MODEL_ENV}, comma-separated]",
    )
    for group in GROUPS:  # one section of -h per group of knobs
        title, _, what = (group.__doc__ or "").partition(": ")
        section = parser.add_argument_group(title.lower(), what)
        for f in dataclasses.fields(group):
            flag = flag_name(f.name)
            shown = "the backend's name" if f.name == "model_name" else repr(f.default)  # as the README's table
            help_text = f"{f.metadata['help']} [env {env_name(f.name)}; default {shown}]"
            if isinstance(f.default, bool):
                section.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            else:
                section.add_argument(
                    flag, type=type(f.default), default=None, choices=f.metadata.get("choices"), help=help_text
                )


def settings_from(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Settings:
    """Defaults, then BATCHSERVE_* variables, then flags; every mistake is a ValueError naming its source."""
    from batchserve.backends import backend_name_problem

    values, given = env_values(environ)
    for f in cli_fields():
        value = getattr(args, f.name, None)
        if value is not None:
            values[f.name] = value
            given[f.name] = flag_name(f.name)
    settings = Settings(**values, given=given)
    default_models = settings.models
    if settings.config:
        from batchserve.config_file import apply_config_file

        apply_config_file(settings, settings.config)  # its [[models]] are checked there, with their lines
    from_env = (os.environ if environ is None else environ).get(MODEL_ENV, "")
    paths = list(getattr(args, "model", None) or []) or [p.strip() for p in from_env.split(",") if p.strip()]
    if paths:
        from batchserve.backends.hf import folder_spec

        task = "" if settings.task == "auto" else settings.task
        kept = settings.models if settings.models is not default_models or "backend" in given else []
        settings.models = kept + [folder_spec(p, task) for p in paths]
        settings.model_paths = paths
        if not kept:  # the folder is the default model: say so in the settings line, not "backend=sim"
            settings.backend, settings.model_name = "hf", settings.models[0].name
    if any(spec.backend == "hf" for spec in settings.models):
        from batchserve.backends.hf import resolve_folders

        resolve_folders(settings)  # the task of each folder; one line and exit 2 for one it cannot serve
    problem = backend_name_problem(settings.backend)
    if problem:
        raise ValueError(f"{settings.source('backend')}: {problem}")
    if is_postgres_url(settings.jobs_db) and importlib.util.find_spec("psycopg") is None:
        # said now, not as a 503 on every /v1/batches of a server that turned ready
        raise ValueError(
            f"{settings.source('jobs_db')}: a postgresql:// job store needs psycopg, not installed "
            f"here: pip install 'batchserve[postgres]'"
        )
    settings.check()
    return settings


DERIVABLE = ("slo_ms", "timeout_ms")  # left unset, each model's derived from its own measured warm-up (warmup.py)


def effective(settings: Settings) -> str:
    """The settings line. An unset SLO or timeout is marked provisional: a model whose warm-up is measured gets
    its own."""
    shown = {f.name: getattr(settings, f.name) for f in cli_fields() if f.name != "config" or settings.config}
    shown["models"] = [m.id for m in settings.models]
    shown["jobs_db"] = redact_url(settings.jobs_db)  # a postgresql:// URL may carry a password
    provisional = [name for name in DERIVABLE if name not in settings.given]
    for name in provisional:
        shown[name] = f"{shown[name]}(provisional)"
    note = (
        f"; {' and '.join(provisional)} provisional: unset, each model's own derived from its measured warm-up "
        f"where it has one ('deadlines of MODEL ...' below)"
        if provisional
        else ""
    )
    return " ".join(f"{k}={v}" for k, v in shown.items()) + note


def version() -> str:
    try:
        return importlib.metadata.version("batchserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        from batchserve import __version__

        return __version__


class Parser(argparse.ArgumentParser):
    """argparse, but a mistake is its one line and a pointer to -h."""

    def error(self, message: str) -> NoReturn:
        fail(self.prog, f"{message} (see '{self.prog} -h')")


def flag_hints(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """' (did you mean '--max-batch-size'?)' for each mistyped flag close to a known one (Python 3.11's argparse
    suggests nothing)."""
    known = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    return "".join(did_you_mean(word.split("=", 1)[0], known) for word in extra if word.startswith("--"))


def fail(prog: str, message: str) -> NoReturn:
    """One line on stderr, exit status 2 (a usage or configuration mistake)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


def quiet_progress_bars(stderr_is_tty: bool) -> None:
    """No tqdm bars in a log file or a container's log: each redraw is a line there. Before transformers is
    imported (it reads the variable once); a terminal keeps them; an explicit setting wins."""
    if stderr_is_tty:
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = Parser(prog="batchserve", description="Dynamic-batching inference server")
    parser.add_argument("--version", action="version", version=f"batchserve {version()}")
    sub = parser.add_subparsers(dest="command", metavar="{serve,keys,plan,infer,jobs}", parser_class=Parser)
    serve_parser = sub.add_parser("serve", help="run the HTTP server")
    add_settings_flags(serve_parser)
    keys_parser = sub.add_parser("keys", help="manage API keys in the config file")
    keys_sub = keys_parser.add_subparsers(dest="keys_command", metavar="{add}")
    add = keys_sub.add_parser("add", help="create a key, print it once, store only its SHA-256 digest")
    add.add_argument("--config", required=True, help="TOML config file to append the key to")
    add.add_argument("--tenant", required=True)
    add.add_argument("--tier", required=True, choices=CALLER_NAMES)
    add.add_argument("--rate", type=float, default=None, help="requests per second, overriding the tier's")
    add.add_argument("--admin", action="store_true", help="the key sees every tenant's figures at GET /v1/usage")
    add.add_argument(
        "--best-tier",
        choices=CALLER_NAMES,
        default=None,
        help="the highest tier a request may ask for (priority, service_tier); default: the key's --tier",
    )
    plan_parser = sub.add_parser(
        "plan",
        help="nodes needed for a target rate at the SLO, predicted p50/p95 and headroom (docs/capacity.md)",
        description=plan_command.DESCRIPTION,
        formatter_class=plan_command.HelpFormatter,
    )
    plan_command.add_arguments(plan_parser)
    infer_parser = sub.add_parser(
        "infer", help="send one input to a server, print its output (retries 503/429 as the server asks)"
    )
    client_cli.add_infer_arguments(infer_parser)
    jobs_parser = sub.add_parser(
        "jobs", help="batch jobs on a server: submit a file (--wait: watch it to the end), get, results, cancel"
    )
    jobs_parsers = client_cli.add_jobs_arguments(jobs_parser)
    return parser, {
        "serve": serve_parser,
        "keys": keys_parser,
        "add": add,
        "plan": plan_parser,
        "infer": infer_parser,
        "jobs": jobs_parser,
        **{f"jobs {k}": v for k, v in jobs_parsers.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser, parsers = build_parser()
    args, extra = parser.parse_known_args(argv)
    name = f"jobs {args.jobs_command}" if getattr(args, "jobs_command", None) else args.command or ""
    if extra:  # said by the command's own parser, whose -h lists its flags
        own = parsers.get(name, parser)
        own.error(f"unrecognized arguments: {' '.join(extra)}{flag_hints(own, extra)}")

    if args.command is None or getattr(args, f"{args.command}_command", "") is None:  # `keys`, `jobs` alone
        # A bare command shows what it can do, on stderr, with the usage-error status.
        (parser if args.command is None else parsers[args.command]).print_help(sys.stderr)
        return 2

    if args.command == "plan":
        return plan_command.main(args)

    if args.command in ("infer", "jobs"):
        return client_cli.run(parsers[name].prog, args)

    if args.command == "keys":
        return add_key(args, parsers["add"])
    return run_serve(args, parsers["serve"])


def add_key(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`batchserve keys add`: a new key printed once, its digest appended to the config file."""
    from batchserve.config_file import append_key
    from batchserve.http.guards import digest, new_key

    key = new_key()
    try:
        append_key(args.config, args.tenant, args.tier, digest(key), args.rate, args.admin, args.best_tier)
    except (ValueError, OSError) as exc:
        parser.error(f"{exc} (the file was not changed)")
    print(key)
    print(f"(stored only its SHA-256 digest in {args.config}; this is the one time the key is shown)", file=sys.stderr)
    return 0


def run_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`batchserve serve`: settings checked and logs set up before the port opens, then one process or children."""
    try:
        settings = settings_from(args)
    except (ValueError, OSError) as exc:
        fail(parser.prog, str(exc))
    quiet_progress_bars(sys.stderr.isatty())
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logsafe.install()  # one record, one line: a caller's control characters are escaped
    log.info("settings: %s", effective(settings))
    if settings.grpc_port >= 0:  # an unfit grpcio or protobuf is one line before the port opens, not a traceback
        from batchserve.kserve.grpc_messages import GrpcUnavailable, load

        try:
            load()
        except GrpcUnavailable as exc:
            print(f"batchserve: error: {exc}", file=sys.stderr)
            return 2
    from batchserve.backends import sleeping_idle_threads

    sleeping_idle_threads()  # before any model (or a --processes child) loads torch
    from batchserve.app import create_app

    if settings.processes > 1:  # the children load the models, each on its share of the devices
        from batchserve.generation.inference import stepper_models
        from batchserve.http.processes import serve_processes

        try:
            return serve_processes(settings, create_app, tuple(stepper_models(settings)))
        except (ValueError, OSError) as exc:
            print(f"batchserve: error: {exc}", file=sys.stderr)
            return 2 if isinstance(exc, ValueError) else 1
    if os.getcwd() not in sys.path:  # `--backend mymodel:batch` finds mymodel.py here (searched last)
        sys.path.append(os.getcwd())
    # The port opens at once and the backends warm behind it: a plugin that cannot serve still says why in one
    # line and the process exits 2, rather than listening with /readyz 503 forever.
    from batchserve.backends import PluginError, resolve_backend

    try:  # a name that cannot be imported is known in a moment: said before the port opens
        for spec in settings.models:
            resolve_backend(spec.backend)
    except PluginError as exc:
        print(f"batchserve: error: {exc}", file=sys.stderr)
        return 2
    from batchserve.http.server import serve

    return serve(settings, create_app)


if __name__ == "__main__":
    sys.exit(main())
