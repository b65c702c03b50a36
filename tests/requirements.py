"""What a test needs from the environment, said once: a missing pip package skips the test with the
command that installs it, except under CI (``CI`` set), where every test requirement is installed by
``scripts/test.sh`` and a missing one is a failure, not a silent skip."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest


def missing(reason: str) -> None:
    """Skip with ``reason``, or fail under CI."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI installs every test requirement: a missing one is a failure)")
    pytest.skip(reason)


def require_package(module: str, install: str) -> Path | None:
    """The folder of the pip package providing ``module`` (None for a single-file module)."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        missing(f"pip package for module {module!r} is not installed: {install}")
    locations = list(spec.submodule_search_locations or [])
    return Path(locations[0]) if locations else None
