"""Token-Level Intersection through the services: ``specdec serve gemma-3-270m --speculative-config
'{"model": "smollm2-135m", ..., "use_heterogeneous_vocab": true}'`` streams exactly what Gemma-3 alone
produces (greedy), and the gateway refuses the pair when the flag or the draft's --target-tokenizer is missing.

Slow: real weights (the target service, the draft service and the offline reference each load a model).
"""

from __future__ import annotations

import json

import pytest

from gateway.server import create_server as create_gateway
from specdec import LLM, SamplingParams
from specdec.errors import ConfigError
from specdec.entrypoints.serve import ServeConfig, start_stack
from specdec.tli.adapter import TLIAdapter
from specdec.v1 import generation_service_pb2 as gen_pb2, generation_service_pb2_grpc
from tests.services_conftest_helpers import HOST, generate, generate_request, gateway_config, wait_released
from tests.specdec.tli.tiny_tli import DRAFT_NAME, TARGET_NAME, require_packages

pytestmark = pytest.mark.slow

PROMPTS = ["The history of the Roman Empire is", "def fibonacci(n):\n    "]
MAX_TOKENS = 24
K = 3


@pytest.fixture(scope="module")
def tli_stack():
    """target (Gemma-3) + draft (SmolLM2, drafting in Gemma ids) + gateway, gRPC only, on loopback."""
    require_packages(TARGET_NAME, DRAFT_NAME)
    spec = json.dumps({"model": DRAFT_NAME, "num_speculative_tokens": K, "use_heterogeneous_vocab": True})
    stack = start_stack(ServeConfig(model=TARGET_NAME, speculative_config=spec, host=HOST, grpc_port=0, port=-1))
    try:
        yield stack
    finally:
        stack.stop(0)


@pytest.fixture(scope="module")
def references(cached_model_loading):
    """{prompt: greedy token ids} of the target alone, offline."""
    require_packages(TARGET_NAME)
    llm = LLM(TARGET_NAME, dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return {p: o.outputs[0].token_ids for p, o in zip(PROMPTS, outs)}


def test_stack_drafts_through_tli(tli_stack):
    draft_backend = tli_stack.draft.backend
    assert isinstance(draft_backend.tli, TLIAdapter)
    info = tli_stack.gateway.backend
    assert info.draft_info.tokenizer_fingerprint != info.target_info.tokenizer_fingerprint
    assert info.draft_info.proposal_tokenizer_fingerprint == info.target_info.tokenizer_fingerprint
    # a TLI draft does not cap the target's context with its own (shorter) one
    assert info.max_model_len == info.target_info.max_model_len > info.draft_info.max_model_len


def test_streamed_greedy_equals_offline_target_alone(tli_stack, references):
    import grpc

    with grpc.insecure_channel(f"{HOST}:{tli_stack.gateway.port}") as channel:
        stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
        accepted = 0
        for prompt in PROMPTS:
            out = generate(stub, generate_request(prompt, max_tokens=MAX_TOKENS), timeout=600)
            assert out.token_ids == references[prompt], (
                f"prompt {prompt!r}: streamed {out.text!r} differs from the target alone")
            last = out.last
            assert last.finish_reason == gen_pb2.FINISH_REASON_LENGTH
            assert last.completion_tokens == MAX_TOKENS
            s = last.stats
            assert s.num_drafts >= 1 and s.num_draft_tokens > s.num_drafts, f"k={K} was not used: {s}"
            assert s.num_target_passes == len(out.responses)
            accepted += s.num_accepted_tokens
        assert accepted > 0, "the TLI draft got nothing accepted"
    wait_released(tli_stack.target, tli_stack.draft, timeout=10)


def test_gateway_refuses_pair_without_flag_or_target_tokenizer(tli_stack, servers):
    """Draft service WITHOUT --target-tokenizer: a gateway without use_heterogeneous_vocab names the flag;
    with the flag it names --target-tokenizer. The TLI draft of the stack is refused without the flag too."""
    plain_draft = servers.draft(DRAFT_NAME)
    assert plain_draft.backend.tli is None
    with pytest.raises(ConfigError, match="use_heterogeneous_vocab"):
        create_gateway(gateway_config(tli_stack.target, plain_draft, use_heterogeneous_vocab=False))
    with pytest.raises(ConfigError, match="--target-tokenizer"):
        create_gateway(gateway_config(tli_stack.target, plain_draft, use_heterogeneous_vocab=True))
    with pytest.raises(ConfigError, match="use_heterogeneous_vocab"):
        create_gateway(gateway_config(tli_stack.target, tli_stack.draft, use_heterogeneous_vocab=False))
