"""MkDocs hooks (mkdocs.yml ``hooks:``): pages whose text the code writes at build time.

``<!-- metrics-reference -->`` in a page becomes the table of every ``specdec_`` metric the services register
(:mod:`specdec.serving.metrics_reference`), ``<!-- cli-reference -->`` every subcommand's flags and
``<!-- env-reference -->`` every environment variable (:mod:`specdec.entrypoints.cli_reference`), so the
references are rebuilt from the code on every build."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, also when specdec is not installed

MARKER = "<!-- metrics-reference -->"
CLI_MARKER = "<!-- cli-reference -->"
ENV_MARKER = "<!-- env-reference -->"


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 - MkDocs' hook signature
    if MARKER in markdown:
        from specdec.serving.metrics_reference import markdown as table

        markdown = markdown.replace(MARKER, table())
    if CLI_MARKER in markdown or ENV_MARKER in markdown:
        from specdec.entrypoints.cli_reference import cli_markdown, env_markdown

        markdown = markdown.replace(CLI_MARKER, cli_markdown()).replace(ENV_MARKER, env_markdown())
    return markdown
