"""The CLI and environment-variable references of the docs (docs/reference/cli.md, docs/reference/environment.md),
made from the parsers themselves: every ``specdec`` subcommand, every flag with its default, choices and
environment variable. ``scripts/mkdocs_hooks.py`` writes them into the pages at build time, so the reference
cannot drift from the code (vLLM generates its ``serve`` reference the same way).

The defaults are the code's: the parsers are built with every ``SPECDEC_*`` variable of the building
process's environment set aside (a variable set there would otherwise show as the default)."""

from __future__ import annotations

import argparse
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass

# what settings.add_arguments appends to every settings flag's help
_ENV_AND_DEFAULT = re.compile(r"\s*\(env (?P<env>[A-Z0-9_]+); default (?P<default>.*)\)\s*$", re.S)
# the global options' help names their variable as "(env NAME; default X)" too
GLOBAL = "specdec"


@dataclass(frozen=True)
class Flag:
    command: str  # "specdec serve", or "specdec" for the global options
    flags: tuple[str, ...]  # "--max-num-seqs" (and "--no-x" for a boolean)
    metavar: str | None
    default: str
    choices: tuple[str, ...]
    env: str | None
    help: str
    positional: bool = False


@contextmanager
def _clean_env():
    saved = {k: v for k, v in os.environ.items() if k.startswith("SPECDEC_")}
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


def _flag(command: str, action: argparse.Action) -> Flag:
    text = " ".join((action.help or "").replace("%%", "%").split())
    m = _ENV_AND_DEFAULT.search(text)
    env, default = (m["env"], m["default"]) if m else (None, None)
    if m:
        text = text[:m.start()]
    if default is None:
        default = "" if action.default in (None, argparse.SUPPRESS) and action.required else repr(action.default)
    found_env = re.search(r"\(env (SPECDEC_[A-Z0-9_]+)", action.help or "")
    if env is None and found_env:
        env = found_env.group(1)
    metavar = action.metavar if isinstance(action.metavar, str) else None
    if metavar is None and action.nargs != 0 and not isinstance(action, argparse._StoreConstAction):
        metavar = action.dest.upper()
    return Flag(command, tuple(action.option_strings) or (action.dest,), metavar, default,
                tuple(str(c) for c in action.choices or ()), env, text, positional=not action.option_strings)


def reference() -> dict[str, tuple[str, list[Flag]]]:
    """command -> (its description, its flags), the global options first, then each subcommand in order."""
    from specdec.entrypoints.cli import build_parser

    with _clean_env():
        parser = build_parser()
    out: dict[str, tuple[str, list[Flag]]] = {}
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out[GLOBAL] = (parser.description or "", [_flag(GLOBAL, a) for a in parser._actions
                                              if a.option_strings and not isinstance(a, argparse._HelpAction)])
    for name, subparser in sub.choices.items():
        command = f"specdec {name}"
        out[command] = (subparser.description or "", [_flag(command, a) for a in subparser._actions
                                                      if not isinstance(a, argparse._HelpAction)])
    return out


def _cell(text: str) -> str:
    return text.replace("|", "&#124;").replace("\n", " ")


def cli_markdown() -> str:
    """One section per command: a table of its flags."""
    parts = []
    for command, (description, flags) in reference().items():
        title = "Global options (before the subcommand)" if command == GLOBAL else f"`{command}`"
        parts += [f"## {title}", "", _cell(description), "", "| flag | default | environment | what |",
                  "|---|---|---|---|"]
        for f in flags:
            names = ", ".join(f"`{n}`" for n in f.flags)
            if f.metavar and not f.positional:
                names += f" `{f.metavar}`"
            if f.choices:
                names += "<br>one of " + ", ".join(f"`{c}`" for c in f.choices)
            default = f"`{_cell(f.default)}`" if f.default else ""
            env = f"`{f.env}`" if f.env else ""
            parts.append(f"| {names} | {default} | {env} | {_cell(f.help)} |")
        parts.append("")
    return "\n".join(parts)


def env_markdown() -> str:
    """Every environment variable a command reads, with its flag: one table."""
    rows = ["| variable | flag | commands | default |", "|---|---|---|---|"]
    seen: dict[str, list[Flag]] = {}
    for _, (_, flags) in reference().items():
        for f in flags:
            if f.env:
                seen.setdefault(f.env, []).append(f)
    for env in sorted(seen):
        flags = seen[env]
        commands = ", ".join(f"`{f.command}`" for f in flags)
        rows.append(f"| `{env}` | `{flags[0].flags[0]}` | {commands} | `{_cell(flags[0].default)}` |")
    return "\n".join(rows) + "\n"
