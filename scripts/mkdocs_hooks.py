"""MkDocs hooks (mkdocs.yml ``hooks:``): pages whose text the code writes at build time.

``<!-- metrics-reference -->`` in a page becomes the table of every ``specdec_`` metric the services register
(:mod:`specdec.serving.metrics_reference`), so the reference is rebuilt from the code on every build."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, also when specdec is not installed

MARKER = "<!-- metrics-reference -->"


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 - MkDocs' hook signature
    if MARKER not in markdown:
        return markdown
    from specdec.serving.metrics_reference import markdown as table

    return markdown.replace(MARKER, table())
