"""The speculative decoding loop, written once for every deployment.

``draft`` and ``target`` are anything with the worker interface (``propose`` / ``verify`` /
``release``): the in-process ``DraftWorker`` / ``TargetWorker`` for the offline ``LLM``, or the gRPC
clients the gateway uses. ``draft=None`` decodes with the target alone — the same verifier with no
drafts, so both paths process logits identically.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
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
    result = target.verify(seq.sequence_id, seq.token_ids, proposal, seq.verify_params)
    seq.stats.record(len(proposal.draft_token_ids), result.num_accepted_tokens)
    seq.note_verify(result)  # logprobs travel with the tokens
    return result.emitted(proposal.draft_token_ids)


def commit(seq: SequenceState, token_ids: list[int]) -> str:
    """Append a round's tokens to the sequence; return the text that became final. Tokens after EOS,
    a stop string or the length limit inside an accepted block are dropped."""
    delta = ""
    for token_id in token_ids:
        delta += seq.append(token_id)
        if seq.finished:
            break
    return delta


# Runs a phase's calls at once; returns each call's result or the exception it raised, in order.
RunAll = Callable[[Sequence[Callable[[], object]]], list]


def group_round(draft: Proposer | None, target: Verifier, seqs: Sequence[SequenceState], ks: Sequence[int],
                run_all: RunAll) -> list[str | BaseException]:
    """One round for a group of sequences, phase by phase: every proposal at once, then every
    verification at once, so that the services batch each phase whole (``run_all`` issues a phase's
    calls together). The same steps as ``speculative_round`` per sequence; each sequence gets its
    round's new text, or the exception that ended it (the others carry on)."""
    ks = [min(k, s.budget - 1) if draft is not None else 0 for s, k in zip(seqs, ks)]
    proposals: list = [Proposal([])] * len(seqs)
    drafting = [i for i, k in enumerate(ks) if k > 0]
    for i, p in zip(drafting, run_all([_call(draft.propose, seqs[i].sequence_id, seqs[i].token_ids, ks[i],
                                             seqs[i].params) for i in drafting])):
        proposals[i] = p if isinstance(p, BaseException) else p.truncated(seqs[i].budget - 1)
    live = [i for i, p in enumerate(proposals) if not isinstance(p, BaseException)]
    results: list = list(proposals)
    for i, r in zip(live, run_all([_call(target.verify, seqs[i].sequence_id, seqs[i].token_ids, proposals[i],
                                         seqs[i].verify_params) for i in live])):
        results[i] = r
    out: list[str | BaseException] = []
    for seq, proposal, result in zip(seqs, proposals, results):
        if isinstance(result, BaseException):
            out.append(result)
            continue
        seq.stats.record(len(proposal.draft_token_ids), result.num_accepted_tokens)
        seq.note_verify(result)  # logprobs travel with the tokens
        out.append(commit(seq, result.emitted(proposal.draft_token_ids)))
    return out


def _call(fn: Callable, *args) -> Callable[[], object]:
    return lambda: fn(*args)


def k_of(k: int | Callable[[SequenceState], int], seq: SequenceState) -> int:
    """This round's k: a fixed k, or what a policy (e.g. ``specdec.adaptive.AdaptiveK``) picks for the sequence."""
    return k(seq) if callable(k) else k


def decode(draft: Proposer | None, target: Verifier, seq: SequenceState,
           k: int | Callable[[SequenceState], int]) -> Iterator[str]:
    """Run rounds until the sequence finishes, yielding each round's new text. ``k``: drafts per round,
    or a policy that picks them before each round.

    Tokens after EOS, a stop string or the length limit inside an accepted block are dropped.
    Both workers' caches are released at the end, on error and on abandonment (generator close).
    """
    try:
        while not seq.finished:
            yield commit(seq, speculative_round(draft, target, seq, k_of(k, seq)))
    finally:
        seq.abort()
        target.release(seq.sequence_id)
        if draft is not None:
            draft.release(seq.sequence_id)
