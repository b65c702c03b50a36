"""The speculative loop itself (specdec.decoding), with scripted workers: what it sends and what it keeps."""

from __future__ import annotations

import torch

from specdec.decoding import decode, speculative_round
from specdec.proposal import Proposal, VerifyResult
from specdec.sampling import SamplingParams
from specdec.sequence import SequenceState


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
