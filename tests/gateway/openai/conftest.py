"""The served stack the HTTP tests talk to (one per test module) and its clients."""

from __future__ import annotations

import pytest

from tests.gateway.openai.http_helpers import openai_client, raw_client, serve


@pytest.fixture(scope="module")
def http_stack(target_dir, good_draft_dir):
    """Target + draft + gateway with HTTP, as ``specdec serve`` starts them (tiny models)."""
    stack = serve(target_dir, good_draft_dir)
    try:
        yield stack
    finally:
        stack.stop(0)


@pytest.fixture(scope="module")
def model(target_dir) -> str:
    return str(target_dir)  # served_model_name defaults to the target path given


@pytest.fixture(scope="module")
def client(http_stack):
    c = openai_client(http_stack)
    yield c
    c.close()


@pytest.fixture(scope="module")
def raw(http_stack):
    c = raw_client(http_stack)
    yield c
    c.close()
