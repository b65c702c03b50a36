"""The speculative decoding loop, written once for every deployment.

``draft`` and ``target`` are anything with the worker interface (``propose`` / ``verify`` /
``release``): the in-process ``DraftWorker`` / ``TargetWorker`` for the offline ``LLM``, or the gRPC
clients the gateway uses. ``draft=None`` decodes with the target alone — the same verifier with no
drafts, so both paths process logits identically.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from specdec.proposal import Proposal, VerifyResult
from specdec.sampling import SamplingParams
from specdec.sequence import SequenceState


class Proposer(Protocol):
    def propose(self, sequence_id: str, token_ids: list[int], num_speculative_tokens: int, params: SamplingParams) -> Proposal: ...
    def release(self, sequence_id: str) -> None: ...


class Verifier(Protocol):
    def verify(self, sequence_id: str, token_ids: list[int], proposal: Proposal, params: SamplingParams) -> VerifyResult: ...
    def release(self, sequence_id: str) -> None: ...


def speculative_round(draft: Proposer | None, target: Verifier, seq: SequenceState, k: int) -> list[int]:
    """One round: the draft proposes k tokens, the target verifies them in one pass.

    Returns the accepted drafts followed by the bonus or recovered token (1 to k + 1 tokens).
    """
    k = min(k, seq.budget - 1) if draft is not None else 0  # never draft past max_tokens / max_model_len
    proposal = draft.propose(seq.sequence_id, seq.token_ids, k, seq.params) if k > 0 else Proposal([])
    proposal = proposal.truncated(seq.budget - 1)  # a TLI draft's text can make more target tokens than k
    result = target.verify(seq.sequence_id, seq.token_ids, proposal, seq.params)
    seq.stats.record(len(proposal.draft_token_ids), result.num_accepted_tokens)
    return result.emitted(proposal.draft_token_ids)


def decode(draft: Proposer | None, target: Verifier, seq: SequenceState, k: int) -> Iterator[str]:
    """Run rounds until the sequence finishes, yielding each round's new text.

    Tokens after EOS, a stop string or the length limit inside an accepted block are dropped.
    Both workers' caches are released at the end, on error and on abandonment (generator close).
    """
    try:
        while not seq.finished:
            delta = ""
            for token_id in speculative_round(draft, target, seq, k):
                delta += seq.append(token_id)
                if seq.finished:
                    break
            yield delta
    finally:
        seq.abort()
        target.release(seq.sequence_id)
        if draft is not None:
            draft.release(seq.sequence_id)
