"""The command line of every environment, derived from its config dataclasses.

    python -m environments.arithmetic_server serve [--config cfg.yaml] [--env.FIELD V] [--openai.FIELD V]
    python -m environments.arithmetic_server process --env.total_steps N \\
        --env.data_path_to_save_groups out.jsonl
    python -m environments.arithmetic_server evaluate [--openai.base_url URL]

Each field of the env config (`--env.*`) and of ServerConfig (`--openai.*`) becomes one flag, with
the help text from the field's metadata. Precedence: the environment's defaults (config_init) <
YAML (`env:` and `openai:` sections of --config) < flags given on the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable, Optional, Union

import yaml

from environments.config import ConfigError

COMMANDS = {
    "serve": "generate groups and post them to the trajectory API (until total_steps or the trainer's end)",
    "process": "generate total_steps groups and write them to data_path_to_save_groups, without the API",
    "evaluate": "run the environment's evaluation once and log its metrics",
}
_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(inner type, whether None is allowed) for X or Optional[X]."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _describe(tp: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def coerce(value: Any, tp: Any) -> Any:
    """Convert a CLI string or a YAML value to the field type `tp`; ValueError says what was expected."""
    inner, nullable = _unwrap_optional(tp)
    if value is None or (nullable and isinstance(value, str) and value.lower() in ("none", "null")):
        if nullable:
            return None
        raise ValueError(f"expected {_describe(inner)}, got null")
    if inner not in (bool, int, float, str):
        raise TypeError(f"the CLI cannot parse fields of type {inner}")
    if isinstance(value, str) and inner is not str:
        text = value.strip().lower()
        if inner is bool and text in _TRUE | _FALSE:
            return text in _TRUE
        if inner in (int, float):
            try:
                return inner(text)
            except ValueError:
                pass
        raise ValueError(f"expected {_describe(inner)}, got {value!r}")
    # A YAML value already has a type: accept it only if it is the field's (ints count as floats).
    if inner is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, inner) and not (inner is int and isinstance(value, bool)):
        return value
    raise ValueError(f"expected {_describe(inner)}, got {value!r}")


def config_fields(cls: type) -> dict[str, tuple[Any, str]]:
    """{field name: (type, help)} of a config dataclass, types resolved."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f.metadata.get("help", "")) for f in dataclasses.fields(cls) if f.init}


def add_config_args(parser: argparse.ArgumentParser, cls: type, defaults: Any, namespace: str) -> None:
    """Add one `--<namespace>.<field>` flag per field of the dataclass `cls`."""
    group = parser.add_argument_group(f"--{namespace}.* ({cls.__name__})")
    for name, (tp, help_text) in config_fields(cls).items():

        def convert(text: str, tp: Any = tp) -> Any:
            try:
                return coerce(text, tp)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None

        is_bool = _unwrap_optional(tp)[0] is bool
        group.add_argument(
            f"--{namespace}.{name}",
            dest=f"{namespace}.{name}",
            type=convert,
            default=argparse.SUPPRESS,  # absent flags stay absent, so YAML values are kept
            nargs="?" if is_bool else None,
            const=True if is_bool else None,
            metavar="BOOL" if is_bool else name.upper(),
            help=f"{help_text} (default: {getattr(defaults, name)!r})",
        )


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
        add_config_args(sub, type(env_defaults), env_defaults, "env")
        add_config_args(sub, type(server_defaults), server_defaults, "openai")
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
            try:
                out[namespace][key] = coerce(value, known[key][0])
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
        try:
            configs.append(dataclasses.replace(defaults, **merged[namespace]))
        except ConfigError as exc:
            parser.error(f"--{namespace}.{exc.field}: {exc.message}")
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
    """Parse the command line and run the subcommand of `env_cls` to the end."""
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
