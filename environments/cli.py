"""The command line of every environment, derived from its config dataclasses.

    python -m environments.arithmetic_server serve [--config cfg.yaml] [--env.FIELD V] [--openai.FIELD V]
    python -m environments.arithmetic_server process --env.total_steps N \\
        --env.data_path_to_save_groups out.jsonl
    python -m environments.arithmetic_server evaluate [--openai.base_url URL]

Each field of the env config (`--env.*`) and of ServerConfig (`--openai.*`) becomes one flag, with
the help text from the field's metadata, built by environments/config_flags.py like the trainer's
and the API's flags (`--env.use_wandb` alone is true, or `--env.use_wandb true|false`; `none`
unsets an optional field). Precedence: the environment's defaults (config_init) < YAML (`env:` and
`openai:` sections of --config) < flags given on the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from environments.clients import RequestFailed
from environments.config_flags import add_dataclass_flags, coerce, config_fields, errors_to_parser

logger = logging.getLogger("onecopy.env")

COMMANDS = {
    "serve": "generate groups and post them to the trajectory API (until total_steps or the trainer's end)",
    "process": "generate total_steps groups and write them to data_path_to_save_groups, without the API",
    "evaluate": "run the environment's evaluation once and log its metrics",
}


def environment_module(name: str) -> str:
    """The module that runs environment `name`: environments/<name>_server.py for a bare name
    (`arithmetic`), or `name` itself when it is a dotted module path (`my_pkg.my_env_server`), so
    the launcher and mode colocate run an environment that lives outside this package."""
    return name if "." in name else f"environments.{name}_server"


def build_parser(env_cls: type) -> argparse.ArgumentParser:
    """The argparse parser of `env_cls`: subcommands serve/process/evaluate, same flags each."""
    env_defaults, server_defaults = env_cls.config_init()
    module = sys.modules.get(env_cls.__module__)
    spec = getattr(module, "__spec__", None)  # run with -m, __module__ is "__main__"
    prog = f"python -m {spec.name if spec else env_cls.__module__}"
    parser = argparse.ArgumentParser(prog=prog, description=env_cls.__doc__, allow_abbrev=False)
    subs = parser.add_subparsers(dest="command", required=True, metavar="{serve,process,evaluate}")
    for command, help_text in COMMANDS.items():
        sub = subs.add_parser(
            command,
            help=help_text,
            description=help_text,
            allow_abbrev=False,
            usage=f"{prog} {command} [--config FILE] [--env.FIELD VALUE ...] [--openai.FIELD VALUE ...]",
        )
        sub.add_argument("--config", type=Path, default=None, help="YAML with `env:` and `openai:` sections")
        for namespace, defaults in (("env", env_defaults), ("openai", server_defaults)):
            group = sub.add_argument_group(f"--{namespace}.* ({type(defaults).__name__})")
            add_dataclass_flags(group, type(defaults), defaults, prefix=f"{namespace}.", name_style="snake")
    return parser


def _yaml_overrides(path: Path, sections: dict[str, type]) -> dict[str, dict[str, Any]]:
    """{namespace: {field: value}} from a YAML file, each value checked against its field type."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping with `env:` and `openai:` sections")
    unknown = set(data) - set(sections)
    if unknown:
        raise ValueError(f"--config {path}: unknown section(s) {sorted(unknown)}; known: {sorted(sections)}")
    out: dict[str, dict[str, Any]] = {}
    for namespace, cls in sections.items():
        section = data.get(namespace) or {}
        if isinstance(section, list) and len(section) == 1:  # Atropos writes `openai:` as a list of one
            section = section[0]
        if not isinstance(section, dict):
            raise ValueError(f"--config {path}: `{namespace}:` must be a mapping")
        known = config_fields(cls)
        out[namespace] = {}
        for key, value in section.items():
            if key not in known:
                raise ValueError(f"--config {path}: unknown key {namespace}.{key}")
            tp, spec = known[key]
            try:
                out[namespace][key] = coerce(value, tp, spec.metadata.get("choices"))
            except ValueError as exc:
                raise ValueError(f"--config {path}: {namespace}.{key}: {exc}") from None
    return out


def parse_configs(env_cls: type, argv: Optional[list[str]] = None):
    """Parse argv into (command, env config, server config); exits with a message on bad input."""
    parser = build_parser(env_cls)
    args = vars(parser.parse_args(argv))
    env_defaults, server_defaults = env_cls.config_init()
    sections = {"env": type(env_defaults), "openai": type(server_defaults)}
    try:
        merged = _yaml_overrides(args["config"], sections) if args["config"] else {"env": {}, "openai": {}}
    except ValueError as exc:
        parser.error(str(exc))
    for key, value in args.items():
        if "." in key:
            namespace, name = key.split(".", 1)
            merged[namespace][name] = value
    configs = []
    for namespace, defaults in (("env", env_defaults), ("openai", server_defaults)):
        with errors_to_parser(parser, prefix=f"{namespace}.", name_style="snake"):
            configs.append(dataclasses.replace(defaults, **merged[namespace]))
    env_config, server_config = configs
    if args["command"] == "process":
        if env_config.total_steps is None:
            parser.error("process needs --env.total_steps N (the number of groups to write)")
        if not env_config.data_path_to_save_groups:
            parser.error("process needs --env.data_path_to_save_groups FILE.jsonl")
        if Path(env_config.data_path_to_save_groups).exists():
            path = env_config.data_path_to_save_groups
            parser.error(f"--env.data_path_to_save_groups {path} exists; pass a new path")
    return args["command"], env_config, server_config


def run_cli(env_cls: type, argv: Optional[list[str]] = None, make_env: Optional[Callable] = None) -> Any:
    """Parse the command line and run the subcommand of `env_cls` to the end. A request that no
    retry can fix (environments.clients.RequestFailed) ends it with one error line and exit code 1,
    which the launcher shows from the end of env.log."""
    command, env_config, server_config = parse_configs(env_cls, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # it logs every request at INFO
    env = (make_env or env_cls)(env_config, server_config)
    runner = {"serve": env.env_manager, "process": env.process_manager, "evaluate": env.run_evaluate}[command]
    try:
        return asyncio.run(runner())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return None
    except RequestFailed as err:  # the server's answer says it all: one line, last in the log, no traceback
        logger.error("[env] stopped: %s", err)
        raise SystemExit(1) from err
