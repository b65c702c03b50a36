"""Decode never waits for prefill, served: a stream keeps getting rounds while another request's long prompt
is prefilled in chunks (counted in responses, not timed), and both outputs are the ones each gets alone."""

from __future__ import annotations

import threading

import pytest

from tests.services_conftest_helpers import collect, generate, generate_request
from specdec.v1 import generation_service_pb2_grpc

CHUNK = 16  # --long-prefill-token-threshold of both services: a 224-token prompt takes 14 passes on each


@pytest.fixture(scope="module")
def chunked(servers, target_dir, good_draft_dir):
    import grpc

    target = servers.target(target_dir, long_prefill_token_threshold=CHUNK)
    draft = servers.draft(good_draft_dir, long_prefill_token_threshold=CHUNK)
    gateway = servers.gateway(target, draft)
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        yield generation_service_pb2_grpc.GenerationServiceStub(channel), target


def _ids(n: int, seed: int) -> list[int]:
    import torch

    return torch.randint(5, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_stream_keeps_decoding_while_a_long_prompt_prefills(chunked):
    stub, target = chunked
    streaming = generate_request(prompt_token_ids=_ids(8, 1), max_tokens=200)
    long = generate_request(prompt_token_ids=_ids(224, 2), max_tokens=2)
    events: list[str] = []  # in arrival order: "stream" per response of the stream, "long" at its first token
    began = threading.Event()
    out: dict = {}

    def read_long():
        began.wait(30)
        events.append("long starts")
        responses = []
        for r in stub.Generate(long, timeout=60):
            if not responses:
                events.append("long")
            responses.append(r)
        out["long"] = collect(responses)

    reader = threading.Thread(target=read_long)
    reader.start()
    responses = []
    for r in stub.Generate(streaming, timeout=60):
        responses.append(r)
        events.append("stream")
        began.set()
    reader.join(60)
    out["stream"] = collect(responses)
    window = events[events.index("long starts"):events.index("long")]
    assert "stream" in events[events.index("long"):], "the stream ended before the long prompt's first token: " \
                                                      "nothing shows whether it waited"
    # 14 chunked passes on each service: the stream had a round in most of them (before: none, the gateway's
    # step waited for the whole prefill)
    assert window.count("stream") >= 5, events
    assert out["stream"].token_ids == generate(stub, streaming).token_ids  # the same as alone
    assert out["long"].token_ids == generate(stub, long).token_ids
    assert target.backend.batcher.prefill_yields > 0  # chunks waited for the stream's rounds to ride with them
