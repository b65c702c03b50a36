"""N-gram, hybrid and adaptive-k drafting through the services, started as ``specdec serve`` starts them: greedy
output equals the target alone; the draft service loads no model for n-gram drafting; a request's
num_speculative_tokens=0 turns speculation off for it."""

from __future__ import annotations

import json

import grpc
import pytest

from specdec.entrypoints.serve import ServeConfig, start_stack
from specdec.serving import metrics as M
from specdec.v1 import common_pb2, generation_service_pb2_grpc
from tests.metrics_helpers import parse
from tests.services_conftest_helpers import generate, generate_request, offline_greedy

PROMPTS = ["The cat sat on the mat. The cat sat on the mat. The cat sat on the", "def f(x):\n    return x\n\ndef g"]
N = 32


def _stack(target_dir, spec: dict):
    return start_stack(ServeConfig(model=str(target_dir), speculative_config=json.dumps(spec), host="127.0.0.1",
                                   grpc_port=0, port=-1, dtype="float32"))


@pytest.mark.heavy
@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4},
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
    {"method": "suffix", "num_speculative_tokens": 8},
    "hybrid",
    "adaptive hybrid",
    "suffix hybrid",
])
def test_served_lookup_drafting_equals_the_target_alone(target_dir, good_draft_dir, target_llm, spec):
    adaptive = spec == "adaptive hybrid"
    if spec in ("hybrid", "adaptive hybrid"):
        spec = {"model": str(good_draft_dir), "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                "adaptive_k": adaptive}
    elif spec == "suffix hybrid":
        spec = {"method": "suffix", "model": str(good_draft_dir), "num_speculative_tokens": 3}
    model_free = "model" not in spec
    method = spec["method"] if model_free else "suffix_hybrid" if spec.get("method") == "suffix" else "hybrid"
    stack = _stack(target_dir, spec)
    try:
        backend = stack.draft.backend
        assert (stack.gateway.backend.round_costs is not None) == spec.get("adaptive_k", False)
        assert (backend.lm is None) == model_free  # no model loaded for n-gram / suffix alone
        with grpc.insecure_channel(f"127.0.0.1:{stack.gateway.port}") as channel:
            stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
            info = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
            assert info.draft.method == method
            assert info.target.kv_cache_capacity_tokens > 0 and info.target.block_size > 0
            if model_free:  # no model, no KV pool
                assert (info.draft.kv_cache_capacity_tokens, info.draft.block_size) == (0, 0)
                assert not info.draft.enable_prefix_caching
            # specdec_build_info names the drafting the gateway runs, in one series
            gateway_info = [ls for (name, ls), v in parse(M.exposition().decode()).items()
                            if name == "specdec_build_info" and ("service", "gateway") in ls
                            and ("model_name", str(target_dir)) in ls]
            assert [dict(ls)["method"] for ls in gateway_info] == [info.draft.method], gateway_info
            drafted = 0
            for prompt in PROMPTS:
                out = generate(stub, generate_request(prompt, max_tokens=N))
                assert (out.text, out.token_ids) == offline_greedy(target_llm, prompt, N), (spec, prompt)
                drafted += out.last.stats.num_accepted_tokens
            assert drafted > 0
            # a request may turn speculation off: the target alone, no drafts
            off = generate(stub, generate_request(PROMPTS[0], max_tokens=N, k=0))
            assert off.token_ids == offline_greedy(target_llm, PROMPTS[0], N)[1]
            assert off.last.stats.num_draft_tokens == 0 and off.last.stats.num_target_passes == N
    finally:
        stack.stop(0)
