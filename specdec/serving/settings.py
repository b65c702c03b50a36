"""Typed service configs settable by command-line flag and environment variable.

Each service declares one dataclass; every field ``foo_bar`` becomes the flag ``--foo-bar`` whose
default is read from ``SPECDEC_<SERVICE>_FOO_BAR`` (then the dataclass default). Flags win over
environment variables, which win over defaults.

A ``list[...]`` field takes a comma-separated list, from its environment variable or from its flag, and
the flag may be given more than once (``--api-key a --api-key b`` = ``--api-key a,b``); the flags then
replace the variable's list, they do not add to it. Blank items are dropped, so an empty variable is an
empty list. A field with ``metadata={"secret": True}`` never shows its value in ``--help``. A field with
``metadata={"parse": function}`` reads its text with that function (e.g. ``specdec.config.parse_byte_size``:
``2GiB``), whose ValueError message is shown as the error; ``"metavar"`` names the value in ``--help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any, TypeVar

C = TypeVar("C")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _base_type(tp: Any) -> tuple[type, bool]:
    """(scalar type, optional?) for int / float / str / bool and their Optional forms."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _list_item_type(tp: Any) -> type | None:
    """The item type of a ``list[X]`` field (None: not a list field)."""
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp) or (str,)
        return item
    return None


def _list_converter(item_convert):
    """A flag's or variable's text -> the list of its comma-separated items (blank ones dropped)."""

    def convert(text: str) -> list:
        return [item_convert(part.strip()) for part in text.split(",") if part.strip()]

    return convert


class _BoolAction(argparse.Action):
    """vLLM's booleans: ``--x`` sets True, ``--no-x`` sets False; neither takes a value. A string default
    (the environment variable's text) still goes through ``type`` when the command is parsed."""

    def __init__(self, option_strings, dest, **kwargs):
        kwargs["nargs"] = 0
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, not option_string.startswith("--no-"))

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


class _ListAction(argparse.Action):
    """Each occurrence adds its items; the first one replaces the default (env var or dataclass)."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        if current is self.default or current is None:
            current = []
        setattr(namespace, self.dest, [*current, *values])


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {text!r}")


def _converter(tp: type, optional: bool, env: str | None = None, parse=None):
    """``parse``: the field's own reader of its text (its ValueError's message is the error shown)."""
    base = parse or (_parse_bool if tp is bool else tp)

    def convert(text: str):
        if optional and text.strip().lower() in ("", "none", "null"):
            return None
        try:
            return base(text)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            source = f" (from the environment variable {env})" if env and os.environ.get(env) == text else ""
            if parse is not None:
                raise argparse.ArgumentTypeError(f"{exc}{source}") from None
            kind = "a boolean (true/false)" if tp is bool else tp.__name__
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}{source}") from None

    return convert


def env_name(prefix: str, field_name: str) -> str:
    return f"{prefix}_{field_name.upper()}"


def add_arguments(parser: argparse.ArgumentParser, cls: type, env_prefix: str, skip: tuple[str, ...] = ()) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        item = _list_item_type(hints[f.name])
        tp, optional = (item, False) if item is not None else _base_type(hints[f.name])
        env = env_name(env_prefix, f.name)
        convert = _converter(tp, optional, env, f.metadata.get("parse"))
        extra: dict[str, Any] = {}
        if item is not None:
            convert = _list_converter(convert)
            extra["action"] = _ListAction
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        if env in os.environ:
            # A string default goes through `convert` only when this (sub)command is parsed, so a bad
            # value errors there, naming the variable, without breaking the other subcommands.
            default = os.environ[env]
        help_text = f.metadata.get("help", "")
        shown = "hidden" if f.metadata.get("secret") and default else repr(default)
        flag = "--" + f.name.replace("_", "-")
        if tp is bool:  # vLLM's style: --x / --no-x, never a value after the flag
            parser.add_argument(flag, "--no-" + f.name.replace("_", "-"), dest=f.name, action=_BoolAction,
                                type=convert, default=default,
                                help=f"{help_text} (env {env}; default {shown})".replace("%", "%%"))
            continue
        parser.add_argument(
            flag,
            dest=f.name,
            type=convert,
            default=default,
            metavar=f.metadata.get("metavar", tp.__name__.upper()),
            help=f"{help_text} (env {env}; default {shown})".replace("%", "%%"),
            **extra,
        )


def from_args(cls: type[C], args: argparse.Namespace) -> C:
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})


def from_env(cls: type[C], env_prefix: str, **overrides: Any) -> C:
    """Build a config from environment variables (and keyword overrides), e.g. in tests."""
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls, env_prefix)
    args = parser.parse_args([])
    for k, v in overrides.items():
        setattr(args, k, v)
    return from_args(cls, args)


def service_cli(config_cls: type, env_prefix: str, create_server_path: str, name: str, **create_options: Any):
    """(add_arguments, run, main) for a service's ``__main__``: flags/env → config → serve until SIGTERM.

    ``create_server_path`` ("module:function") is imported only when the command runs."""
    import importlib
    import logging
    import sys

    def add(p: argparse.ArgumentParser) -> None:
        add_arguments(p, config_cls, env_prefix)

    def run(args: argparse.Namespace) -> int:
        from specdec.serving.server import serve_until_signal

        module, func = create_server_path.split(":")
        create_server = getattr(importlib.import_module(module), func)
        from specdec.serving.allocator import return_freed_memory

        return_freed_memory()  # before the model loads (specdec.serving.allocator)
        config = from_args(config_cls, args)
        handle = create_server(config, **create_options)
        logging.getLogger(name).info("%s listening on %s:%d", name, config.host, handle.port)
        serve_until_signal(handle)
        return 0

    def main() -> None:
        from specdec.serving.logs import configure_logging

        parser = argparse.ArgumentParser(prog=name)
        add(parser)
        configure_logging("INFO")
        sys.exit(run(parser.parse_args()))

    return add, run, main
