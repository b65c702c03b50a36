"""Seeded sampling through the offline ``LLM`` under the coupled rule (the default): the same seed gives
the same text with any draft (model draft, probabilistic or greedy drafting, n-gram, hybrid, a draft
that is almost always wrong), any k, and speculation off; ``seeded_sampling="rejection"`` keeps
rejection sampling; requests without a seed are never coupled."""

from __future__ import annotations

import pytest

import specdec.engine.workers
from specdec import LLM, SamplingParams
from specdec.errors import ConfigError

pytestmark = pytest.mark.usefixtures("cached_model_loading")

PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    return"]
PARAMS = SamplingParams(temperature=1.0, top_p=0.95, seed=77, max_tokens=24, ignore_eos=True)


def _tokens(llm: LLM, params: SamplingParams = PARAMS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def alone(target_dir) -> LLM:
    return LLM(str(target_dir), dtype="float32")


def _configs(good, bad, spec) -> dict[str, dict]:
    return {
        "k1": spec(good, 1, draft_sample_method="probabilistic"),
        "k3": spec(good, 3, draft_sample_method="probabilistic"),
        "k5": spec(good, 5, draft_sample_method="probabilistic"),
        "greedy-drafting-k3": spec(good, 3),
        "bad-draft-k3": spec(bad, 3, draft_sample_method="probabilistic"),
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
        "hybrid": spec(good, 3, draft_sample_method="probabilistic", prompt_lookup_max=3),
        "overlap": spec(good, 3, draft_sample_method="probabilistic", overlap=True),
    }


@pytest.mark.parametrize("name", ["k1", "k3", "k5", "greedy-drafting-k3", "bad-draft-k3", "ngram", "hybrid", "overlap"])
def test_seeded_output_is_the_same_with_any_drafter(name, alone, target_dir, good_draft_dir, bad_draft_dir, spec):
    reference = _tokens(alone)
    llm = LLM(str(target_dir), speculative_config=_configs(good_draft_dir, bad_draft_dir, spec)[name], dtype="float32")
    outs = llm.generate(PROMPTS, PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = [o.spec_decode_stats for o in outs]
    assert sum(s.num_draft_tokens for s in stats) > 0, "nothing was drafted"
    if name in ("k1", "k3", "k5", "hybrid", "overlap"):
        assert sum(s.num_accepted_tokens for s in stats) > 0, "nothing was accepted"


def test_penalties_logit_bias_and_n_are_draft_invariant(alone, target_dir, good_draft_dir, spec):
    """Penalties for row j follow history + drafts[:j] on the target, as decoding alone has them."""
    params = PARAMS.clone(n=2, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                          logit_bias={11: 3.0}, min_tokens=4)
    llm = LLM(str(target_dir), speculative_config=spec(good_draft_dir, 3, draft_sample_method="probabilistic"),
              dtype="float32")
    got = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, params)]
    assert got == [[c.token_ids for c in o.outputs] for o in alone.generate(PROMPTS, params)]
    assert got[0][0] != got[0][1]  # n > 1: each output has its own seed


def test_rejection_setting_keeps_rejection_sampling(alone, target_dir, good_draft_dir, spec):
    """Under "rejection" the seeded text depends on the draft (the two rules draw different numbers)."""
    cfg = spec(good_draft_dir, 3, draft_sample_method="probabilistic")
    rejection = LLM(str(target_dir), speculative_config=cfg, dtype="float32", seeded_sampling="rejection")
    assert rejection._target_worker.seeded_sampling == "rejection"
    out = _tokens(rejection)
    assert out == _tokens(rejection), "rejection sampling with a seed is not reproducible"
    assert out != _tokens(alone)


def test_unseeded_requests_are_never_coupled(target_dir, good_draft_dir, spec, monkeypatch):
    """The LLM gives an unseeded request a seed of its own (reproducible runs), yet it keeps rejection
    sampling; a seeded one races."""
    calls = []
    real = specdec.engine.workers.race_noise
    monkeypatch.setattr(specdec.engine.workers, "race_noise", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    llm = LLM(str(target_dir), speculative_config=spec(good_draft_dir, 2, draft_sample_method="probabilistic"),
              dtype="float32")
    llm.generate(PROMPTS[0], PARAMS.clone(seed=None, max_tokens=6))
    assert calls == []
    seq = llm.new_sequence([1, 2, 3], PARAMS.clone(seed=None))
    assert seq.params.seed is not None and seq.params.engine_seed and not seq.params.couples
    llm.generate(PROMPTS[0], PARAMS.clone(max_tokens=6))
    assert calls and {a[0] for a in calls} == {PARAMS.seed}


def test_greedy_requests_are_untouched(alone, target_dir, good_draft_dir, spec):
    params = SamplingParams(temperature=0.0, seed=5, max_tokens=16, ignore_eos=True)
    llm = LLM(str(target_dir), speculative_config=spec(good_draft_dir, 3, draft_sample_method="probabilistic"),
              dtype="float32")
    assert _tokens(llm, params) == _tokens(alone, params) == _tokens(alone, params.clone(seed=None))


def test_logprobs_are_the_targets_raw_ones(alone, target_dir, good_draft_dir, spec):
    """A coupled row goes through acceptance as a greedy row of p / E; logprobs still come from raw logits."""
    params = PARAMS.clone(logprobs=2, max_tokens=8)
    llm = LLM(str(target_dir), speculative_config=spec(good_draft_dir, 3, draft_sample_method="probabilistic"),
              dtype="float32")
    got = llm.generate(PROMPTS[0], params)[0].outputs[0].logprobs
    ref = alone.generate(PROMPTS[0], params)[0].outputs[0].logprobs
    assert [sorted(d) for d in got] == [sorted(d) for d in ref]
    for g, r in zip(got, ref):
        for t in g:
            assert g[t].logprob == pytest.approx(r[t].logprob, abs=1e-4)


def test_bad_setting_is_a_clear_error(target_dir):
    with pytest.raises(ConfigError, match=r"seeded_sampling must be one of \['coupled', 'rejection'\]"):
        LLM(str(target_dir), dtype="float32", seeded_sampling="gumbel")
