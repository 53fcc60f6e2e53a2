"""Command-line flags from a config dataclass: the one builder of the trainer, the API and the environments.

Each field becomes one flag; its help is the field's ``metadata["help"]`` and its default, and
``coerce`` checks its value. One syntax everywhere:

    --learning-rate 1e-5    int, float, str: the value
    --bf16-inplace          bool: bare = true, or --bf16-inplace true|false (also yes/no, on/off, 1/0)
    --wandb-group none      Optional[X]: none or null = None
    --optimizer adamw8bit   a field with metadata["choices"] takes only those
    --lr 1e-5               metadata["old_names"]: a flag's earlier spelling, still read (a user's script
                            keeps working), left out of --help, and named on stderr with the flag to use

A field with ``metadata["section"]`` (e.g. "advanced") is listed in ``--help`` under that heading,
after the fields without one: the common flags first, the rare knobs below.

The trainer and the API name flags ``--kebab-case``; the environments, like Atropos,
``--env.snake_case`` and ``--openai.snake_case`` (``prefix="env."``, ``name_style="snake"``).

Why here: the environments import nothing else of ours (tests/environments checks that), so the
one builder sits in the lowest package, where example_trainer, api and environments can all import
it. It imports only the standard library (tests/unit/test_config_flags.py checks that), so it
stays a leaf whatever the packages above it import.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shlex
import sys
import types
import typing
from typing import Any, Collection, Iterator, Optional, TypeVar, Union

T = TypeVar("T")
_TRUE, _FALSE, _NULL = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}, {"none", "null"}
_SCALARS = (bool, int, float, str)


class ConfigError(ValueError):
    """A config value is invalid; ``field`` is the dataclass field name, so the CLI can name its flag."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


def field(default: Any, help: str, **metadata: Any) -> Any:
    """A dataclass field whose ``help`` (and ``choices=``, if given) its flag shows and enforces."""
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


def config_fields(cls: type) -> dict[str, tuple[Any, dataclasses.Field]]:
    """{name: (resolved type, Field)} of the fields ``cls.__init__`` takes."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(cls) if f.init}


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(inner type, whether None is allowed) for X or Optional[X]."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _describe(tp: Any, choices: Optional[typing.Sequence] = None) -> str:
    if choices is not None:
        return "one of " + ", ".join(map(str, choices))
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _typed(value: Any, tp: type) -> Any:
    """``value`` as scalar type ``tp``; ValueError if it is not one."""
    if isinstance(value, str) and tp is not str:  # command-line text (or a quoted YAML string)
        text = value.strip().lower()
        if tp is bool and text in _TRUE | _FALSE:
            return text in _TRUE
        if tp in (int, float):
            return tp(text)
        raise ValueError
    # A YAML value already has a type: accept only the field's (an int counts as a float, a bool as neither).
    if isinstance(value, bool) and tp is not bool:
        raise ValueError
    if tp is float and isinstance(value, int):
        return float(value)
    if not isinstance(value, tp):
        raise ValueError
    return value


def coerce(value: Any, tp: Any, choices: Optional[typing.Sequence] = None) -> Any:
    """Command-line text or a YAML value as field type ``tp`` (bool, int, float, str or Optional of
    one), checked against ``choices``; the ValueError says what was expected."""
    inner, nullable = unwrap_optional(tp)
    if nullable and isinstance(value, str) and value.strip().lower() in _NULL:
        value = None
    if value is None:
        if nullable:
            return None
        raise ValueError(f"expected {_describe(inner, choices)}, got null")
    try:
        result = _typed(value, inner)
        if choices is None or result in choices:
            return result
    except ValueError:
        pass
    raise ValueError(f"expected {_describe(inner, choices)}, got {value!r}")


def flag_name(name: str, prefix: str = "", name_style: str = "kebab") -> str:
    """The flag of field ``name``: ``--kebab-case``, or ``--<prefix>snake_case`` with name_style="snake"."""
    return "--" + prefix + (name.replace("_", "-") if name_style == "kebab" else name)


def _shown(value: Any) -> str:
    # A default is shown as one would type it: true/false, none, shell-quoted text.
    if value is None or isinstance(value, bool):
        return str(value).lower()
    return shlex.quote(str(value))


def flag_text(value: Any) -> str:
    """``value`` as one command-line word that ``coerce`` reads back: true/false, none, the text."""
    return str(value).lower() if value is None or isinstance(value, bool) else str(value)


def as_flags(config: Any, prefix: str = "", name_style: str = "kebab") -> list[str]:
    """The command line that parses back into ``config``: a flag for each field whose value is not
    its default (the defaults need none), in field order."""
    flags = []
    for name, (_, spec) in config_fields(type(config)).items():
        value = getattr(config, name)
        default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
        if value != default:
            flags += [flag_name(name, prefix, name_style), flag_text(value)]
    return flags


def add_dataclass_flags(
    parser: Union[argparse.ArgumentParser, argparse._ArgumentGroup],
    cls: type,
    defaults: Any = None,
    prefix: str = "",
    name_style: str = "kebab",
    exclude: Collection[str] = (),
    title: Optional[str] = None,
) -> None:
    """Add one flag per field of dataclass ``cls`` (but those in ``exclude``) to ``parser`` (or an
    argument group of one). On a parser, ``title`` names the group of its flags in ``--help``, and
    a field's ``metadata["section"]`` puts it in a group after them (``title, section``).

    The parsed namespace holds ``prefix + field name`` only for the flags given: absent flags stay
    absent (argparse.SUPPRESS), so the caller decides what fills them (the dataclass defaults in
    ``parse_config``; YAML, then the environment's defaults, in environments/cli.py). The help shows
    the default from ``defaults`` (an instance) or the field, except for a default_factory field:
    the factory is never called here, as it may read a secret (the API key from the environment).
    """
    groups: dict[Optional[str], Any] = {}

    def group_of(section: Optional[str]) -> Any:
        if not isinstance(parser, argparse.ArgumentParser):  # a group of a parser: no groups inside it
            return parser
        if section not in groups:
            heading = ", ".join(part for part in (title, section) if part)
            groups[section] = parser.add_argument_group(heading) if heading else parser
        return groups[section]

    fields = [(name, tp, spec) for name, (tp, spec) in config_fields(cls).items() if name not in exclude]
    group_of(None)  # the common flags' group first, whatever order the fields come in
    for name, tp, spec in sorted(fields, key=lambda f: f[2].metadata.get("section") is not None):  # stable
        inner = unwrap_optional(tp)[0]
        if inner not in _SCALARS:
            raise TypeError(f"{cls.__name__}.{name}: the command line cannot parse type {tp}")
        choices = spec.metadata.get("choices")

        def convert(text: str, tp: Any = tp, choices: Any = choices) -> Any:
            try:
                return coerce(text, tp, choices)
            except ValueError as exc:  # argparse prints it as "argument --flag: <message>", exit 2
                raise argparse.ArgumentTypeError(str(exc)) from None

        help_text = spec.metadata.get("help", "")
        default = getattr(defaults, name) if defaults is not None else spec.default
        # A help that already says "(default: ...)" explains the default better than its value would.
        if spec.default_factory is dataclasses.MISSING and default is not dataclasses.MISSING \
                and "(default:" not in help_text:
            help_text += f" (default: {_shown(default)})"
        if inner is bool:
            shape = {"nargs": "?", "const": True, "metavar": "BOOL"}  # bare flag = true
        else:
            shape = {"metavar": "{" + ",".join(map(str, choices)) + "}" if choices else name.upper()}
        flag = flag_name(name, prefix, name_style)
        group = group_of(spec.metadata.get("section"))
        group.add_argument(
            flag, dest=prefix + name, type=convert, default=argparse.SUPPRESS,
            help=help_text.replace("%", "%%"),  # argparse would expand a lone % in help
            **shape,
        )
        # One name per concept in --help; an old spelling still sets the same field, and says which
        # flag to write instead, so a script that uses it keeps running while its author learns the name.
        for old in spec.metadata.get("old_names", ()):
            group.add_argument(
                old, dest=prefix + name, type=convert, default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                action=_OldName, new_name=flag, **shape)


class _OldName(argparse.Action):
    """An old spelling of a flag: stores its value like the flag, and prints one line naming the flag."""

    def __init__(self, option_strings: list[str], dest: str, new_name: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.new_name = new_name

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        print(f"{option_string} is deprecated: use {self.new_name} (same meaning)", file=sys.stderr)
        setattr(namespace, self.dest, values)


@contextlib.contextmanager
def errors_to_parser(parser: argparse.ArgumentParser, prefix: str = "", name_style: str = "kebab") -> Iterator[None]:
    """Turn a ValueError raised inside (by a config's ``__post_init__``) into ``parser.error``
    (usage, message, exit 2); a ConfigError gets its flag's name in front."""
    try:
        yield
    except ConfigError as exc:
        parser.error(f"{flag_name(exc.field, prefix, name_style)}: {exc.message}")
    except ValueError as exc:
        parser.error(str(exc))


def parse_config(cls: type[T], argv: Optional[list[str]] = None, description: Optional[str] = None,
                 prog: Optional[str] = None) -> T:
    """Parse ``argv`` (default: sys.argv[1:]) into an instance of dataclass ``cls``, one
    ``--kebab-case`` flag per field; fields not given take the dataclass defaults."""
    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    add_dataclass_flags(parser, cls)
    given = vars(parser.parse_args(argv))
    with errors_to_parser(parser):
        # A config may fill what was not given from what was (the trainer's --profile): its
        # classmethod ``fill_given(given) -> dict``.
        fill = getattr(cls, "fill_given", None)
        return cls(**(fill(given) if fill else given))
    raise AssertionError("unreachable: parser.error exits")
