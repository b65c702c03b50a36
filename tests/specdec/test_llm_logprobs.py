"""The offline LLM's logprobs (vLLM's ``SamplingParams(logprobs=N, prompt_logprobs=N)``): the target's
raw log-probabilities from the verify pass, equal to a plain transformers forward of the target."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("cached_model_loading")

PROMPT = "The quick brown fox"


@pytest.mark.parametrize("speculative", [True, False], ids=["draft k=3", "target alone"])
def test_offline_logprobs_equal_the_target_forward(target_dir, good_draft_dir, target_model, spec, speculative):
    llm = LLM(str(target_dir), speculative_config=spec(good_draft_dir, 3) if speculative else None, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    (out,) = llm.generate(PROMPT, params)
    gen = out.outputs[0]
    if speculative:
        assert gen.spec_decode_stats.num_accepted_tokens > 0  # multi-token blocks were scored
    ids = out.prompt_token_ids + gen.token_ids
    with torch.inference_mode():
        table = torch.log_softmax(target_model(torch.tensor([ids])).logits[0].float(), -1)
    n = len(out.prompt_token_ids)
    assert len(gen.logprobs) == len(gen.token_ids)
    for j, (t, position) in enumerate(zip(gen.token_ids, gen.logprobs)):
        row = table[n - 1 + j]
        assert position[t].logprob == pytest.approx(float(row[t]), abs=1e-4)
        top = row.topk(3).indices.tolist()
        assert [position[i].rank for i in top] == [1, 2, 3]
        assert position[t].rank == 1  # greedy: the chosen token is the most likely
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n
    for pos in range(1, n):
        t = out.prompt_token_ids[pos]
        assert out.prompt_logprobs[pos][t].logprob == pytest.approx(float(table[pos - 1, t]), abs=1e-4)
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert plain.outputs[0].token_ids == gen.token_ids and plain.outputs[0].logprobs is None
    assert plain.prompt_logprobs is None
