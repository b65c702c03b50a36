"""Fixtures shared by the engine's tests."""

from __future__ import annotations

import pytest

from specdec.engine.models import load_model


@pytest.fixture(scope="module")
def target_lm(target_dir):
    """The tiny random-weight target, loaded once per module (fp32)."""
    return load_model(str(target_dir), dtype="float32")
