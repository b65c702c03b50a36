"""The speculative loop itself (specdec.decoding), with scripted workers: what it sends and what it keeps."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specdec import LLM
from specdec.decoding import Lookahead, decode, group_round, speculative_round
from specdec.proposal import Proposal, VerifyResult
from specdec.sampling import SamplingParams
from specdec.sequence import SequenceState
from tests.gateway.test_served_distribution import word_pair  # noqa: F401 - fixture


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


class LongDraft:
    """Proposes more tokens than asked, as a TLI draft's text can (k draft tokens -> up to 2k target ids)."""

    def __init__(self, n: int):
        self.n, self.asked = n, []

    def propose(self, sequence_id, token_ids, k, params):
        self.asked.append(k)
        return Proposal(list(range(1, self.n + 1)), torch.full((self.n, 8), 1 / 8))

    def release(self, sequence_id):
        pass


class AcceptAll:
    def __init__(self):
        self.verified = []

    def verify(self, sequence_id, token_ids, proposal, params):
        self.verified.append(list(proposal.draft_token_ids))
        assert proposal.draft_probs is None or proposal.draft_probs.shape[0] == len(proposal.draft_token_ids)
        return VerifyResult(len(proposal.draft_token_ids), 7)

    def release(self, sequence_id):
        pass


def _seq(max_tokens: int, max_model_len: int = 100) -> SequenceState:
    return SequenceState([0, 0], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), _Tok(),
                         frozenset(), max_model_len)


def test_a_proposal_longer_than_the_budget_is_cut_before_verification():
    draft, target = LongDraft(6), AcceptAll()
    seq = _seq(max_tokens=4)
    emitted = speculative_round(draft, target, seq, k=3)
    assert draft.asked == [3]
    assert target.verified == [[1, 2, 3]]  # budget 4: at most 3 drafts + the bonus token
    assert emitted == [1, 2, 3, 7]
    assert seq.stats.num_draft_tokens == 3


def test_max_model_len_bounds_the_verified_tokens_too():
    draft, target = LongDraft(6), AcceptAll()
    seq = _seq(max_tokens=50, max_model_len=5)  # 2 prompt tokens: room for 3 more
    list(decode(draft, target, seq, k=4))
    assert target.verified[0] == [1, 2]
    assert len(seq.output_token_ids) == 3 and seq.finish_reason == "length"


def test_longer_proposals_within_the_budget_are_verified_whole():
    draft, target = LongDraft(5), AcceptAll()
    seq = _seq(max_tokens=20)
    assert speculative_round(draft, target, seq, k=3) == [1, 2, 3, 4, 5, 7]
    assert target.verified == [[1, 2, 3, 4, 5]]


# --------------------------------------------------------------------------------------------------
# overlapped drafting (Lookahead): the draft drafts the next round while the target verifies


class CountingDraft:
    """Drafts "last token + 1, + 2, ..." (a draft that always continues by counting), with q rows that say
    which token each row drafted; records every call as (history, k)."""

    def __init__(self):
        self.calls: list[tuple[list[int], int]] = []

    def propose(self, sequence_id, token_ids, k, params):
        self.calls.append((list(token_ids), k))
        drafts = [token_ids[-1] + i for i in range(1, k + 1)]
        return Proposal(drafts, torch.nn.functional.one_hot(torch.tensor(drafts), 64).float())

    def release(self, sequence_id):
        pass


class CountingTarget:
    """Continues by counting too, except where ``breaks`` says: at those positions it emits token 0 (a
    rejection of whatever was drafted there)."""

    def __init__(self, breaks=()):
        self.breaks, self.verified = set(breaks), []

    def verify(self, sequence_id, token_ids, proposal, params):
        self.verified.append((list(token_ids), list(proposal.draft_token_ids)))
        assert proposal.draft_probs is None or torch.equal(proposal.draft_probs.argmax(-1),
                                                           torch.tensor(proposal.draft_token_ids)), "q rows misaligned"
        history = list(token_ids)
        for n, d in enumerate(proposal.draft_token_ids):
            want = 0 if len(history) in self.breaks else history[-1] + 1
            if d != want:
                return VerifyResult(n, want)
            history.append(d)
        return VerifyResult(len(proposal.draft_token_ids), 0 if len(history) in self.breaks else history[-1] + 1)

    def release(self, sequence_id):
        pass


def _counting_seq(max_tokens: int) -> SequenceState:
    return SequenceState([1, 2], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), _Tok(),
                         frozenset(), 100)


def _run(draft, target, max_tokens: int, overlap: bool, k: int = 2) -> SequenceState:
    seq = _counting_seq(max_tokens)
    with ThreadPoolExecutor(1) as pool:
        list(decode(draft, target, seq, k, Lookahead(pool.submit) if overlap else None))
    return seq


def test_a_won_bet_is_the_next_proposal_and_saves_the_propose_call():
    draft, target = CountingDraft(), CountingTarget()
    seq = _run(draft, target, max_tokens=9, overlap=True)
    assert seq.output_token_ids == list(range(3, 12))
    # round 1 proposes [3, 4] at [1, 2]; its lookahead drafts k + 1 = 3 after [1, 2, 3, 4]: [5, 6, 7]. The
    # target accepts [3, 4] with bonus 5 = the first token drafted ahead, so round 2 verifies [6, 7] at once.
    assert draft.calls[:2] == [([1, 2], 2), ([1, 2, 3, 4], 3)]
    assert target.verified[:2] == [([1, 2], [3, 4]), ([1, 2, 3, 4, 5], [6, 7])]
    assert [k for _, k in draft.calls] == [2, 3, 3]  # one Propose on the critical path; the rest ran ahead
    assert (seq.stats.num_lookaheads, seq.stats.num_lookaheads_used) == (2, 2)
    assert seq.stats.num_accepted_tokens == seq.stats.num_draft_tokens == 6


def test_a_lost_bet_is_dropped_and_the_draft_proposes_from_the_accepted_prefix():
    draft, target = CountingDraft(), CountingTarget(breaks={3})  # rejects the second draft of round 1
    seq = _run(draft, target, max_tokens=8, overlap=True)
    plain_draft, plain_target = CountingDraft(), CountingTarget(breaks={3})
    plain = _run(plain_draft, plain_target, max_tokens=8, overlap=False)
    assert seq.output_token_ids == plain.output_token_ids == [3, 0, 1, 2, 3, 4, 5, 6]
    assert draft.calls[1] == ([1, 2, 3, 4], 3)  # the bet on [3, 4] ...
    assert draft.calls[2] == ([1, 2, 3, 0], 2)  # ... lost: the next proposal comes from the accepted prefix
    assert target.verified[1] == ([1, 2, 3, 0], [1, 2])  # nothing drafted ahead reached the target
    assert [v for v in target.verified if v[0] == [1, 2, 3, 0]] == [v for v in plain_target.verified
                                                                    if v[0] == [1, 2, 3, 0]]
    assert seq.stats.num_lookaheads_used < seq.stats.num_lookaheads


def test_a_bet_whose_bonus_token_differs_is_dropped():
    # all drafts accepted, but the target's bonus token (0 at position 4) is not the first drafted ahead (5)
    draft, target = CountingDraft(), CountingTarget(breaks={4})
    seq = _run(draft, target, max_tokens=6, overlap=True)
    assert seq.output_token_ids == [3, 4, 0, 1, 2, 3]
    assert draft.calls[2] == ([1, 2, 3, 4, 0], 2)
    assert seq.stats.num_lookaheads_used == 0 < seq.stats.num_lookaheads


def test_no_lookahead_past_the_budget_and_none_left_running():
    draft, target = CountingDraft(), CountingTarget()
    seq = _run(draft, target, max_tokens=3, overlap=True)  # one round of 2 drafts + bonus ends it
    assert seq.output_token_ids == [3, 4, 5]
    assert draft.calls == [([1, 2], 2)]  # the round could not be outlived: no lookahead was started


def test_lookahead_and_group_rounds_agree(monkeypatch):
    """group_round with lookaheads (the scheduler's path): the same rounds as the loop, and the lookaheads
    run as their own phase beside the verifications."""
    phases_seen = []

    def run_all(*phases):
        phases_seen.append([len(p) for p in phases])
        return [[call() for call in p] for p in phases]

    draft, target = CountingDraft(), CountingTarget(breaks={7})
    seqs = [_counting_seq(10), _counting_seq(10)]
    aheads = [Lookahead(), Lookahead()]
    while not all(s.finished for s in seqs):
        live = [i for i, s in enumerate(seqs) if not s.finished]
        group_round(draft, target, [seqs[i] for i in live], [2] * len(live), run_all, [aheads[i] for i in live])
    alone = _run(CountingDraft(), CountingTarget(breaks={7}), max_tokens=10, overlap=False)
    assert all(s.output_token_ids == alone.output_token_ids for s in seqs)
    # (Propose phase), (Verify phase, lookahead phase) per round: round 2 drafted nothing (both bets won),
    # round 3 proposed again (the bonus token at position 7 lost both bets), the last round had no lookahead
    assert phases_seen == [[2], [2, 2], [0], [2, 2], [2], [2, 2], [0], [2, 0]]
    assert (seqs[0].stats.num_lookaheads, seqs[0].stats.num_lookaheads_used) == (3, 1)


class _WholeListLookahead(Lookahead):
    """The lookahead as it was before its history was kept in place: a new list per bet, compared whole."""

    def history(self, seq, drafts=()):
        return seq.token_ids + list(drafts) if drafts else seq.token_ids

    def take(self, seq, k):
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        drafted = pending()
        seq.stats.num_lookaheads += 1
        n = len(self._whole)
        if isinstance(drafted, BaseException) or k <= 0 or list(seq.token_ids[:n]) != self._whole:
            return None
        landed = seq.token_ids[n:]
        if not landed or drafted.draft_token_ids[:len(landed)] != landed or len(drafted.draft_token_ids) <= len(landed):
            return None
        seq.stats.num_lookaheads_used += 1
        return drafted.after(len(landed)).truncated(k)

    def start(self, draft, seq, proposal, k):
        self._whole = list(seq.token_ids) + list(proposal.draft_token_ids)
        super().start(draft, seq, proposal, k)


class _ListRecordingDraft(CountingDraft):
    def __init__(self):
        super().__init__()
        self.lists = set()

    def propose(self, sequence_id, token_ids, k, params):
        self.lists.add(id(token_ids))
        return super().propose(sequence_id, token_ids, k, params)


@pytest.mark.parametrize("seed", range(6))
def test_the_lookahead_keeps_one_history_in_place_and_decides_as_the_whole_list_rule(seed):
    """With overlap the draft is given one list per sequence, changed in place round after round; every
    call carries the same ids, and every bet is won or lost, as with a new list per call compared whole."""
    rng = random.Random(seed)
    k = rng.randint(1, 4)
    breaks = set(rng.sample(range(3, 60), 12))

    def run(ahead_class):
        draft, target = _ListRecordingDraft(), CountingTarget(breaks)
        seq = _counting_seq(40)
        with ThreadPoolExecutor(1) as pool:
            list(decode(draft, target, seq, k, ahead_class(pool.submit)))
        return draft, target, seq

    draft, target, seq = run(Lookahead)
    old_draft, old_target, old_seq = run(_WholeListLookahead)
    assert draft.calls == old_draft.calls and target.verified == old_target.verified
    assert seq.output_token_ids == old_seq.output_token_ids
    assert seq.stats.as_dict() == old_seq.stats.as_dict() and seq.stats.num_lookaheads_used > 0
    assert len(draft.lists) == 1  # (the other one got the sequence's list, or a new list per bet)


# -- overlap through the in-process workers (tiny random-weight pair of tests/conftest.py) ---------


def _tracked_proposals(llm):
    """Wrap the LLM's draft worker: record each Propose call's (history, k, the draft's cached tokens after it)."""
    worker, calls = llm._draft_worker, []
    propose = worker.propose

    def tracked(sequence_id, token_ids, k, params):
        out = propose(sequence_id, token_ids, k, params)
        calls.append((tuple(token_ids), k, tuple(worker.runner.sequences[sequence_id].tokens)))
        return out

    worker.propose = tracked
    return calls


@pytest.mark.usefixtures("cached_model_loading")
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_overlap_is_greedy_identical_and_leaves_no_stale_cache(target_dir, good_draft_dir, target_greedy_ref, spec, k):
    prompt = "The quick brown fox"
    ids, want = target_greedy_ref[prompt]
    params = SamplingParams(temperature=0, max_tokens=len(want), ignore_eos=True)
    runs = {}
    for overlap in (False, True):
        llm = LLM(str(target_dir), speculative_config=spec(good_draft_dir, k, overlap=overlap), dtype="float32")
        calls = _tracked_proposals(llm)
        seq = llm.new_sequence(list(ids), params)
        list(llm.stream(seq))
        assert seq.output_token_ids == want, f"overlap={overlap}"
        assert not llm._draft_worker.runner.sequences, "the draft's cache must be released at the end"
        runs[overlap] = (seq.stats, calls)
    stats, calls = runs[True]
    assert 0 < stats.num_lookaheads_used < stats.num_lookaheads, stats.as_dict()  # bets won and lost
    plain = {history: cached for history, _, cached in runs[False][1]}
    regular = [(history, cached) for history, asked, cached in calls if asked <= k]  # lookaheads ask k + 1
    assert len(regular) < len(runs[False][1])  # won bets saved Propose calls
    for history, cached in regular:
        # after a lost bet the draft proposes from the accepted prefix with exactly the cache a sequential
        # run has at that history: the dropped lookahead left no token or cache entry behind
        assert cached == plain[history], len(history)
        assert cached[:len(history)] == history


# -- overlap with sampling: the word pair of tests/gateway/test_served_distribution.py ---------------

N_OVERLAP_SAMPLES = 1500


@pytest.fixture(scope="module")
def word_triples(word_pair):  # noqa: F811
    """(an LLM drafting probabilistically with overlap, k=1; the target's P(y, z) of output tokens 2 and 3;
    the target's p(. | prompt, x, y) as [VOCAB] rows by (x, y)). The target drafts for itself: every draft
    is accepted, and a bet wins whenever its first token drawn ahead equals the bonus token the target drew
    (often: the word pair's continuations are peaky)."""
    from transformers import LlamaForCausalLM

    from tests.gateway.test_served_distribution import PARAMS, PROMPT_IDS, VOCAB, _next_token_probs

    llm = LLM(str(word_pair.target_dir), speculative_config={
        "method": "draft_model", "model": str(word_pair.target_dir), "num_speculative_tokens": 1,
        "draft_sample_method": "probabilistic", "overlap": True}, dtype="float32")
    ref = LlamaForCausalLM.from_pretrained(word_pair.target_dir).eval()
    pairs = (word_pair.joint > 1e-7).nonzero().tolist()  # (x, y) with mass: the rest is below the test's reach
    p2 = dict(zip(map(tuple, pairs), _next_token_probs(ref, [PROMPT_IDS + [x, y] for x, y in pairs], PARAMS)))
    yz = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for (x, y), row in p2.items():
        yz[y] += word_pair.joint[x, y] * row
    return llm, yz / yz.sum(), p2


def _sample(llm, n: int, seed: int):
    """(counts of (y, z); the (x, y, z) of the samples whose token 3 was verified from a won bet)."""
    from tests.gateway.test_served_distribution import PARAMS, PROMPT_IDS, VOCAB

    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    won = []
    for i in range(n):
        # 4 tokens: round 2 (after x, y) still drafts one token, the lookahead's when the bet won
        seq = llm.new_sequence(list(PROMPT_IDS), PARAMS.clone(max_tokens=4, ignore_eos=True, seed=seed + i))
        list(llm.stream(seq))
        x, y, z, _ = seq.output_token_ids
        counts[y, z] += 1
        if seq.stats.num_lookaheads_used:
            won.append((x, y, z))
    return counts, won


def _won_pvalue(chi2_pvalue, won, p2) -> float:
    """Token 3 of the won bets against the target's p(. | prompt, x, y), summed over those samples."""
    observed = torch.zeros(next(iter(p2.values())).shape[0], dtype=torch.float64)
    expected = torch.zeros_like(observed)
    for x, y, z in won:
        observed[z] += 1
        expected += p2[(x, y)]
    return chi2_pvalue(observed, expected / len(won))


@pytest.mark.heavy
@pytest.mark.usefixtures("cached_model_loading")
def test_overlapped_sampling_follows_the_target(word_triples, chi2_pvalue):
    """Token 3 is a lookahead's whenever round 1's bonus y was the first token drawn ahead. (That its q row
    is the one it was drawn from is checked exactly by the scripted CountingTarget above: a chi-square
    negative control here, with q rows off by one, went undetected at 2,000 samples on this pair.)"""
    llm, yz, p2 = word_triples
    counts, won = _sample(llm, N_OVERLAP_SAMPLES, seed=7 * 10**6)
    assert len(won) > 0.1 * N_OVERLAP_SAMPLES, f"won bets must be exercised ({len(won)})"
    pv, pv_won = chi2_pvalue(counts, yz), _won_pvalue(chi2_pvalue, won, p2)
    print(f"\nchi-square p={pv:.3g} (y, z), p={pv_won:.3g} (token 3 of {len(won)} won bets)")
    assert pv >= 1e-3 and pv_won >= 1e-3, f"not the target's distribution with overlap: p={pv:.2e}, {pv_won:.2e}"
