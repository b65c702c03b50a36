"""End to end over real gRPC on loopback: gateway → draft service + target service.

Greedy output streamed by GenerationService.Generate is identical to the offline target-only
output (``specdec.LLM(target).generate``) for both draft sample methods and several k, set per
request and in GatewayConfig; seeded sampling is reproducible and equals the offline speculative
path with the same seed.
"""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.v1 import common_pb2, generation_service_pb2 as gen_pb2, generation_service_pb2_grpc
from tests.services_conftest_helpers import (
    PROMPTS,
    collect,
    generate,
    generate_request,
    hooked,
    offline_greedy,
    wait_released,
)

MAX_TOKENS = 24
METHODS = ["greedy", "probabilistic"]
# How each drafting method is checked against the greedy reference. At temperature 0 probabilistic
# drafting drafts greedily (the same path as "greedy"); at temperature 1 with top_k=1 it samples from a
# one-hot q and the target runs the rejection sampler, whose output must still equal greedy decoding.
SAMPLING = {"greedy": {"temperature": 0.0}, "probabilistic": {"temperature": 1.0, "top_k": 1, "seed": 7}}


@pytest.fixture(scope="module")
def references(target_llm):
    """{prompt: (text, token ids)} of the target alone, greedy."""
    return {p: offline_greedy(target_llm, p, MAX_TOKENS) for p in PROMPTS}


@pytest.fixture(scope="module")
def gateway_for(servers, stack):
    """``gateway_for(method, k)`` -> (handle, GenerationService stub) of a gateway over the shared
    backends with that draft_sample_method and GatewayConfig.num_speculative_tokens (None: default)."""
    made = {}

    def get(method: str, k: int | None = None):
        key = (method, k)
        if key not in made:
            kw = {"draft_sample_method": method}
            if k is not None:
                kw["num_speculative_tokens"] = k
            handle = servers.gateway(stack.target, stack.draft, **kw)
            made[key] = (handle, generation_service_pb2_grpc.GenerationServiceStub(stack.channel(handle)))
        return made[key]

    return get


def _check_stream(out, prompt_len: int, k: int, max_tokens: int = MAX_TOKENS) -> None:
    """Shape of a finished stream and its speculation statistics."""
    assert len(out.token_ids) == max_tokens
    for r in out.responses[:-1]:
        assert r.finish_reason == gen_pb2.FINISH_REASON_UNSPECIFIED
        assert r.token_ids, "a response without new tokens"
    last = out.last
    assert last.finish_reason == gen_pb2.FINISH_REASON_LENGTH
    assert last.completion_tokens == max_tokens and last.prompt_tokens == prompt_len
    s = last.stats
    assert s.num_drafts >= 1 and s.num_accepted_tokens > 0, f"the draft got nothing accepted: {s}"
    assert s.num_draft_tokens <= k * s.num_drafts
    if k == 1:
        assert s.num_draft_tokens == s.num_drafts
    else:
        assert s.num_draft_tokens > s.num_drafts, f"k={k} was not used: {s}"
    # every round is one target pass and emits accepted + 1 tokens (the last one may be cut)
    assert s.num_target_passes == len(out.responses)
    assert max_tokens <= s.num_accepted_tokens + s.num_target_passes
    assert s.num_target_passes < max_tokens, "speculation saved no target pass"


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_equals_target_alone_k_per_request(gateway_for, references, tokenizer, method, k):
    _, stub = gateway_for(method)
    for prompt in PROMPTS:
        out = generate(stub, generate_request(prompt, max_tokens=MAX_TOKENS, k=k, **SAMPLING[method]))
        assert (out.text, out.token_ids) == references[prompt], (method, k, prompt)
        _check_stream(out, len(tokenizer(prompt).input_ids), k)


@pytest.mark.parametrize(("method", "k"), [("greedy", 1), ("greedy", 3), ("greedy", 5), ("probabilistic", 3)])
def test_greedy_equals_target_alone_k_from_gateway_config(gateway_for, references, tokenizer, method, k):
    handle, stub = gateway_for(method, k)
    info = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    assert info.num_speculative_tokens == k and info.draft_sample_method == method
    for prompt in PROMPTS:
        out = generate(stub, generate_request(prompt, max_tokens=MAX_TOKENS, **SAMPLING[method]))
        assert (out.text, out.token_ids) == references[prompt], (method, k, prompt)
        _check_stream(out, len(tokenizer(prompt).input_ids), k)


def test_prompt_token_ids_equal_prompt_text(gen_stub, references, tokenizer):
    prompt = PROMPTS[1]
    ids = tokenizer(prompt).input_ids
    out = generate(gen_stub, generate_request(prompt_token_ids=ids, max_tokens=MAX_TOKENS, request_id="by-ids"))
    assert (out.text, out.token_ids) == references[prompt]
    assert all(r.request_id == "by-ids" for r in out.responses)


def test_target_alone_gateway_equals_offline(servers, stack, references, tokenizer):
    handle = servers.gateway(stack.target, None)
    stub = generation_service_pb2_grpc.GenerationServiceStub(stack.channel(handle))
    info = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    assert not info.HasField("draft") and info.num_speculative_tokens == 0
    out = generate(stub, generate_request(PROMPTS[0], max_tokens=MAX_TOKENS))
    assert (out.text, out.token_ids) == references[PROMPTS[0]]
    assert out.last.stats.num_draft_tokens == 0 and out.last.stats.num_target_passes == MAX_TOKENS


def test_get_info_describes_the_pair(gen_stub, stack, target_dir, good_draft_dir):
    info = gen_stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    assert info.target.model_name == str(target_dir) and info.draft.model_name == str(good_draft_dir)
    assert info.target.tokenizer_fingerprint == info.draft.tokenizer_fingerprint
    assert info.target.vocab_size == 49152 and info.target.dtype == "float32"
    assert info.num_speculative_tokens == stack.gateway.backend.config.num_speculative_tokens
    assert info.draft_sample_method == "greedy"
    assert info.target.max_model_len == 256 and info.target.max_num_speculative_tokens >= 5


def test_stop_string_and_eos_through_the_services(gen_stub, references, target_llm):
    """Stop conditions are applied by the gateway exactly as offline."""
    prompt = PROMPTS[0]
    text, ids = references[prompt]
    stop = text[8:14]  # a piece of the greedy text
    req = generate_request(prompt, max_tokens=MAX_TOKENS, stop=[stop])
    out = generate(gen_stub, req)
    ref = target_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                     stop=[stop]))[0].outputs[0]
    assert out.text == ref.text == text[: text.index(stop)]
    assert out.last.finish_reason == gen_pb2.FINISH_REASON_STOP and out.last.stop_reason == stop
    stop_id = ids[5]
    out = generate(gen_stub, generate_request(prompt, max_tokens=MAX_TOKENS, stop_token_ids=[stop_id]))
    assert out.token_ids == ids[: ids.index(stop_id) + 1]
    assert out.last.stop_reason == str(stop_id)


# --------------------------------------------------------------------------------------------------
# seeded sampling


@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampling_is_reproducible(gateway_for, stack, method):
    handle, stub = gateway_for(method)
    req = generate_request(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.8, seed=1234, k=3)
    with hooked(handle.backend.draft, "propose") as hook:
        proposals = []
        original = hook.original
        hook.original = lambda *a, **kw: proposals.append(original(*a, **kw)) or proposals[-1]
        first = generate(stub, req)
    second = generate(stub, req)
    assert (first.text, first.token_ids) == (second.text, second.token_ids)
    assert len(first.token_ids) == MAX_TOKENS and first.last.stats.num_accepted_tokens > 0
    # probabilistic drafting ships q (draft_probs) to the target; greedy drafting does not
    assert proposals and all((p.draft_probs is not None) == (method == "probabilistic") for p in proposals)
    other = generate(stub, generate_request(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.8, seed=99, k=3))
    assert other.token_ids != first.token_ids, "the seed has no effect"
    wait_released(stack.target, stack.draft)


def test_seeded_sampling_equals_offline_speculative(gen_stub, target_dir, good_draft_dir, spec):
    """Same draft, k, draft method and seed: the services and the offline LLM sample identically."""
    k = 3
    llm = LLM(str(target_dir), dtype="float32", speculative_config=spec(good_draft_dir, k))
    params = SamplingParams(temperature=0.8, seed=4321, max_tokens=MAX_TOKENS, ignore_eos=True)
    ref = llm.generate(PROMPTS[1], params)[0].outputs[0]
    out = generate(gen_stub, generate_request(PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.8, seed=4321, k=k))
    assert (out.text, out.token_ids) == (ref.text, list(ref.token_ids))
    assert out.last.stats.num_accepted_tokens == ref.spec_decode_stats.num_accepted_tokens


def test_responses_stream_incrementally(gen_stub):
    """One response per round, with cumulative stats, before the stream ends."""
    responses = gen_stub.Generate(generate_request(PROMPTS[0], max_tokens=MAX_TOKENS, k=1), timeout=60)
    first = next(responses)
    assert first.token_ids and first.finish_reason == gen_pb2.FINISH_REASON_UNSPECIFIED
    assert first.completion_tokens == len(first.token_ids) <= 2
    rest = collect(responses)
    passes = [r.stats.num_target_passes for r in [first, *rest.responses]]
    assert passes == list(range(1, len(passes) + 1))


def test_disable_by_batch_size_turns_speculation_off_under_load(servers, stack, references):
    """With disable_by_batch_size=1 every running sequence is 'load': rounds verify without drafts, and
    the output is still the target alone's."""
    handle = servers.gateway(stack.target, stack.draft, disable_by_batch_size=1)
    stub = generation_service_pb2_grpc.GenerationServiceStub(stack.channel(handle))
    out = generate(stub, generate_request(PROMPTS[0], max_tokens=MAX_TOKENS))
    assert (out.text, out.token_ids) == references[PROMPTS[0]]
    assert out.last.stats.num_draft_tokens == 0 and out.last.stats.num_target_passes == MAX_TOKENS
