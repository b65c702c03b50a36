"""Service-test fixtures (servers on loopback with the tiny models of tests/conftest.py)."""

from tests.services_conftest_helpers import gen_stub, servers, stack, target_llm  # noqa: F401 - fixtures
