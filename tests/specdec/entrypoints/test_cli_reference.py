"""The CLI and environment references (specdec.entrypoints.cli_reference): every subcommand, flag, default,
choice and variable of the parsers, with the code's defaults whatever the building process's environment."""

from __future__ import annotations

import argparse

from specdec.entrypoints.cli import SUBCOMMANDS, build_parser
from specdec.entrypoints.cli_reference import cli_markdown, env_markdown, reference


def _subparsers():
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_subcommand_and_flag_is_in_the_reference():
    ref = reference()
    assert list(ref) == ["specdec", *(f"specdec {name}" for name in SUBCOMMANDS)]
    md = cli_markdown()
    for name, parser in _subparsers().items():
        flags = {f for flag in ref[f"specdec {name}"][1] for f in flag.flags}
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for option in action.option_strings:
                assert option in flags and f"`{option}`" in md, (name, option)
            for choice in action.choices or ():
                assert f"`{choice}`" in md, (name, choice)


def test_flags_name_their_variable_and_default():
    serve = {f.flags[0]: f for f in reference()["specdec serve"][1]}
    assert serve["--port"].env == "SPECDEC_SERVE_PORT" and serve["--port"].default == "8000"
    gateway = {f.flags[0]: f for f in reference()["specdec gateway"][1]}
    assert gateway["--responses-store-max-entries"].default == "1024"
    assert gateway["--overlap"].flags == ("--overlap", "--no-overlap")
    env = env_markdown()
    assert "| `SPECDEC_GATEWAY_SPECULATIVE_CONFIG` | `--speculative-config` | `specdec gateway` |" in env


def test_the_environment_of_the_build_does_not_leak_into_the_defaults(monkeypatch):
    monkeypatch.setenv("SPECDEC_SERVE_PORT", "9999")
    serve = {f.flags[0]: f for f in reference()["specdec serve"][1]}
    assert serve["--port"].default == "8000"
    import os

    assert os.environ["SPECDEC_SERVE_PORT"] == "9999"  # set aside while building, then back
