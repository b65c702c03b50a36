"""Gateway start-up: it waits for loading backends, refuses incompatible pairs and unreachable ones."""

from __future__ import annotations

import socket
import threading

import grpc
import pytest

import specdec.serving.backend
from gateway.config import GatewayConfig
from specdec.errors import BackendUnavailableError, ConfigError, InvalidRequestError
from specdec.v1 import generation_service_pb2_grpc
from tests.services_conftest_helpers import (
    PROMPTS,
    generate,
    generate_request,
    offline_greedy,
    run_in_thread,
)


def test_draft_with_another_tokenizer_is_refused(servers, target_dir, other_vocab_dir):
    target = servers.target(target_dir)
    draft = servers.draft(other_vocab_dir)
    assert draft.backend.lm.tokenizer_fingerprint != target.backend.lm.tokenizer_fingerprint
    with pytest.raises(ConfigError) as info:
        servers.gateway(target, draft)
    message = str(info.value)
    assert "use_heterogeneous_vocab" in message
    assert str(other_vocab_dir) in message and str(target_dir) in message


def test_num_speculative_tokens_out_of_range_is_refused(servers, target_dir):
    target = servers.target(target_dir)
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens") as info:
        servers.gateway(target, None, num_speculative_tokens=0)
    assert info.value.param == "num_speculative_tokens"


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_backend_fails_start_up_with_its_address():
    from gateway.server import create_server

    port = _unused_port()
    cfg = GatewayConfig(target_addr=f"127.0.0.1:{port}", draft_addr=None, host="127.0.0.1", port=0,
                        startup_timeout_seconds=0.5)
    with pytest.raises(BackendUnavailableError) as info:
        create_server(cfg)
    assert f"127.0.0.1:{port}" in str(info.value) and "target" in str(info.value)


@pytest.mark.heavy
def test_gateway_waits_for_backends_that_are_still_loading(servers, target_dir, good_draft_dir, target_llm,
                                                           monkeypatch):
    """Backends started with load_async=True answer UNAVAILABLE while loading; the gateway waits."""
    gate = threading.Event()
    real_load = specdec.serving.backend.load_model

    def slow_load(*args, **kwargs):
        assert gate.wait(30), "test never opened the gate"
        return real_load(*args, **kwargs)

    monkeypatch.setattr(specdec.serving.backend, "load_model", slow_load)
    target = servers.target(target_dir, load_async=True)
    draft = servers.draft(good_draft_dir, load_async=True)
    try:
        thread, box = run_in_thread(lambda: servers.gateway(target, draft))
        thread.join(1.5)
        # While loading, GetInfo answers UNAVAILABLE, which the gateway retries until its
        # startup_timeout_seconds. (Bug: it answers INTERNAL, and the gateway gives up at once.)
        assert thread.is_alive(), f"the gateway did not wait for its backends to load: {box}"
    finally:
        gate.set()
        for h in (target, draft):  # loaded before the fixture stops them (no half-loaded backend)
            assert h.backend.ready.wait(30)
    thread.join(30)
    assert "error" not in box, box.get("error")
    with grpc.insecure_channel(f"127.0.0.1:{box['result'].port}") as channel:
        stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
        out = generate(stub, generate_request(PROMPTS[0], max_tokens=8))
    assert (out.text, out.token_ids) == offline_greedy(target_llm, PROMPTS[0], 8)
