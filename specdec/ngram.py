"""N-gram drafting (vLLM's ``method: "ngram"``, prompt lookup): propose the tokens that followed the most
recent earlier occurrence of the sequence's last n tokens, n from ``prompt_lookup_max`` down to
``prompt_lookup_min``, in prompt + output.

No model: a sequence's history is its own draft. Each sequence keeps an index per n (n-gram → the
position after its latest occurrence) that grows by one entry per n for each committed token and
takes a cut-back tail out again, so a round costs a few dictionary look-ups and updates, never a
rescan or rebuild of the history. Proposals carry no q (the target
accepts a draft token with probability p(x)), which keeps sampling lossless.

``HybridDraftWorker`` tries the n-gram lookup first and asks the draft model only for the sequences
without a match.

The store and both workers take any per-sequence index with ``sync(token_ids)``, ``propose(k)``,
``tokens`` and ``close()``, made by a factory (``NgramIndexes(min_n, max_n)`` here; suffix decoding's
``specdec.suffix.SuffixCache`` is another).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from specdec.calls import UNFINISHED, ProposeCall, until_finished
from specdec.config import DYNAMIC, check_lookup
from specdec.drafting_state import DraftingState
from specdec.errors import InvalidRequestError, ResourceExhaustedError, SequenceNotFoundError, SpecDecError
from specdec.history import common_prefix, mark_of, unchanged_prefix
from specdec.proposal import Proposal
from specdec.trees import is_chain, merge



class NgramIndex:
    """The n-gram index of one token sequence, for n in [min_n, max_n].

    ``sync`` follows the history a round brings: the appended tokens are indexed, and a cut-back tail
    (a lookahead's drafts lost) is taken out of the index by undoing its entries (the latest
    ``UNDO_POSITIONS`` positions can be undone; a deeper cut rebuilds). Given the same ``TokenHistory``
    again, only what changed since is compared. ``tokens`` stays one list, changed in place.
    """

    UNDO_POSITIONS = 256
    TREE_MATCHES = 8  # token trees: the continuations of this many latest occurrences, at most

    def __init__(self, min_n: int, max_n: int, tree: bool = False):
        self.min_n, self.max_n = min_n, max_n
        self.tree = tree
        self.tokens: list[int] = []
        # token trees: n -> for each position, where the n-gram before it occurred before (its entry in _after
        # before this position overwrote it), so every earlier occurrence is a walk away
        self._prev: dict[int, list[int | None]] = {n: [] for n in range(min_n, max_n + 1)} if tree else {}
        # n -> {n-gram: position of the token that followed its latest occurrence}
        self._after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        # what indexing each of the latest positions overwrote (per n: the earlier position, or None);
        # _undo[i] is position _undo_from + i
        self._undo: list[tuple[int | None, ...]] = []
        self._undo_from = 0
        self._source = None  # the TokenHistory last synced with, and its mark then
        self._mark = None

    def extend(self, new_tokens: list[int]) -> None:
        tokens, undo, after = self.tokens, self._undo, self._after
        for token in new_tokens:
            tokens.append(token)
            end = len(tokens) - 1  # the n-grams ending just before this token are now followed by it
            overwritten = []
            for n, table in after.items():
                earlier = None
                if end >= n:
                    key = tuple(tokens[end - n:end])
                    earlier = table.get(key)
                    overwritten.append(earlier)
                    table[key] = end
                if self.tree:
                    self._prev[n].append(earlier)
            undo.append(tuple(overwritten))
        if len(undo) > 2 * self.UNDO_POSITIONS:
            drop = len(undo) - self.UNDO_POSITIONS
            del undo[:drop]
            self._undo_from += drop

    def truncate(self, n: int) -> None:
        """Index only ``tokens[:n]``: the entries of the positions after are undone, latest first."""
        tokens = self.tokens
        if n >= len(tokens):
            return
        if n < self._undo_from:  # deeper than the undo log reaches: rebuild
            kept = tokens[:n]
            del tokens[:]
            for table in self._after.values():
                table.clear()
            for links in self._prev.values():
                links.clear()
            self._undo, self._undo_from = [], 0
            self.extend(kept)
            return
        for end in range(len(tokens) - 1, n - 1, -1):
            overwritten = iter(self._undo.pop())
            for size, table in self._after.items():
                if end >= size:
                    key = tuple(tokens[end - size:end])
                    previous = next(overwritten)
                    if previous is None:
                        del table[key]
                    else:
                        table[key] = previous
        del tokens[n:]
        for links in self._prev.values():
            del links[n:]

    def sync(self, token_ids: list[int]) -> None:
        """Index exactly ``token_ids``: undo what no longer matches what is indexed, index what follows."""
        known = min(unchanged_prefix(self._source, self._mark, token_ids), len(self.tokens))
        self.truncate(common_prefix(self.tokens, token_ids, known))
        self.extend(token_ids[len(self.tokens):])
        self._source, self._mark = mark_of(token_ids)

    def close(self) -> None:
        """(The sequence ended: nothing outlives it.)"""

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            pos = self._after[n].get(tuple(tokens[len(tokens) - n:]))
            if pos is not None:
                return tokens[pos:pos + k]
        return []

    def proposal(self, k: int) -> Proposal:
        """This round's proposal: the chain of ``propose``, or with ``tree`` a token tree of up to k nodes: the
        continuations of the longest matching n-gram's latest occurrences (up to ``TREE_MATCHES``), merged where
        they agree, the latest first (its first branch is the chain, cut where the other first tokens need room:
        ``merge_branches``)."""
        if not self.tree:
            return Proposal(self.propose(k))
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            pos = self._after[n].get(tuple(tokens[len(tokens) - n:]))
            if pos is None:
                continue
            continuations = []
            while pos is not None and len(continuations) < self.TREE_MATCHES:
                continuations.append(tokens[pos:pos + k])
                pos = self._prev[n][pos]
            nodes, parents = merge_branches(continuations, k)
            return Proposal(nodes, parents=parents if not is_chain(parents) else None)
        return Proposal([])


def merge_branches(branches: list[list[int]], budget: int) -> tuple[list[int], list[int]]:
    """(tokens, parents) of the trie of ``branches`` (-1: the root), at most ``budget`` nodes: the first branch as
    deep as it goes while one node stays for every other first token, then each other branch's first token, then
    the other branches as deep as the rest of the budget allows, in the order given."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node

    def add(branch: list[int], cap: int) -> None:
        at = -1
        for token in branch:
            node = children.get((at, token))
            if node is None:
                if len(tokens) >= cap:
                    return
                node = children[(at, token)] = len(tokens)
                tokens.append(token)
                parents.append(at)
            at = node

    if not branches:
        return tokens, parents
    others = {b[0] for b in branches[1:] if b} - {branches[0][0] if branches[0] else None}
    add(branches[0], max(1, budget - len(others)))
    for branch in branches[1:]:
        add(branch[:1], budget)
    for branch in branches[1:]:
        add(branch, budget)
    return tokens, parents


class NgramIndexes:
    """The factory of n-gram indexes for n in [min_n, max_n] (checked once, here); ``tree``: they propose token
    trees."""

    def __init__(self, min_n: int, max_n: int, tree: bool = False):
        check_lookup(min_n, max_n)
        self.min_n, self.max_n, self.tree = min_n, max_n, tree

    def __call__(self) -> NgramIndex:
        return NgramIndex(self.min_n, self.max_n, self.tree)

    def describe(self) -> str:
        return f"n-gram lookup, n from {self.max_n} down to {self.min_n}"


@dataclass
class _NgramSequence:
    index: Any  # an NgramIndex, or another index (specdec.suffix.SuffixIndex)
    tokens: list[int] = field(default_factory=list)  # (the runner interface: what the service holds)
    last_used: float = field(default_factory=time.monotonic)
    state: DraftingState = field(default_factory=DraftingState)


class NgramStore:
    """Per-sequence indexes (made by ``new_index``) with the bookkeeping interface of a ModelRunner
    (services use either)."""

    def __init__(self, new_index, max_sequences: int = 256, max_model_len: int = 1 << 20):
        self.new_index = new_index
        self.max_sequences = max_sequences
        self.max_model_len = max_model_len
        self.sequences: dict[str, _NgramSequence] = {}
        self.lock = threading.RLock()
        self.role = "draft"

    def get_or_create(self, sequence_id: str) -> _NgramSequence:
        seq = self.sequences.get(sequence_id)
        if seq is None:
            if len(self.sequences) >= self.max_sequences:
                raise ResourceExhaustedError(f"draft: {len(self.sequences)} sequences cached, the cap is "
                                             f"{self.max_sequences}; release finished sequences or raise max_sequences")
            seq = self.sequences[sequence_id] = _NgramSequence(self.new_index())
        seq.last_used = time.monotonic()
        return seq

    def get(self, sequence_id: str) -> _NgramSequence:
        try:
            return self.sequences[sequence_id]
        except KeyError:
            raise SequenceNotFoundError(f"draft: unknown sequence {sequence_id!r}") from None

    def release(self, sequence_id: str) -> bool:
        seq = self.sequences.pop(sequence_id, None)
        if seq is None:
            return False
        seq.index.close()
        return True

    def __contains__(self, sequence_id: str) -> bool:
        return sequence_id in self.sequences


class NgramWorker:
    """The draft worker interface (``propose`` / ``propose_batch`` / ``release``) over n-gram lookups."""

    def __init__(self, store: NgramStore):
        self.runner = store  # the name services and the LLM use for a worker's sequence store
        self.tli = None

    def propose(self, sequence_id: str, token_ids: list[int], num_speculative_tokens: int, params: Any) -> Proposal:
        (result,) = self.propose_batch([_Call(sequence_id, token_ids, num_speculative_tokens)])
        if isinstance(result, BaseException):
            raise result
        return result

    def lookup(self, call) -> Proposal:
        if not call.token_ids:
            raise InvalidRequestError("draft: the sequence is empty", param="prompt")
        seq = self.runner.get_or_create(call.sequence_id)
        seq.index.sync(call.token_ids)
        seq.tokens = seq.index.tokens
        return seq.index.proposal(call.num_speculative_tokens)

    def propose_batch(self, calls: list) -> list[Proposal | SpecDecError]:
        results: list[Proposal | SpecDecError] = []
        with self.runner.lock:
            for call in calls:
                try:
                    results.append(self.lookup(call))
                except SpecDecError as exc:
                    results.append(exc)
        return results

    def release(self, sequence_id: str) -> None:
        with self.runner.lock:
            self.runner.release(sequence_id)


@dataclass
class _Call:
    sequence_id: str
    token_ids: list[int]
    num_speculative_tokens: int


class HybridDraftWorker:
    """N-gram lookup first; the draft model drafts for the sequences without a match.

    Each sequence's index lives with the model's sequence (``state.lookup_index``), so it is released and
    expired with it, and it records the committed history the service holds (``state.held_target_ids``) even
    over rounds the model did not draft."""

    def __init__(self, model_worker, new_index, model_k: int | None = None, merge_below: float = 0.0):
        self.model = model_worker
        self.runner = model_worker.runner
        self.tli = model_worker.tli
        self.new_index = new_index
        self.model_k = model_k  # the model's drafts per round (None: the call's k); lookups take the call's k
        # a lookup's tree expecting fewer accepted tokens than this (the sum of its nodes' probabilities) is merged
        # with the model's tree (``specdec.trees.merge``) where the model drafts trees; 0: never
        self.merge_below = merge_below if getattr(model_worker, "tree", None) is not None else 0.0
        # rounds proposed since start, by drafter (specdec_hybrid_draft_rounds): the lookup's alone, the model's
        # alone, or one tree of both
        self.rounds = {"lookup": 0, "model": 0, "merged": 0}

    def _merges(self, call, result) -> bool:
        """Whether this round's lookup tree is weak enough to share the round with the model's tree (a sampled
        request that the model drafts probabilistically gets a chain without node estimates: not merged)."""
        if not (isinstance(result, Proposal) and result.draft_token_ids and result.node_probs is not None
                and sum(result.node_probs) < self.merge_below):
            return False
        method = call.draft_sample_method or getattr(self.model, "draft_sample_method", "greedy")
        return method != "probabilistic" or call.params.greedy

    def propose(self, sequence_id: str, token_ids: list[int], num_speculative_tokens: int, params: Any) -> Proposal:
        result = until_finished(self.propose_batch, ProposeCall(sequence_id, token_ids, num_speculative_tokens, params))
        if isinstance(result, BaseException):
            raise result
        return result

    def _lookup(self, call) -> Proposal:
        if not call.token_ids:
            raise InvalidRequestError("draft: the sequence is empty", param="prompt")
        seq = self.runner.get_or_create(call.sequence_id, call.params.seed, call.params.priority)
        index = seq.state.lookup_index
        if index is None:
            index = seq.state.lookup_index = self.new_index()
        index.sync(call.token_ids)
        if self.tli is None:  # (a TLI draft keeps its target ids itself)
            seq.state.held_target_ids = index.tokens
        return index.proposal(call.num_speculative_tokens)

    def propose_batch(self, calls: list) -> list[Proposal | SpecDecError]:
        results: list = []
        with self.runner.lock:
            for call in calls:
                try:
                    results.append(self._lookup(call))
                except SpecDecError as exc:
                    results.append(exc)
        need = [i for i, r in enumerate(results) if isinstance(r, Proposal) and calls[i].num_speculative_tokens > 0
                and (not r.draft_token_ids or self._merges(calls[i], r))]
        if need:
            asked = [calls[i] if self.model_k is None or calls[i].num_speculative_tokens <= self.model_k
                     else replace(calls[i], num_speculative_tokens=self.model_k) for i in need]
            for i, r in zip(need, self.model.propose_batch(asked)):
                results[i], drafter = _merged(results[i], r, calls[i].num_speculative_tokens)
                if isinstance(results[i], Proposal) and results[i].draft_token_ids:
                    self.rounds[drafter] += 1
        drafted = set(need)
        self.rounds["lookup"] += sum(1 for i, r in enumerate(results) if i not in drafted and isinstance(r, Proposal)
                                     and r.draft_token_ids)
        absorb = getattr(self.model, "absorb", None)  # an EAGLE head: it takes the features of every round
        if absorb is not None:
            rest = [i for i, r in enumerate(results) if i not in drafted and isinstance(r, Proposal)]
            for i, held in zip(rest, absorb([calls[i] for i in rest]) if rest else ()):
                if isinstance(held, SpecDecError):
                    results[i] = held
                else:
                    results[i].features_from = held
        return results

    def release(self, sequence_id: str) -> None:
        self.model.release(sequence_id)


def _merged(lookup: Proposal, model: Any, k: int) -> tuple[Any, str]:
    """(The round's result, who drafted it: "model", "lookup" or "merged"). The model's result where the lookup
    proposed nothing (a proposal, an error, or UNFINISHED: its prompt is still being fed); else one tree of both
    (``trees.merge``, k nodes at most). UNFINISHED passes through (the call comes again); where the model failed or
    has nothing to add (no drafts, no node estimates), the lookup's proposal stands, as on a round the model sat
    out."""
    if not lookup.draft_token_ids or model is UNFINISHED:
        return model, "model"
    if not isinstance(model, Proposal):
        return lookup, "lookup"  # (an EAGLE head that failed holds no feature of this round: features_from unset)
    if not model.draft_token_ids or model.node_probs is None:
        return replace(lookup, features_from=model.features_from), "lookup"
    tokens, parents, probs = merge([(lookup.draft_token_ids, lookup.parents, lookup.node_probs),
                                    (model.draft_token_ids, model.parents, model.node_probs)], k)
    return Proposal(tokens, parents=None if is_chain(parents) else parents, node_probs=probs,
                    features_from=model.features_from), "merged"


def lookup_indexes(spec: Any) -> Any:
    """The factory of per-sequence lookup indexes a ``SpeculativeConfig`` drafts with (``NgramStore``'s
    ``new_index``): a ``SuffixCache`` (method suffix), ``NgramIndexes`` (ngram, or prompt_lookup_max set), or
    None (the draft model alone)."""
    if spec.uses_suffix:
        from specdec.suffix import SuffixCache

        return SuffixCache(spec.suffix_settings())
    if spec.uses_lookup:
        return NgramIndexes(*spec.lookup_range(), tree=spec.speculative_token_tree == DYNAMIC)
    return None
