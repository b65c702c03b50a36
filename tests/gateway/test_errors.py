"""Bad Generate requests get INVALID_ARGUMENT with a useful message; the gateway keeps serving."""

from __future__ import annotations

import grpc
import pytest

from tests.services_conftest_helpers import (
    PROMPTS,
    generate,
    generate_request,
    rpc_error,
    wait_released,
)

VOCAB = 49152
MAX_MODEL_LEN = 256  # the tiny models' max_position_embeddings


def _with_sampling(req, **fields):
    for name, value in fields.items():
        setattr(req.sampling_params, name, value)
    return req


def _bad_request(tokenizer, case: str):
    """(request, words its error message must contain)."""
    ids = tokenizer(PROMPTS[0]).input_ids
    p = PROMPTS[0]
    return {
        "empty prompt": lambda: (generate_request(""), ["prompt", "empty"]),
        "empty prompt_token_ids": lambda: (generate_request(prompt_token_ids=[]), ["prompt", "empty"]),
        "max_tokens=0": lambda: (generate_request(p, max_tokens=0), ["max_tokens"]),
        "num_speculative_tokens too large": lambda: (generate_request(p, k=33), ["num_speculative_tokens", "33"]),
        "prompt over max_model_len": lambda: (generate_request(prompt_token_ids=[ids[0]] * MAX_MODEL_LEN),
                                              ["max_model_len", str(MAX_MODEL_LEN)]),
        "prompt text over max_model_len": lambda: (generate_request(" hello" * (MAX_MODEL_LEN + 10)), ["max_model_len"]),
        "prompt and prompt_token_ids": lambda: (generate_request(p, prompt_token_ids=ids), ["prompt_token_ids"]),
        "out-of-vocab prompt_token_ids": lambda: (generate_request(prompt_token_ids=[ids[0], VOCAB + 7]),
                                                  ["prompt token ids", str(VOCAB + 7), "vocabulary"]),
        "temperature < 0": lambda: (generate_request(p, temperature=-1.0), ["temperature"]),
        "top_p > 1": lambda: (_with_sampling(generate_request(p, temperature=1.0), top_p=1.5), ["top_p"]),
        "top_k < -1": lambda: (_with_sampling(generate_request(p, temperature=1.0), top_k=-5), ["top_k"]),
        "seed >= 2**63": lambda: (generate_request(p, temperature=1.0, seed=2**63), ["seed"]),
    }[case]()


BAD = [
    "empty prompt", "empty prompt_token_ids", "max_tokens=0", "num_speculative_tokens too large",
    "prompt over max_model_len", "prompt text over max_model_len",
    "prompt and prompt_token_ids", "out-of-vocab prompt_token_ids", "temperature < 0", "top_p > 1",
    "top_k < -1", "seed >= 2**63",
]


@pytest.mark.parametrize("case", BAD)
def test_bad_request_is_invalid_argument_and_gateway_keeps_serving(stack, gen_stub, tokenizer, case):
    request, words = _bad_request(tokenizer, case)
    err = rpc_error(lambda: gen_stub.Generate(request, timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, err.code(), err.details())
    for word in words:
        assert word in err.details(), (case, err.details())
    # nothing was left behind on the backends (releases are not waited for: poll), and a normal
    # request still succeeds
    wait_released(stack.target, stack.draft)
    out = generate(gen_stub, generate_request(PROMPTS[1], max_tokens=4))
    assert len(out.token_ids) == 4


def test_prompt_filling_max_model_len_minus_one_is_accepted(gen_stub, tokenizer):
    """The boundary: one free position is enough to generate one token (finish_reason length)."""
    ids = tokenizer(PROMPTS[0]).input_ids
    prompt = (ids * MAX_MODEL_LEN)[: MAX_MODEL_LEN - 1]
    out = generate(gen_stub, generate_request(prompt_token_ids=prompt, max_tokens=None))
    assert len(out.token_ids) == 1 and out.last.completion_tokens == 1
    # asking for more than that one position is refused up front, naming max_tokens and the limit
    err = rpc_error(lambda: generate(gen_stub, generate_request(prompt_token_ids=prompt, max_tokens=50)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens=50" in err.details() and "at most 1" in err.details()
