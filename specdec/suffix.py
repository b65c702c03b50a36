"""Suffix decoding (vLLM's ``method: "suffix"``, Snowflake's ArcticInference): drafts from suffix trees.

Two trees answer each round: the sequence's own (its prompt and output so far) and one **global tree
over the outputs of earlier and concurrent sequences**, shared by every sequence this process drafts
for (in the draft service: by every gateway that uses it). The last ``max_tree_depth`` tokens of the
history are matched in both; from the longest match the draft walks down the most frequent
continuation while its empirical probability stays at or above ``min_token_prob``, at most
``max_spec_factor`` x the matched length and ``num_speculative_tokens`` tokens: long after a long
match, nothing when nothing matched (open prose costs no verify rows). The better-scoring tree's draft
(the sum of its tokens' probabilities) is proposed.

The trees are ArcticInference's C++ suffix tree (``arctic_inference.suffix_decoding._C.SuffixTree``,
the one vLLM's suffix method uses: path-compressed, O(new tokens x depth) per extension), driven here
with this project's history bookkeeping: a history that is cut back (a lookahead's drafts lost) is
re-indexed, so no tree ever holds tokens the sequence did not keep. The global tree keeps the outputs of
at most ``max_cached_requests`` sequences, the oldest evicted first (0: no global tree). It is a cache:
losing it (a restart) costs speed, never output, because a draft is a deterministic proposal the
target verifies (one-hot q: accepted with probability p(x)).

No torch, no grpc: the draft service, the offline ``LLM`` and the benchmarks use it alike.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import OrderedDict

import specdec.config as config
from specdec.config import SuffixSettings  # noqa: F401 - its checked settings (re-exported)
from specdec.errors import ConfigError
from specdec.history import common_prefix, mark_of, unchanged_prefix
from specdec.proposal import Proposal
from specdec.trees import is_chain

# ArcticInference's suffix tree, where it is installed (specdec.config checks it: the default pair falls back)
INSTALL_HINT = config.SUFFIX_INSTALL_HINT
suffix_available = config.suffix_available


class SuffixCache:
    """The global tree (outputs of earlier sequences, FIFO-bounded) and the factory of per-sequence
    indexes. Not thread-safe by itself: callers hold their store's lock (as for every runner)."""

    def __init__(self, settings: SuffixSettings | None = None):
        self.settings = settings or SuffixSettings()
        self._tree_class = config.suffix_tree_class()
        self.global_tree = self._tree_class(self.settings.max_tree_depth)
        # seq id in the global tree -> a weak reference to its index (None once the sequence ended; weak, so a
        # sequence dropped without close() frees its own tree): insertion order is eviction order
        self._cached: OrderedDict[int, "weakref.ref[SuffixIndex] | None"] = OrderedDict()
        self._ids = itertools.count(1)
        self.evicted = 0
        self.lock = threading.RLock()  # for readers outside the store's lock (metrics)

    # -- per sequence ----------------------------------------------------------------------------------
    def __call__(self) -> "SuffixIndex":
        """A new sequence's index (the factory interface of ``specdec.ngram.NgramStore``)."""
        return SuffixIndex(self)

    def _admit(self, index: "SuffixIndex") -> int | None:
        """A slot in the global tree for a new sequence's output (None: no global tree)."""
        if self.settings.max_cached_requests == 0:
            return None
        seq_id = next(self._ids) & 0x7FFFFFFF
        self._cached[seq_id] = weakref.ref(index)
        while len(self._cached) > self.settings.max_cached_requests:
            old_id, ref = self._cached.popitem(last=False)
            self.global_tree.remove(old_id)
            old = ref() if ref is not None else None
            if old is not None:  # an active sequence's output left the cache: it stops adding to it
                old.global_id = None
            self.evicted += 1
        return seq_id

    def _finished(self, seq_id: int | None) -> None:
        if seq_id is not None and seq_id in self._cached:
            self._cached[seq_id] = None  # still cached; no longer anyone's to extend

    def describe(self) -> str:
        s = self.settings
        return (f"suffix trees of depth {s.max_tree_depth}, a global tree over up to {s.max_cached_requests} sequences' "
                f"outputs, drafts up to {s.max_spec_factor:g} x the match, branches down to p={s.min_token_prob:g}")

    # -- metrics ---------------------------------------------------------------------------------------
    def cached_requests(self) -> int:
        return len(self._cached)

    def memory_bytes(self) -> int:
        """The global tree's estimated size (walks the tree: call it when scraped, not per round)."""
        with self.lock:
            return int(self.global_tree.estimate_memory())


class SuffixIndex:
    """One sequence's suffix drafting state: its own tree over prompt + output, its output in the global
    tree. ``sync(token_ids)`` follows the history as ``NgramIndex.sync`` does (only the change is
    indexed); ``propose(k)`` drafts; ``close()`` ends it (its output stays in the global tree)."""

    def __init__(self, cache: SuffixCache):
        self.cache = cache
        self.tokens: list[int] = []  # what is indexed (prompt + output)
        self.prompt_len: int | None = None  # the first history synced is the prompt; the rest is output
        self.global_id: int | None = None
        self.local = cache._tree_class(cache.settings.max_tree_depth)
        self._source = None
        self._mark = None
        self.last_match_len = 0  # the last proposal's matched context length and score (sum of its probabilities)
        self.last_score = 0.0

    def sync(self, token_ids: list[int]) -> None:
        known = min(unchanged_prefix(self._source, self._mark, token_ids), len(self.tokens))
        keep = common_prefix(self.tokens, token_ids, known)
        with self.cache.lock:
            if self.prompt_len is None:
                self.prompt_len = len(token_ids)
                self.global_id = self.cache._admit(self)
            elif keep < len(self.tokens):
                self._rebuild(min(keep, len(self.tokens)))
            new = token_ids[len(self.tokens):]
            if new:
                self.local.extend(0, list(new))
                output_new = new[max(0, self.prompt_len - len(self.tokens)):]
                if output_new and self.global_id is not None:
                    self.cache.global_tree.extend(self.global_id, list(output_new))
                self.tokens.extend(new)
        self._source, self._mark = mark_of(token_ids)

    def _rebuild(self, keep: int) -> None:
        """Index only ``tokens[:keep]`` (a cut-back: trees only grow, so both are rebuilt from the kept ids)."""
        del self.tokens[keep:]
        self.prompt_len = min(self.prompt_len, keep)
        self.local = self.cache._tree_class(self.cache.settings.max_tree_depth)
        if self.tokens:
            self.local.extend(0, list(self.tokens))
        if self.global_id is not None:
            self.cache.global_tree.remove(self.global_id)
            output = self.tokens[self.prompt_len:]
            if output:
                self.cache.global_tree.extend(self.global_id, list(output))

    def propose(self, k: int) -> list[int]:
        """Up to k tokens from the better of the two trees' drafts (none when nothing matched)."""
        return self._speculate(k, False)[0]

    def proposal(self, k: int) -> Proposal:
        """This round's proposal: a chain, or with ``token_tree`` a token tree of up to k nodes (every continuation
        the better suffix tree holds above ``min_token_prob``, scored by frequency: ``specdec.trees``)."""
        tokens, parents, probs = self._speculate(k, self.cache.settings.token_tree)
        return Proposal(tokens, parents=parents if parents and not is_chain(parents) else None, node_probs=probs)

    def _speculate(self, k: int, tree: bool) -> tuple[list[int], list[int], list[float]]:
        self.last_match_len, self.last_score = 0, 0.0
        if k <= 0 or not self.tokens:
            return [], [], []
        s = self.cache.settings
        context = self.tokens[-s.max_tree_depth:]
        with self.cache.lock:
            best = self.local.speculate(context, k, s.max_spec_factor, 0.0, s.min_token_prob, tree)
            if self.cache.settings.max_cached_requests:
                other = self.cache.global_tree.speculate(context, k, s.max_spec_factor, 0.0, s.min_token_prob, tree)
                if other.score > best.score:
                    best = other
        self.last_match_len, self.last_score = best.match_len, best.score
        if best.score < s.min_score:  # too weak to bet a round on (a hybrid's model drafts instead)
            return [], [], []
        return list(best.token_ids[:k]), list(best.parents[:k]), list(best.probs[:k])

    def close(self) -> None:
        with self.cache.lock:
            self.cache._finished(self.global_id)
        self.global_id = None
