"""Suffix decoding: proposals equal a brute-force search over the histories and cached outputs, the global
tree is bounded and learns across requests, greedy output equals the target alone, and suffix proposals
keep sampling lossless (chi-square, with a negative control)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

import specdec.engine.workers
from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.errors import ConfigError
from specdec.history import TokenHistory
from specdec.ngram import lookup_indexes
from specdec.config import SuffixSettings
from specdec.suffix import SuffixCache
from tests.broken_samplers import accept_always, rowwise
from tests.first_token_chi2 import first_token_pvalue, target_first_token

pytestmark = pytest.mark.usefixtures("cached_model_loading")


class Tie(Exception):
    """The brute force met two equally frequent continuations (the tree may pick either)."""


def _count(seqs: list[list[int]], w: list[int], depth: int) -> int:
    if len(w) > depth:
        return 0
    n = len(w)
    return sum(1 for s in seqs for i in range(len(s) - n + 1) if s[i:i + n] == w)


def _walk(seqs, w, max_tokens, min_prob, depth) -> tuple[float, list[int]]:
    path, prob, score, drafted = list(w), 1.0, 0.0, []
    while len(drafted) < max_tokens:
        total = _count(seqs, path, depth)
        followers = Counter(s[i + len(path)] for s in seqs for i in range(len(s) - len(path))
                            if s[i:i + len(path)] == path) if len(path) < depth else Counter()
        if not followers:
            break
        (token, count), *rest = followers.most_common()
        if rest and rest[0][1] == count:
            raise Tie
        prob *= count / total
        if prob < min_prob:
            break
        drafted.append(token)
        path.append(token)
        score += prob
    return score, drafted


def brute_force(seqs, context, k, s: SuffixSettings) -> tuple[float, list[int]]:
    """ArcticInference's rule, searched directly: every match length 1..len(context)-1 of the context's last
    max_tree_depth tokens; from each, the most frequent path while its probability >= min_token_prob, at most
    min(k, factor x match) tokens; the best score wins (the longer match on equal scores)."""
    context = context[-s.max_tree_depth:]
    best = (0.0, [])
    for m in range(1, len(context)):
        w = context[len(context) - m:]
        if _count(seqs, w, s.max_tree_depth) == 0:
            break
        score, drafted = _walk(seqs, w, min(k, int(m * s.max_spec_factor + 1e-6)), s.min_token_prob, s.max_tree_depth)
        if score >= best[0]:
            best = (score, drafted)
    return best


def _stream(rng: random.Random, vocab: int, length: int) -> list[int]:
    """Random tokens with repeated fragments (so long matches occur)."""
    out: list[int] = []
    while len(out) < length:
        if out and rng.random() < 0.4:
            start = rng.randrange(len(out))
            out += out[start:start + rng.randint(2, 8)]
        else:
            out.append(rng.randrange(vocab))
    return out[:length]


@pytest.mark.parametrize("seed", range(4))
def test_proposals_equal_a_brute_force_search(seed):
    """Sequences grown round by round, with cut-backs (a lookahead's drafts lost) and earlier sequences'
    outputs in the global tree: each proposal's score and tokens are the brute force's over the own history
    (local tree) or the cached outputs (global tree), whichever scores higher."""
    rng = random.Random(seed)
    settings = SuffixSettings(max_tree_depth=rng.choice([4, 8, 24]), max_cached_requests=rng.choice([1, 3, 100]),
                              max_spec_factor=rng.choice([0.5, 1.0, 2.0]), min_token_prob=rng.choice([0.0, 0.1, 0.4]))
    cache = SuffixCache(settings)
    outputs: list[tuple[int, list[int]]] = []  # (sequence number, its kept output) in admission order
    compared = 0
    for number in range(12):
        vocab = rng.choice([3, 5, 8])
        prompt = _stream(rng, vocab, rng.randint(1, 20))
        index, history = cache(), TokenHistory(prompt)
        index.sync(history)
        outputs.append((number, []))
        for _ in range(rng.randint(1, 10)):
            if len(history) > len(prompt) and rng.random() < 0.3:
                history.truncate(rng.randint(len(prompt), len(history)))
            history.extend(_stream(rng, vocab, rng.randint(1, 5)))
            index.sync(history if rng.random() < 0.7 else list(history))
            outputs[-1] = (number, list(history[len(prompt):]))
            cached = [o for _, o in outputs[-settings.max_cached_requests:]]
            k = rng.choice([1, 4, 32])
            drafted = index.propose(k)
            try:
                local = brute_force([list(history)], list(history), k, settings)
                glob = brute_force(cached, list(history), k, settings)
            except Tie:
                continue
            want = local if local[0] >= glob[0] else glob
            assert index.last_score == pytest.approx(want[0], rel=1e-5), (history, cached, k, settings)
            if local[0] != glob[0]:  # (on equal scores either tree's draft may be returned)
                assert drafted == want[1], (history, cached, k, settings)
            assert len(drafted) <= k and index.tokens == list(history)
            compared += 1
        index.close()
    assert compared >= 20, f"only {compared} proposals were free of ties: make the streams less regular"
    assert cache.cached_requests() == min(12, settings.max_cached_requests)


def test_global_tree_is_bounded_and_evicts_the_oldest():
    cache = SuffixCache(SuffixSettings(max_cached_requests=3))
    for i in range(10):
        index = cache()
        index.sync([100 + i])
        index.sync([100 + i, 1000 * i + 1, 1000 * i + 2, 1000 * i + 3, 1000 * i + 4])
        index.close()
    assert cache.cached_requests() == 3 and cache.evicted == 7
    probe = cache()
    probe.sync([5, 1000 * 9 + 1, 1000 * 9 + 2])  # the latest output is cached: it drafts on
    assert probe.propose(8) == [9003, 9004]
    probe.sync([5, 1001, 1002])  # the first one's output was evicted (and the prompt alone never enters it)
    assert probe.propose(8) == []
    before = cache.memory_bytes()
    assert before > 0
    off = SuffixCache(SuffixSettings(max_cached_requests=0))
    index = off()
    index.sync([1])
    index.sync([1, 2, 3])
    assert off.cached_requests() == 0 and off().propose(4) == []


def test_a_proposal_below_min_score_is_not_made():
    """suffix_decoding_min_score: a match whose drafts' summed probabilities fall below it proposes nothing (a
    hybrid's model drafts that round); the score is still recorded."""
    history = [7, 1, 2, 3, 4, 9, 1, 2, 3, 5, 8, 1, 2]  # after "1 2": 3 twice, then 4 or 5
    made = {}
    for min_score in (0.0, 0.5, 50.0):
        index = SuffixCache(SuffixSettings(max_cached_requests=0, max_spec_factor=4.0, min_score=min_score))()
        index.sync(history)
        made[min_score] = (index.propose(4), index.last_score)
    assert made[0.0][0] and made[0.0][0] == made[0.5][0] and made[0.0][1] >= 0.5
    assert made[50.0] == ([], made[0.0][1])
    with pytest.raises(ConfigError, match="min_score"):
        SuffixSettings(min_score=-1)


def test_dropped_sequences_free_their_own_tree():
    """A sequence dropped without close() (a hybrid draft's runner expiring it) is not kept alive by the cache."""
    import gc
    import weakref

    cache = SuffixCache()
    index = cache()
    index.sync([1, 2, 3])
    ref = weakref.ref(index)
    del index
    gc.collect()
    assert ref() is None and cache.cached_requests() == 1


def test_suffix_config_is_checked():
    cfg = SpeculativeConfig.from_any({"method": "suffix"})
    assert cfg.model_free and cfg.num_speculative_tokens == 24 and isinstance(lookup_indexes(cfg), SuffixCache)
    assert SpeculativeConfig.from_any({"method": "suffix", "suffix_decoding_max_tree_depth": 8}).num_speculative_tokens == 8
    assert SpeculativeConfig.from_any({"method": "suffix", "suffix_decoding_max_tree_depth": 64}).num_speculative_tokens == 32
    hybrid = SpeculativeConfig.from_any({"method": "suffix", "model": "d", "num_speculative_tokens": 4})
    assert not hybrid.model_free and hybrid.uses_lookup
    with pytest.raises(ConfigError, match="draft_model_num_speculative_tokens"):
        SpeculativeConfig.from_any({"method": "suffix", "draft_model_num_speculative_tokens": 2})  # no model
    with pytest.raises(ConfigError, match="draft_model_num_speculative_tokens"):
        SpeculativeConfig.from_any({"model": "d", "num_speculative_tokens": 2, "draft_model_num_speculative_tokens": 3})
    for bad, words in (({"method": "suffix", "num_speculative_tokens": 33}, ["num_speculative_tokens"]),
                       ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, ["suffix_decoding_max_tree_depth"]),
                       ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, ["max_cached_requests"]),
                       ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, ["min_token_prob"]),
                       ({"method": "suffix", "suffix_decoding_max_spec_factor": "2"}, ["max_spec_factor"]),
                       ({"method": "suffix", "prompt_lookup_max": 3}, ["prompt_lookup_max"])):
        with pytest.raises(ConfigError) as err:
            SpeculativeConfig.from_any(bad)
        assert all(w in str(err.value) for w in words), (bad, err.value)


REPEATING = "The cat sat on the mat. The cat sat on the mat. The cat sat on the"


def test_greedy_equals_target_alone_and_the_global_tree_learns(target_dir, good_draft_dir):
    """Greedy output is the target's, with suffix drafting alone and hybrid; a repeated request's second run
    drafts its output from the global tree (in a third of the rounds)."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [REPEATING, "def f(x):\n    return x\n\ndef g(x):\n    return", "Hello"]
    alone = LLM(str(target_dir), dtype="float32").generate(prompts, params)
    llm = LLM(str(target_dir), speculative_config={"method": "suffix", "num_speculative_tokens": 16}, dtype="float32")
    first = llm.generate(prompts, params)
    again = llm.generate(prompts, params)
    for ref, a, b in zip(alone, first, again):
        assert a.outputs[0].token_ids == ref.outputs[0].token_ids == b.outputs[0].token_ids
    hello_first, hello_again = first[2].spec_decode_stats, again[2].spec_decode_stats
    # drafts grow with the match (factor 1: 1, 2, 4, 8, 16 tokens), so most of the 40 tokens are drafted
    assert hello_again.num_accepted_tokens >= 24, hello_again.as_dict()
    assert hello_again.num_target_passes <= hello_first.num_target_passes // 3, (hello_first.as_dict(),
                                                                              hello_again.as_dict())
    hybrid = LLM(str(target_dir), dtype="float32",
                 speculative_config={"method": "suffix", "model": str(good_draft_dir), "num_speculative_tokens": 8,
                                     "draft_model_num_speculative_tokens": 2})
    calls, model_ks = Counter(), set()
    model_propose = hybrid._draft_worker.model.propose_batch

    def counted(batch):
        calls.update(model=len(batch))
        model_ks.update(c.num_speculative_tokens for c in batch)
        return model_propose(batch)

    hybrid._draft_worker.model.propose_batch = counted
    outs = hybrid.generate(prompts, params)
    for ref, out in zip(alone, outs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    rounds = sum(o.spec_decode_stats.num_target_passes for o in outs)
    assert 0 < calls["model"] < rounds, "hybrid drafting used only one of its two drafters"
    assert max(model_ks) <= 2, model_ks  # the model drafts its own k; suffix drafts up to 8


@pytest.mark.heavy
def test_suffix_sampling_follows_the_target_and_a_broken_rule_is_caught(target_dir, chi2_pvalue, monkeypatch):
    """First emitted token after a prompt whose suffix always matches: with suffix proposals (no q) it
    follows p; accepting every proposal instead (the negative control) does not."""
    params = SamplingParams(temperature=1.0, top_k=8, max_tokens=2)
    prompt, p, support = target_first_token(target_dir, REPEATING, params)
    llm = LLM(str(target_dir), speculative_config={"method": "suffix", "num_speculative_tokens": 2,
                                                   "suffix_decoding_max_cached_requests": 0},
              dtype="float32", seeded_sampling="rejection")
    probe = SuffixCache(SuffixSettings(max_cached_requests=0))()
    probe.sync(prompt)
    assert probe.propose(2), "the prompt's own suffix tree must propose"
    assert first_token_pvalue(llm, prompt, params, p, support, chi2_pvalue) > 1e-3
    monkeypatch.setattr(specdec.engine.workers, "accept_batch", rowwise(accept_always))
    assert first_token_pvalue(llm, prompt, params, p, support, chi2_pvalue) < 1e-3


def test_penalties_and_logprobs_with_suffix_drafts_equal_the_target_alone(target_dir):
    """Penalties change the target's distribution at each verified position (the drafts do not know them);
    logprobs are the target's: both equal target-only decoding with the same parameters."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, presence_penalty=0.4,
                            frequency_penalty=0.3, repetition_penalty=1.1, logprobs=2)
    alone = LLM(str(target_dir), dtype="float32").generate([REPEATING], params)[0].outputs[0]
    llm = LLM(str(target_dir), speculative_config={"method": "suffix", "num_speculative_tokens": 8}, dtype="float32")
    for _ in range(2):  # the second run drafts from the first one's output, which the penalties shaped
        out = llm.generate([REPEATING], params)[0]
        got = out.outputs[0]
        assert got.token_ids == alone.token_ids
        for mine, ref in zip(got.logprobs, alone.logprobs):
            assert mine.keys() == ref.keys()
            for t in ref:
                assert mine[t].logprob == pytest.approx(ref[t].logprob, abs=1e-4)
    assert out.spec_decode_stats.num_accepted_tokens > 0
