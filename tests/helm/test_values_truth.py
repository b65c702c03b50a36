"""What helm/specdec/values.yaml says against what the code does: the words on readiness, and every setting the
chart passes to a container being one the service reads (rendered offline as tests/helm/test_chart.py renders)."""

from __future__ import annotations

from tests.helm.test_chart import CHART, _parse_like_the_cli, by_component, container


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


def test_the_gateways_draft_sample_method_variable_takes_effect(monkeypatch):
    """speculativeConfig.draft_sample_method reaches the gateway as SPECDEC_GATEWAY_DRAFT_SAMPLE_METHOD, which
    its CLI reads (a value other than the default, so the variable is what sets it), and the gateway's draft
    client then asks each Propose for that method; the draft service gets the same value as its own default."""
    from draft_service.config import DraftServiceConfig
    from gateway.clients import RemoteDraft
    from gateway.config import GatewayConfig
    from specdec.v1 import draft_service_pb2

    assert GatewayConfig().draft_sample_method == DraftServiceConfig(model="x").draft_sample_method == "greedy"
    deployments = by_component({"speculativeConfig": {"draft_sample_method": "probabilistic"}}, "Deployment")
    gateway_container = container(deployments["gateway"])
    assert {"name": "SPECDEC_GATEWAY_DRAFT_SAMPLE_METHOD", "value": "probabilistic"} in gateway_container["env"]
    gateway = _parse_like_the_cli(monkeypatch, gateway_container)
    draft = _parse_like_the_cli(monkeypatch, container(deployments["draft"]))
    assert gateway.draft_sample_method == draft.draft_sample_method == "probabilistic"
    client = RemoteDraft("127.0.0.1:1", gateway.draft_sample_method)  # a channel connects lazily: no call made
    try:
        assert client.draft_sample_method == draft_service_pb2.DRAFT_SAMPLE_METHOD_PROBABILISTIC
    finally:
        client.close()
