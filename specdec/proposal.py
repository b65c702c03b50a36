"""The small wire-neutral types every side shares: what a draft proposes, what a target decides,
and the one check of k. No torch import here (q, when present, is a tensor someone else made), no
grpc: the offline workers, the services and the gateway all speak these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specdec.errors import InvalidRequestError, SpecDecError
from specdec.trees import first_branch, is_chain

if TYPE_CHECKING:
    import torch

# The most draft tokens a round may propose (services report it in GetInfo).
MAX_NUM_SPECULATIVE_TOKENS = 32  # (suffix decoding drafts up to 32, as vLLM's)


@dataclass
class Proposal:
    draft_token_ids: list[int]
    draft_probs: "torch.Tensor | None" = None  # [k, vocab] q; None: one-hot (greedy drafting)
    # [k + 1, words] int32: the tokens a grammar allows at each verified position (specdec.token_mask);
    # None: unconstrained. Set by the sequence's constraint after drafting (specdec.structured).
    token_bitmask: "torch.Tensor | None" = None
    # an EAGLE draft's: the first position it holds no target feature for (specdec.features); None otherwise
    features_from: int | None = None
    # a token tree's (specdec.trees): each draft's parent node (-1: the history's last token); None: a chain.
    # A tree's drafts are deterministic candidates: no q rows, no bitmask.
    parents: list[int] | None = None
    # the drafter's estimate, per node, that the target takes the node's whole path (a suffix tree's frequencies, a
    # model's cumulative probabilities): how a hybrid ranks the nodes of two drafters' trees (``trees.merge``).
    # The drafting side's alone: never sent.
    node_probs: list[float] | None = None

    @property
    def is_tree(self) -> bool:
        return self.parents is not None and not is_chain(self.parents)

    def truncated(self, n: int) -> "Proposal":
        """The first ``n`` draft tokens (and their q rows; a tree's first n nodes are a tree)."""
        if len(self.draft_token_ids) <= n:
            return self
        return Proposal(self.draft_token_ids[:n], None if self.draft_probs is None else self.draft_probs[:n],
                        None if self.token_bitmask is None else self.token_bitmask[:n + 1], self.features_from,
                        None if self.parents is None else self.parents[:n],
                        None if self.node_probs is None else self.node_probs[:n])

    def after(self, n: int) -> "Proposal":
        """The draft tokens after the first ``n`` (and their q rows) of a chain."""
        assert not self.is_tree, "after() cuts a chain"
        return Proposal(self.draft_token_ids[n:], None if self.draft_probs is None else self.draft_probs[n:],
                        None if self.token_bitmask is None else self.token_bitmask[n:])

    def first_branch(self) -> tuple["Proposal", list[int] | None]:
        """A tree's first branch as a chain, and the nodes it kept (None: the proposal was a chain already)."""
        if not self.is_tree:
            return self, None
        nodes = first_branch(self.parents)
        return Proposal([self.draft_token_ids[i] for i in nodes], features_from=self.features_from), nodes


@dataclass
class TokenLogprob:
    """The target's log-probability of one token at one position, and the position's top tokens.

    Raw log-probabilities (log_softmax of the model's logits, before temperature, top-k/top-p or
    penalties), as vLLM's default ``logprobs_mode="raw_logprobs"`` returns them."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the position's most likely (token id, logprob), most likely first


@dataclass
class VerifyResult:
    num_accepted_tokens: int
    next_token_id: int  # bonus token when all drafts were accepted, else the recovered token
    # one per emitted token (accepted drafts, then the next token) when the call asked for logprobs
    logprobs: list[TokenLogprob] | None = None
    # one per prompt token after the first (the first has none) when the call asked for prompt logprobs
    prompt_logprobs: list[TokenLogprob] | None = None
    # the target's features when the call asked (VerifyCall.feature_layers): specdec.features.FeatureChunk
    features: Any = None
    # a token tree's: the accepted nodes, root's child first (num_accepted_tokens of them); None: a chain's
    accepted_path: list[int] | None = None

    def emitted(self, draft_token_ids: list[int]) -> list[int]:
        if self.accepted_path is not None:
            return [draft_token_ids[i] for i in self.accepted_path] + [self.next_token_id]
        return draft_token_ids[: self.num_accepted_tokens] + [self.next_token_id]


def check_num_speculative_tokens(k: object, error: type[SpecDecError] = InvalidRequestError,
                                 minimum: int = 1) -> None:
    """k must be an integer in [minimum, MAX_NUM_SPECULATIVE_TOKENS]. ``error``: InvalidRequestError
    for a request's k, ConfigError for a configuration's."""
    if not isinstance(k, int) or isinstance(k, bool) or not minimum <= k <= MAX_NUM_SPECULATIVE_TOKENS:
        param = "num_speculative_tokens" if error is InvalidRequestError else None
        raise error(f"num_speculative_tokens={k!r} is not allowed: it must be an integer in "
                    f"[{minimum}, {MAX_NUM_SPECULATIVE_TOKENS}]", param=param)


