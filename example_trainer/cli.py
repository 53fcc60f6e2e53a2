"""Build an argparse CLI from a config dataclass: each field's help lives once, in its metadata."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def field(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field whose ``help`` becomes the CLI help of ``--field-name``."""
    return dataclasses.field(default=default, metadata={"help": help, **kwargs})


def _base_type(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def build_parser(cls: type, description: str | None = None) -> argparse.ArgumentParser:
    """``--snake-case`` flags for every field of dataclass ``cls``; bools get ``--x/--no-x``."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        tp = _base_type(hints[f.name])
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": f.metadata.get("help", "")}
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        if tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        else:
            parser.add_argument(flag, type=tp, **kwargs)
    return parser


def parse_config(cls: type[T], argv: list[str] | None = None, description: str | None = None) -> T:
    """Parse ``argv`` into an instance of ``cls``; ``__post_init__`` errors become CLI errors."""
    parser = build_parser(cls, description)
    ns = parser.parse_args(argv)
    try:
        return cls(**vars(ns))
    except ValueError as err:
        parser.error(str(err))
        raise  # unreachable: parser.error exits
