"""The speculative decoding loop, written once for every deployment.

``draft`` and ``target`` are anything with the worker interface (``propose`` / ``verify`` /
``release``): the in-process ``DraftWorker`` / ``TargetWorker`` for the offline ``LLM``, or the gRPC
clients the gateway uses. ``draft=None`` decodes with the target alone — the same verifier with no
drafts, so both paths process logits identically.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from specdec.history import TokenHistory, common_prefix, mark_of, unchanged_prefix
from specdec.proposal import Proposal, VerifyResult
from specdec.sampling_params import SamplingParams
from specdec.sequence import SequenceState


class Proposer(Protocol):
    def propose(self, sequence_id: str, token_ids: list[int], num_speculative_tokens: int, params: SamplingParams) -> Proposal: ...
    def release(self, sequence_id: str) -> None: ...


class Verifier(Protocol):
    def verify(self, sequence_id: str, token_ids: list[int], proposal: Proposal, params: SamplingParams) -> VerifyResult: ...
    def release(self, sequence_id: str) -> None: ...


def speculative_round(draft: Proposer | None, target: Verifier, seq: SequenceState, k: int,
                      ahead: "Lookahead | None" = None) -> list[int]:
    """One round: the draft proposes k tokens, the target verifies them in one pass.

    Returns the accepted drafts followed by the bonus or recovered token (1 to k + 1 tokens). With
    ``ahead`` (overlap), the proposal may already be drafted, and the draft drafts the next round's
    while the target verifies this one.
    """
    k = min(k, seq.budget - 1) if draft is not None else 0  # never draft past max_tokens / max_model_len
    proposal = ahead.take(seq, k) if ahead is not None else None  # drafted during the last verification
    if proposal is None:
        proposal = draft.propose(seq.sequence_id, ahead.history(seq) if ahead is not None else seq.token_ids, k,
                                 seq.params) if k > 0 else Proposal([])
    proposal = proposal.truncated(seq.budget - 1)  # a TLI draft's text can make more target tokens than k
    proposal = seq.constrain(proposal, k)  # under a grammar: valid drafts, forced text, allowed tokens per row
    if ahead is not None:
        ahead.start(draft, seq, proposal, k)
    result = target.verify(seq.sequence_id, seq.token_ids, proposal, seq.verify_params)
    seq.stats.record(len(proposal.draft_token_ids), result.num_accepted_tokens, proposal.is_tree)
    seq.note_verify(result)  # logprobs travel with the tokens
    return result.emitted(proposal.draft_token_ids)


class Lookahead:
    """Overlapped drafting (PEARL's post-verify, across services): while the target verifies a round,
    the draft drafts the next one, on the bet that the target accepts every draft of this round. The
    bet wins when it did and its bonus token is the first token drafted ahead: the rest are then the
    next round's proposal, ready at once. Otherwise they are dropped and the draft proposes from the
    accepted prefix as usual; its cache follows the new history (the runner keeps only the common
    prefix), so no speculative token or cache entry survives a lost bet. Lossless either way: every
    proposal is verified, and a proposal's q rows travel with its tokens.

    One per sequence. ``submit`` runs a call beside the caller and returns something with ``result()``
    (``concurrent.futures``); without it the caller runs the call (``call``) and hands the result to
    ``resolve`` (the group scheduler, which batches every sequence's lookahead into one phase).

    Every Propose of the sequence (the lookahead's and, after a lost bet, the round's own) reads one list
    kept in place, ``history``: the sequence's tokens, followed by the round's drafts while a bet runs.
    Each round changes it by the new tokens only, and the draft's client, given the same list again,
    compares only what changed (``specdec.history``).
    """

    def __init__(self, submit: Callable[..., Any] | None = None):
        self.submit = submit
        self.call: Callable[[], Proposal] | None = None  # the lookahead to run (group mode)
        # The history the draft is given: the sequence's tokens, then (during a bet) the round's drafts.
        self._base = TokenHistory()
        self._committed = 0  # _base[:_committed] are the sequence's tokens as of _mark
        self._source: Any = None  # the sequence's token list, and its mark when _base was last synced
        self._mark = None
        self._pending: Callable[[], Proposal | BaseException] | None = None

    def history(self, seq: SequenceState, drafts: Sequence[int] = ()) -> TokenHistory:
        """The draft's history of ``seq`` (then ``drafts``): the same list each time, changed in place by
        what changed since the last call (a bet's drafts cut off, the newly committed tokens added)."""
        tokens = seq.token_ids
        keep = min(unchanged_prefix(self._source, self._mark, tokens), self._committed)
        base = self._base
        base.truncate(keep)
        base += tokens[keep:]
        self._committed = len(tokens)
        self._source, self._mark = mark_of(tokens)
        base += drafts
        return base

    def start(self, draft: Proposer | None, seq: SequenceState, proposal: Proposal, k: int) -> None:
        """Begin drafting the round after ``proposal`` (k + 1 tokens: the bonus position and k drafts), if
        the sequence can outlive this round."""
        self.call = None
        if (draft is None or k <= 0 or not proposal.draft_token_ids or proposal.is_tree
                or seq.budget <= len(proposal.draft_token_ids) + 1):  # (a tree: no single path to bet on)
            return
        self.call = _call(draft.propose, seq.sequence_id, self.history(seq, proposal.draft_token_ids), k + 1,
                          seq.params)
        if self.submit is not None:
            future = self.submit(self.call)
            self.call = None
            self.resolve(lambda: _outcome(future))

    def resolve(self, outcome: Callable[[], Proposal | BaseException]) -> None:
        """The lookahead's result (or error), to be read when the next round begins."""
        self._pending = outcome

    def take(self, seq: SequenceState, k: int) -> Proposal | None:
        """The next round's proposal if the bet won (at most k tokens), else None. Waits for the lookahead:
        no other call for the sequence may reach the draft while it runs."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        drafted = pending()
        seq.stats.num_lookaheads += 1  # decided now: used or dropped
        n = len(self._base)
        # the bet won only if the sequence now starts with what was drafted after (the committed part is
        # known unchanged: only the drafts are compared)
        known = min(unchanged_prefix(self._source, self._mark, seq.token_ids), self._committed)
        if (isinstance(drafted, BaseException) or k <= 0 or len(seq.token_ids) < n or drafted.is_tree
                or common_prefix(self._base, seq.token_ids, known) < n):
            return None  # a draft error shows again (or is handled) in the round's own Propose
        landed = seq.token_ids[n:]  # the bonus token: one, when every draft was accepted
        if not landed or drafted.draft_token_ids[:len(landed)] != landed or len(drafted.draft_token_ids) <= len(landed):
            return None
        seq.stats.num_lookaheads_used += 1
        return drafted.after(len(landed)).truncated(k)

    def close(self) -> None:
        """Wait for a lookahead still running (the caches are released after it, never under it)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending()


def _outcome(future: Any) -> Proposal | BaseException:
    try:
        return future.result()
    except BaseException as exc:  # noqa: BLE001 - read as a lost bet; the round's own Propose reports it
        return exc


def commit(seq: SequenceState, token_ids: list[int]) -> str:
    """Append a round's tokens to the sequence; return the text that became final. Tokens after EOS,
    a stop string or the length limit inside an accepted block are dropped."""
    delta = ""
    for token_id in token_ids:
        delta += seq.append(token_id)
        if seq.finished:
            break
    return delta


# Runs phases of calls, all at the same time (each phase's calls together, as one batch): returns each
# phase's results, each call's result or the exception it raised, in order.
RunAll = Callable[..., list]


def group_round(draft: Proposer | None, target: Verifier, seqs: Sequence[SequenceState], ks: Sequence[int],
                run_all: RunAll, aheads: Sequence[Lookahead | None] | None = None) -> list[str | BaseException]:
    """One round for a group of sequences, phase by phase: every proposal at once, then every
    verification at once, so that the services batch each phase whole (``run_all`` issues a phase's
    calls together). The same steps as ``speculative_round`` per sequence; each sequence gets its
    round's new text, or the exception that ended it (the others carry on). With ``aheads`` (overlap),
    proposals drafted during the last verification are used, and the next round's lookaheads run as
    a phase of their own beside the verifications."""
    ks = [min(k, s.budget - 1) if draft is not None else 0 for s, k in zip(seqs, ks)]
    aheads = aheads or [None] * len(seqs)
    proposals: list = [a.take(s, k) if a is not None else None for a, s, k in zip(aheads, seqs, ks)]
    drafting = [i for i, k in enumerate(ks) if k > 0 and proposals[i] is None]
    (drafted,) = run_all([_call(draft.propose, seqs[i].sequence_id,
                                aheads[i].history(seqs[i]) if aheads[i] is not None else seqs[i].token_ids, ks[i],
                                seqs[i].params) for i in drafting])
    for i, p in zip(drafting, drafted):
        proposals[i] = p
    proposals = [p if isinstance(p, BaseException) else s.constrain(Proposal([]) if p is None
                                                                    else p.truncated(s.budget - 1), k)
                 for p, s, k in zip(proposals, seqs, ks)]
    live = [i for i, p in enumerate(proposals) if not isinstance(p, BaseException)]
    for i in live:
        if aheads[i] is not None:
            aheads[i].start(draft, seqs[i], proposals[i], ks[i])
    looking = [i for i in live if aheads[i] is not None and aheads[i].call is not None]
    verified, looked = run_all([_call(target.verify, seqs[i].sequence_id, seqs[i].token_ids, proposals[i],
                                      seqs[i].verify_params) for i in live], [aheads[i].call for i in looking])
    for i, drafted_ahead in zip(looking, looked):
        aheads[i].resolve(lambda d=drafted_ahead: d)
    results: list = list(proposals)
    for i, r in zip(live, verified):
        results[i] = r
    out: list[str | BaseException] = []
    for seq, proposal, result in zip(seqs, proposals, results):
        if isinstance(result, BaseException):
            out.append(result)
            continue
        seq.stats.record(len(proposal.draft_token_ids), result.num_accepted_tokens, proposal.is_tree)
        seq.note_verify(result)  # logprobs travel with the tokens
        out.append(commit(seq, result.emitted(proposal.draft_token_ids)))
    return out


def _call(fn: Callable, *args) -> Callable[[], object]:
    return lambda: fn(*args)


def k_of(k: int | Callable[[SequenceState], int], seq: SequenceState) -> int:
    """This round's k: a fixed k, or what a policy (e.g. ``specdec.adaptive.AdaptiveK``) picks for the sequence."""
    return k(seq) if callable(k) else k


def decode(draft: Proposer | None, target: Verifier, seq: SequenceState,
           k: int | Callable[[SequenceState], int], ahead: Lookahead | None = None) -> Iterator[str]:
    """Run rounds until the sequence finishes, yielding each round's new text. ``k``: drafts per round,
    or a policy that picks them before each round. ``ahead``: overlapped drafting (see ``Lookahead``).

    Tokens after EOS, a stop string or the length limit inside an accepted block are dropped.
    Both workers' caches are released at the end, on error and on abandonment (generator close).
    """
    try:
        while not seq.finished:
            yield commit(seq, speculative_round(draft, target, seq, k_of(k, seq), ahead))
    finally:
        if ahead is not None:
            ahead.close()
        seq.abort()
        target.release(seq.sequence_id)
        if draft is not None:
            draft.release(seq.sequence_id)
