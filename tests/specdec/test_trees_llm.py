"""Token trees end to end in the offline LLM (speculative_token_tree "dynamic" with suffix decoding): output is
the target's own in greedy, penalised-with-logprobs and seeded modes, with trees proposed and verified (that a
branch other than the first gets accepted is tests/specdec/engine/test_trees.py's, and the real pair's below)."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.errors import ConfigError

pytestmark = pytest.mark.usefixtures("cached_model_loading")

# prompts whose own text branches after a repeated context (the sequence's suffix tree holds several
# continuations), and requests that share a start (the global tree)
PROMPTS = ["x. a b c d. x. a b e f. x. a b g h. x. a b",
           "go. p q r. go. p q s. go. p q",
           "x. a b c d. x. a b e f. x. a b g h. x. a b"]
TREE = {"method": "suffix", "num_speculative_tokens": 12, "speculative_token_tree": "dynamic"}


def _recording(llm):
    """Wrap the target worker: record every tree call's accepted path (and the proposal's parents)."""
    worker = llm._target_worker
    real = worker.verify_batch
    seen = []

    def verify_batch(calls):
        results = real(calls)
        for call, result in zip(calls, results):
            if call.proposal.is_tree and not isinstance(result, BaseException):
                seen.append((call.proposal.parents, result.accepted_path))
        return results

    worker.verify_batch = verify_batch
    return seen


def test_greedy_with_suffix_trees_is_the_target_alone(target_dir):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = LLM(str(target_dir), dtype="float32").generate(PROMPTS, params)
    llm = LLM(str(target_dir), dtype="float32", speculative_config=TREE)
    seen = _recording(llm)
    for _ in range(2):  # the second pass drafts from the first one's outputs too
        for prompt, ref in zip(PROMPTS, alone):
            assert llm.generate([prompt], params)[0].outputs[0].token_ids == ref.outputs[0].token_ids
    assert seen, "no round proposed a tree"


def test_penalties_logprobs_and_seeds_with_trees_equal_the_target_alone(target_dir):
    llm = LLM(str(target_dir), dtype="float32", speculative_config=TREE)
    seen = _recording(llm)
    alone = LLM(str(target_dir), dtype="float32")
    for params in (SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, presence_penalty=0.4,
                                  frequency_penalty=0.3, repetition_penalty=1.1, logprobs=2),
                   SamplingParams(temperature=0.9, seed=7, max_tokens=20, ignore_eos=True)):
        refs = alone.generate(PROMPTS, params)
        for _ in range(2):
            for prompt, ref in zip(PROMPTS, refs):
                got = llm.generate([prompt], params)[0].outputs[0]
                assert got.token_ids == ref.outputs[0].token_ids
                if params.logprobs:
                    for mine, want in zip(got.logprobs, ref.outputs[0].logprobs):
                        assert mine.keys() == want.keys()
                        for t in want:
                            assert mine[t].logprob == pytest.approx(want[t].logprob, abs=1e-4)
    assert seen


def test_token_tree_config_is_checked(target_dir):
    with pytest.raises(ConfigError, match="static speculative_token_tree shapes a draft model's trees"):
        LLM(str(target_dir), speculative_config={**TREE, "speculative_token_tree": "[(0,), (1,)]"})
    with pytest.raises(ConfigError, match="is not a tree shape"):
        LLM(str(target_dir), speculative_config={**TREE, "speculative_token_tree": "sometimes"})
    with pytest.raises(ConfigError, match="static speculative_token_tree shapes a draft model's trees"):
        LLM(str(target_dir), speculative_config={"method": "eagle3", "model": "smollm2-135m-eagle3",
                                                 "speculative_token_tree": "[(0,), (1,)]"})


def _greedy_and_seeded_are_the_target_alone(target_dir, llm):
    alone = LLM(str(target_dir), dtype="float32")
    for params in (SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                   SamplingParams(temperature=0.9, seed=3, max_tokens=20, ignore_eos=True)):
        refs = alone.generate(PROMPTS, params)
        for prompt, ref in zip(PROMPTS, refs):
            assert llm.generate([prompt], params)[0].outputs[0].token_ids == ref.outputs[0].token_ids


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
     "speculative_token_tree": "dynamic"},
    {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
     "speculative_token_tree": "dynamic", "model": "DRAFT", "draft_model_num_speculative_tokens": 2},
], ids=["ngram", "ngram-hybrid"])
def test_ngram_trees_are_the_target_alone(target_dir, good_draft_dir, spec):
    """N-gram lookup proposes a tree where the matched n-gram occurred before with different continuations;
    greedy and seeded output stay the target's own."""
    spec = {**spec, "model": str(good_draft_dir)} if "model" in spec else spec
    llm = LLM(str(target_dir), dtype="float32", speculative_config=spec)
    seen = _recording(llm)
    _greedy_and_seeded_are_the_target_alone(target_dir, llm)
    assert seen, "no round proposed a tree"


def test_suffix_trees_merged_with_the_draft_models_are_the_target_alone(target_dir, good_draft_dir, monkeypatch):
    """suffix_decoding_merge_score with a draft model: the suffix tree and the model's top-k tree of the same round
    become one tree (specdec.trees.merge); greedy and seeded output stay the target's own."""
    import specdec.ngram

    merged = []
    original = specdec.ngram.merge
    monkeypatch.setattr(specdec.ngram, "merge", lambda trees, n: merged.append(trees) or original(trees, n))
    llm = LLM(str(target_dir), dtype="float32", speculative_config={
        **TREE, "model": str(good_draft_dir), "draft_model_num_speculative_tokens": 2,
        "suffix_decoding_merge_score": 100.0})
    seen = _recording(llm)
    _greedy_and_seeded_are_the_target_alone(target_dir, llm)
    assert merged and seen
    assert all(model[2] for _, model in merged)  # the model's nodes came with their estimates
