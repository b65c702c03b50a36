"""``LLM(speculative_config={"method": "eagle3", ...})``: a head trained here on the tiny target drafts, and the
output is the target's alone, greedy and seeded, through a draft that loses its state mid-stream."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.errors import ConfigError

pytestmark = pytest.mark.usefixtures("cached_model_loading")


def _spec(head, k=3, **extra):
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k, **extra}


@pytest.fixture(scope="module")
def alone(target_dir):
    return LLM(str(target_dir), dtype="float32")


@pytest.fixture(scope="module")
def eagle(target_dir, eagle3_head_dir):
    return LLM(str(target_dir), dtype="float32", speculative_config=_spec(eagle3_head_dir))


def _run(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_output_is_the_targets_and_drafts_are_accepted(target_dir, eagle3_head_dir, alone, eagle3_prompts, k):
    llm = LLM(str(target_dir), dtype="float32", speculative_config=_spec(eagle3_head_dir, k))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = _run(alone, eagle3_prompts, params)
    out = _run(llm, eagle3_prompts, params)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    accepted = sum(o.spec_decode_stats.num_accepted_tokens for o in out)
    drafted = sum(o.spec_decode_stats.num_draft_tokens for o in out)
    assert drafted > 0 and accepted > 0, (accepted, drafted)  # the head drafts, and is right a part of the time


@pytest.mark.heavy
def test_seeded_sampling_is_the_targets(alone, eagle, eagle3_prompts):
    params = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=11)
    assert [o.token_ids for o in _run(eagle, eagle3_prompts, params)] == \
        [o.token_ids for o in _run(alone, eagle3_prompts, params)]


@pytest.mark.heavy
def test_probabilistic_drafting_is_lossless_and_accepts(target_dir, eagle3_head_dir, alone, eagle3_prompts):
    llm = LLM(str(target_dir), dtype="float32",
              speculative_config=_spec(eagle3_head_dir, draft_sample_method="probabilistic"))
    params = SamplingParams(temperature=0.7, max_tokens=24, ignore_eos=True, seed=5)
    out = _run(llm, eagle3_prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in _run(alone, eagle3_prompts, params)]
    assert sum(o.spec_decode_stats.num_accepted_tokens for o in out) > 0


def test_a_draft_that_loses_its_state_mid_stream(alone, eagle, eagle3_prompts):
    """The head's sequences vanish after a few rounds (as a restarted draft's do): that round drafts nothing,
    the target feeds the history again for features, drafting resumes, and the output is unchanged."""
    store = eagle._draft_worker.worker.runner
    original = eagle._draft_worker.worker.propose_batch
    calls = {"n": 0}

    def forgetful(batch):
        calls["n"] += 1
        if calls["n"] % 4 == 0:
            store.sequences.clear()
        return original(batch)

    eagle._draft_worker.worker.propose_batch = forgetful
    try:
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        out = _run(eagle, eagle3_prompts[:3], params)
    finally:
        eagle._draft_worker.worker.propose_batch = original
    assert [o.token_ids for o in out] == [o.token_ids for o in _run(alone, eagle3_prompts[:3], params)]
    assert sum(o.spec_decode_stats.num_accepted_tokens for o in out) > 0


@pytest.mark.parametrize("extra, message", [
    ({"use_heterogeneous_vocab": True}, "cannot draft for another vocabulary"),
    ({"overlap": True}, "set overlap false"),
    ({"prompt_lookup_max": 3}, "does not combine"),
])
def test_eagle3_refuses_what_it_cannot_do(target_dir, eagle3_head_dir, extra, message):
    with pytest.raises(ConfigError, match=message):
        LLM(str(target_dir), dtype="float32", speculative_config=_spec(eagle3_head_dir, **extra))


def test_a_head_for_another_target_is_refused(shallow_draft_dir, other_vocab_dir, eagle3_head_dir):
    with pytest.raises(ConfigError, match="another target"):
        LLM(str(other_vocab_dir), dtype="float32", speculative_config=_spec(eagle3_head_dir))


@pytest.mark.heavy  # 5.1 s (seeded) in the whole run of 2026-12-07's evening
@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                    SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_head_trees_are_the_targets_and_verify_more_per_pass(target_dir, eagle3_head_dir, alone, eagle3_prompts,
                                                            params):
    """speculative_token_tree "dynamic" with an EAGLE-3 head: the head grows top-k trees, the target verifies each
    as a tree and returns the accepted path's features (its next round drafts from them), and the output is the
    target's alone; greedy, the trees verify at least as many tokens per pass as the head's chains."""
    chains = LLM(str(target_dir), dtype="float32", speculative_config=_spec(eagle3_head_dir, 3))
    trees = LLM(str(target_dir), dtype="float32", speculative_config=_spec(
        eagle3_head_dir, 3, speculative_token_tree="dynamic", speculative_eagle_topk=3,
        speculative_num_draft_tokens=10))
    seen = []
    worker = trees._target_worker
    inner = getattr(worker, "worker", worker)  # the relayed target wraps the TargetWorker
    original = inner.verify_batch

    def recording(calls):
        seen.extend((c.proposal.is_tree, bool(c.feature_layers)) for c in calls)
        return original(calls)

    inner.verify_batch = recording
    ref = _run(alone, eagle3_prompts, params)
    got_chains, got_trees = _run(chains, eagle3_prompts, params), _run(trees, eagle3_prompts, params)
    assert [o.token_ids for o in got_trees] == [r.token_ids for r in ref] == [o.token_ids for o in got_chains]
    assert (True, True) in seen  # trees verified with features asked
    if params.temperature == 0:
        per_pass = [sum(len(o.token_ids) for o in outs) / sum(o.spec_decode_stats.num_target_passes for o in outs)
                    for outs in (got_chains, got_trees)]
        assert per_pass[1] >= per_pass[0], per_pass


@pytest.mark.heavy
@pytest.mark.parametrize("tree, min_score", [(None, 0.0), ("dynamic", 0.0), ("dynamic", 1.0)])
def test_suffix_decoding_before_the_head(target_dir, eagle3_head_dir, alone, eagle3_prompts, tree, min_score):
    """enable_suffix_decoding (ArcticInference's key): a suffix match proposes (with suffix_decoding_min_score, one
    expecting at least that many accepted tokens), else the head. On suffix rounds the head still takes that round's
    features, so it never asks the target for them again; the output is the target's alone."""
    llm = LLM(str(target_dir), dtype="float32", speculative_config=_spec(
        eagle3_head_dir, 8, enable_suffix_decoding=True, draft_model_num_speculative_tokens=3,
        speculative_token_tree=tree, suffix_decoding_min_score=min_score))
    hybrid = llm._draft_worker.worker
    head = hybrid.model
    rounds = {"head": 0, "suffix": 0}
    lagging = []
    original_propose, original_absorb = head.propose_batch, head.absorb

    def propose(calls):
        rounds["head"] += len(calls)
        return original_propose(calls)

    def absorb(calls):
        out = original_absorb(calls)
        rounds["suffix"] += len(calls)
        # (a sequence's first round has no features yet: the target has not read the prompt)
        lagging.extend(held for call, held in zip(calls, out) if call.features and held != len(call.token_ids) - 1)
        return out

    head.propose_batch, head.absorb = propose, absorb
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # each prompt twice: the second time the first one's output is in the global suffix tree
    prompts = eagle3_prompts[:3] * 2
    out = _run(llm, prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in _run(alone, prompts, params)]
    assert rounds["head"] > 0 and rounds["suffix"] > 0, rounds
    assert not lagging  # every suffix round left the head holding every position's feature
    assert sum(o.spec_decode_stats.num_accepted_tokens for o in out[3:]) > \
        sum(o.spec_decode_stats.num_accepted_tokens for o in out[:3])


@pytest.mark.heavy
@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                                    SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_suffix_trees_merged_with_the_heads(target_dir, eagle3_head_dir, alone, eagle3_prompts, params, monkeypatch):
    """suffix_decoding_merge_score: a suffix tree expecting fewer accepted tokens than this is merged with the head's
    tree of the same round (specdec.trees.merge), and the output is still the target's alone."""
    import specdec.ngram

    merged = []
    original = specdec.ngram.merge

    def recording(trees, max_nodes):
        out = original(trees, max_nodes)
        merged.append((trees, out, max_nodes))
        return out

    monkeypatch.setattr(specdec.ngram, "merge", recording)
    llm = LLM(str(target_dir), dtype="float32", speculative_config=_spec(
        eagle3_head_dir, 8, enable_suffix_decoding=True, draft_model_num_speculative_tokens=3,
        speculative_token_tree="dynamic", suffix_decoding_merge_score=100.0))
    prompts = eagle3_prompts[:3] * 2  # the second time the first one's output is in the global suffix tree
    out = _run(llm, prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in _run(alone, prompts, params)]
    assert merged, "no round merged a suffix tree with the head's"
    for (suffix, head), (tokens, _, _), max_nodes in merged:
        assert len(tokens) <= max_nodes <= 8  # the round's k (fewer near max_tokens)
    # the head's nodes joined suffix trees (more nodes than the suffix's alone, where the budget left room)
    assert any(len(tokens) > len(suffix[0]) for (suffix, _), (tokens, _, _), _ in merged)


@pytest.mark.parametrize("spec, message", [
    ({"method": "draft_model", "model": "x", "enable_suffix_decoding": True}, "use \"method\": \"suffix\""),
    ({"method": "eagle3", "model": "x", "enable_suffix_decoding": 1}, "must be true or false"),
    ({"method": "eagle3", "model": "x", "prompt_lookup_max": 3}, "enable_suffix_decoding puts suffix"),
])
def test_enable_suffix_decoding_is_checked(spec, message):
    from specdec.config import SpeculativeConfig

    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.from_any(spec)
