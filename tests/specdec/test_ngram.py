"""N-gram drafting: the index's proposals equal a brute-force search, greedy output with n-gram and
hybrid drafting equals the target alone, and n-gram proposals keep sampling lossless (chi-square,
with a negative control)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

import specdec.engine.workers
from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.errors import ConfigError
from specdec.ngram import NgramIndex, NgramIndexes, NgramStore, NgramWorker, merge_branches
from specdec.proposal import Proposal
from specdec.trees import check_parents
from tests.broken_samplers import accept_always, rowwise
from tests.first_token_chi2 import first_token_pvalue, target_first_token

pytestmark = pytest.mark.usefixtures("cached_model_loading")


def brute_force(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    for n in range(min(high, len(tokens)), low - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence with a follower
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@pytest.mark.parametrize("low, high", [(1, 1), (1, 3), (2, 4), (3, 3)])
def test_index_proposals_equal_a_brute_force_search(low, high):
    rng = random.Random(low * 10 + high)
    for trial in range(30):
        vocab = rng.choice([3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
        index = NgramIndex(low, high)
        # grown in random steps, as rounds commit tokens, and checked after each step
        cut = 0
        while cut < len(tokens):
            cut = min(len(tokens), cut + rng.randrange(1, 5))
            index.sync(tokens[:cut])
            for k in (1, 3, 8):
                assert index.propose(k) == brute_force(tokens[:cut], k, low, high), (tokens[:cut], k, low, high)
    index.sync([1, 2, 3])  # a history that does not continue the indexed one: rebuilt
    assert index.tokens == [1, 2, 3] and index.propose(2) == brute_force([1, 2, 3], 2, low, high)


@pytest.mark.parametrize("undo", [2, 8, 256])
def test_index_kept_in_place_equals_an_index_rebuilt_from_scratch(monkeypatch, undo):
    """Rounds that append and cut back (a lookahead's drafts lost): syncing with only what changed (the
    same TokenHistory) or by comparing (a plain list) leaves exactly the index of the history built anew,
    whether a cut is undone entry by entry or is deeper than the undo log and rebuilds."""
    from specdec.history import TokenHistory

    monkeypatch.setattr(NgramIndex, "UNDO_POSITIONS", undo)
    rng = random.Random(undo)
    for trial in range(60):
        low = rng.randint(1, 3)
        high = low + rng.randint(0, 2)
        vocab = rng.choice([2, 3, 5, 20])
        index, history = NgramIndex(low, high), TokenHistory()
        tokens_list = index.tokens
        for _ in range(40):
            if history and rng.random() < 0.35:
                history.truncate(rng.randrange(len(history) + 1))
            history.extend(rng.randrange(vocab) for _ in range(rng.randrange(5)))
            index.sync(history if rng.random() < 0.8 else list(history))
            fresh = NgramIndex(low, high)
            fresh.extend(list(history))
            assert index.tokens == history and index._after == fresh._after
            assert index.tokens is tokens_list  # one list, changed in place (a service compares it with what it sent)
            assert index.propose(3) == brute_force(list(history), 3, low, high)


def brute_force_branches(tokens: list[int], k: int, low: int, high: int, matches: int) -> list[list[int]]:
    """The continuations of the longest matching n-gram's latest ``matches`` earlier occurrences, latest first."""
    for n in range(min(high, len(tokens)), low - 1, -1):
        suffix = tokens[len(tokens) - n:]
        found = [tokens[start + n:start + n + k] for start in range(len(tokens) - n - 1, -1, -1)
                 if tokens[start:start + n] == suffix]
        if found:
            return found[:matches]
    return []


def test_merge_branches_is_the_trie_within_its_budget():
    # room for all: the trie, the latest branch first
    assert merge_branches([[5, 6, 7], [5, 6, 8], [9], [5, 1]], budget=10) == (
        [5, 6, 7, 9, 8, 1], [-1, 0, 1, -1, 1, 0])
    # the first branch keeps a node for each other first token (9), then the others fill what is left
    assert merge_branches([[5, 6, 7], [5, 6, 8], [9]], budget=4) == ([5, 6, 7, 9], [-1, 0, 1, -1])
    assert merge_branches([[1, 2, 3, 4, 5], [6, 7], [8, 9]], budget=5) == ([1, 2, 3, 6, 8], [-1, 0, 1, -1, -1])
    assert merge_branches([[1, 2], [1, 2]], budget=5) == ([1, 2], [-1, 0])  # the same continuation twice: a chain
    assert merge_branches([], budget=3) == ([], [])


@pytest.mark.parametrize("undo", [4, 256])
def test_tree_proposals_hold_every_latest_continuation_and_survive_cuts(monkeypatch, undo):
    """With trees, the proposal is the trie of the latest occurrences' continuations (a brute-force search says
    which), its first branch the chain's proposal; kept in place through appends and cuts (deeper than the undo
    log too), it equals a tree index built anew."""
    from specdec.history import TokenHistory

    monkeypatch.setattr(NgramIndex, "UNDO_POSITIONS", undo)
    rng = random.Random(undo)
    for trial in range(40):
        low, high = 1, rng.randint(1, 3)
        index, history = NgramIndex(low, high, tree=True), TokenHistory()
        for _ in range(30):
            if history and rng.random() < 0.3:
                history.truncate(rng.randrange(len(history) + 1))
            history.extend(rng.randrange(rng.choice([2, 4, 9])) for _ in range(rng.randrange(6)))
            index.sync(history)
            k = rng.choice([1, 4, 12])
            proposal = index.proposal(k)
            branches = brute_force_branches(list(history), k, low, high, NgramIndex.TREE_MATCHES)
            assert (proposal.draft_token_ids, proposal.parents or [i - 1 for i in range(len(proposal.draft_token_ids))]) == \
                merge_branches(branches, k)
            parents = proposal.parents or [i - 1 for i in range(len(proposal.draft_token_ids))]
            check_parents(parents, len(proposal.draft_token_ids))
            chain = index.propose(k)
            m = 0  # the first branch: nodes 0, 1, ... each the child of the one before, as long as the chain
            while m < min(len(chain), len(parents)) and parents[m] == m - 1:
                m += 1
            assert proposal.draft_token_ids[:m] == chain[:m] and (m or not chain)  # the chain, or its start
            fresh = NgramIndex(low, high, tree=True)
            fresh.extend(list(history))
            assert index._prev == fresh._prev


def test_lookup_config_is_checked():
    assert SpeculativeConfig.from_any({"method": "ngram"}).lookup_range() == (2, 4)
    assert SpeculativeConfig.from_any({"method": "ngram", "prompt_lookup_max": 1}).lookup_range() == (1, 1)
    for bad in ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2},
                {"method": "ngram", "prompt_lookup_max": 0}, {"model": "d", "prompt_lookup_min": 2},
                {"method": "draft_model"}):
        with pytest.raises(ConfigError):
            SpeculativeConfig.from_any(bad)


REPEATING = "The cat sat on the mat. The cat sat on the mat. The cat sat on the"


@pytest.mark.heavy
@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4},
    {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 1},
    {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 3, "prompt_lookup_max": 5},
])
def test_ngram_greedy_equals_target_alone(target_dir, spec):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [REPEATING, "def f(x):\n    return x\n\ndef g(x):\n    return", "Hello"]
    alone = LLM(str(target_dir), dtype="float32").generate(prompts, params)
    llm = LLM(str(target_dir), speculative_config=spec, dtype="float32")
    outs = llm.generate(prompts, params)
    for ref, out in zip(alone, outs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    stats = outs[0].spec_decode_stats
    for out in outs[1:]:
        stats.merge(out.spec_decode_stats)
    # a random tiny model repeats itself: lookups match and get accepted
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, stats.as_dict()


def test_hybrid_greedy_equals_target_alone_and_uses_both(target_dir, good_draft_dir):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [REPEATING, "Hello"]
    alone = LLM(str(target_dir), dtype="float32").generate(prompts, params)
    spec = {"model": str(good_draft_dir), "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = LLM(str(target_dir), speculative_config=spec, dtype="float32")
    calls = Counter()
    model_propose = llm._draft_worker.model.propose_batch
    llm._draft_worker.model.propose_batch = lambda batch: (calls.update(model=len(batch)), model_propose(batch))[1]
    outs = llm.generate(prompts, params)
    for ref, out in zip(alone, outs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    rounds = sum(o.spec_decode_stats.num_target_passes for o in outs)
    assert 0 < calls["model"] < rounds, "hybrid drafting used only one of its two drafters"


@pytest.mark.heavy
@pytest.mark.parametrize("seeded_sampling", ["coupled", "rejection"])
def test_ngram_sampling_follows_the_target_and_a_broken_rule_is_caught(target_dir, chi2_pvalue, monkeypatch,
                                                                        seeded_sampling):
    """First emitted token after a prompt whose lookup always matches: with n-gram proposals (no q)
    it follows p under both rules of seeded requests; accepting every proposal instead (the negative
    control, a broken rejection rule) does not."""
    params = SamplingParams(temperature=1.0, top_k=8, max_tokens=2)  # 2: the first round may draft 1
    prompt, p, support = target_first_token(target_dir, REPEATING, params)
    llm = LLM(str(target_dir), speculative_config={"method": "ngram", "num_speculative_tokens": 2}, dtype="float32",
              seeded_sampling=seeded_sampling)
    assert NgramWorker(NgramStore(NgramIndexes(2, 4))).propose("x", prompt, 2, params).draft_token_ids  # the lookup matches
    assert first_token_pvalue(llm, prompt, params, p, support, chi2_pvalue) > 1e-3
    if seeded_sampling == "coupled":  # no q, no uniforms: accept_batch sees greedy rows of p / E
        return
    monkeypatch.setattr(specdec.engine.workers, "accept_batch", rowwise(accept_always))
    assert first_token_pvalue(llm, prompt, params, p, support, chi2_pvalue) < 1e-3


class _FixedIndex:
    """A lookup index that proposes one fixed tree (with node estimates) whatever the history."""

    def __init__(self, proposal):
        self.tokens, self._proposal = [], proposal

    def sync(self, token_ids):
        self.tokens = list(token_ids)

    def proposal(self, k):
        return self._proposal.truncated(k)


class _FakeModel:
    """A hybrid's model worker: answers each call with the next of ``answers``; records the calls."""

    def __init__(self, answers, method="greedy"):
        import threading
        from types import SimpleNamespace

        from specdec.config import TreeShape

        state = SimpleNamespace(lookup_index=None, held_target_ids=None)
        self.runner = SimpleNamespace(lock=threading.RLock(),
                                      get_or_create=lambda *a: SimpleNamespace(state=state))
        self.tli, self.tree, self.draft_sample_method = None, TreeShape(), method
        self.answers, self.calls = list(answers), []

    def propose_batch(self, calls):
        self.calls += calls
        return [self.answers.pop(0) for _ in calls]


def _hybrid(model, lookup):
    from specdec.ngram import HybridDraftWorker

    return HybridDraftWorker(model, lambda: _FixedIndex(lookup), model_k=3, merge_below=5.0)


def _call(params=None, method=None):
    from specdec.calls import ProposeCall

    return ProposeCall("s", [1, 2, 3], 8, params or SamplingParams(temperature=0), draft_sample_method=method)


WEAK = Proposal([7, 8], parents=None, node_probs=[0.6, 0.3])  # a suffix chain expecting 0.9 tokens


def test_a_weak_lookup_merges_with_the_models_tree():
    model = _FakeModel([Proposal([7, 9], parents=[-1, -1], node_probs=[0.5, 0.4], features_from=3)])
    (out,) = _hybrid(model, WEAK).propose_batch([_call()])
    assert out.draft_token_ids == [7, 9, 8] and out.parents == [-1, -1, 0] and out.features_from == 3
    hybrid = _hybrid(_FakeModel([]), Proposal([7, 8, 9, 10, 11, 12], node_probs=[1.0] * 6))  # expects 6: alone
    assert hybrid.propose_batch([_call()])[0].draft_token_ids == [7, 8, 9, 10, 11, 12] and not hybrid.model.calls
    assert hybrid.rounds == {"lookup": 1, "model": 0, "merged": 0}


def test_a_merged_round_passes_unfinished_on_and_keeps_the_lookup_when_the_model_fails():
    from specdec.calls import UNFINISHED
    from specdec.errors import InvalidRequestError

    assert _hybrid(_FakeModel([UNFINISHED]), WEAK).propose_batch([_call()]) == [UNFINISHED]  # the call comes again
    hybrid = _hybrid(_FakeModel([InvalidRequestError("too long")]), WEAK)
    (out,) = hybrid.propose_batch([_call()])
    assert out.draft_token_ids == [7, 8] and out.features_from is None  # as a round the model sat out
    assert hybrid.rounds == {"lookup": 1, "model": 0, "merged": 0}
    (out,) = _hybrid(_FakeModel([Proposal([4, 5], features_from=2)]), WEAK).propose_batch([_call()])
    assert out.draft_token_ids == [7, 8] and out.features_from == 2  # a chain without estimates: nothing to merge


def test_sampled_requests_drafted_probabilistically_are_not_merged():
    sampled = SamplingParams(temperature=0.8, seed=1)
    model = _FakeModel([], method="probabilistic")
    assert _hybrid(model, WEAK).propose_batch([_call(sampled)])[0].draft_token_ids == [7, 8] and not model.calls
    model = _FakeModel([Proposal([9], parents=[-1], node_probs=[0.5])])  # greedy drafting: trees, merged
    assert _hybrid(model, WEAK).propose_batch([_call(sampled, method="greedy")])[0].draft_token_ids == [7, 9, 8]
