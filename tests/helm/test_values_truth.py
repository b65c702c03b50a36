"""What helm/specdec/values.yaml says against what the code does: the words on readiness, and every setting the
chart passes to a container being one the service reads (rendered offline as tests/helm/test_chart.py renders)."""

from __future__ import annotations

from tests.helm.test_chart import CHART



def _comment_above(key: str) -> str:
    """The comment lines directly above ``key:`` in values.yaml, joined."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.strip().startswith(f"{key}:")]
    block = []
    for line in reversed(lines[:at]):
        if not line.strip().startswith("#"):
            break
        block.insert(0, line.strip().lstrip("#").strip())
    return " ".join(block)


def test_readiness_words_say_what_ready_does():
    """values.yaml's words on the gateway's readinessPath say what /ready does (gateway/openai/api_server.py;
    tests/gateway/openai/test_http_backend_down.py checks it): 503 for a target outage, 200 "degraded" for a
    draft outage while draft_fallback is on, the default."""
    words = _comment_above("readinessPath")
    assert "503 while the target is not SERVING" in words, words
    assert 'draft outage keeps the gateway in the Service: /ready answers 200 {"status": "degraded"}' in words, words
    assert "draft included" not in words and "takes every gateway out" not in words, words
    from gateway.config import GatewayConfig

    assert "on by default" in words and GatewayConfig().draft_fallback is True
