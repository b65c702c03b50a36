"""The EAGLE-3 draft worker: proposes k tokens per sequence from the target's features (pure torch).

Each sequence keeps the head's keys and values of the positions it has a target feature for (position p: the
target's feature at p beside token p + 1), the committed tokens they were computed with, and the head's last
output. A Propose feeds the positions whose features arrived (``ProposeCall.features``), drafts k tokens (the
first from the last fed position, each next one from the head's own output), and cuts its cache back to the
target-feature positions: nothing drafted survives into the next round, where the target's real features
replace it. ``Proposal.features_from`` tells the caller the first position it still needs a feature for
(``specdec.features.FeatureRelay``); lacking features (a restart, an eviction, the first round of a sequence,
whose prompt the target has not read yet) it proposes nothing and says from where it needs them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.calls import ProposeCall
from specdec.drafting_state import DraftingState
from specdec.config import TreeShape
from specdec.engine.eagle3 import Eagle3Head, HeadCache
from specdec.engine.tree_drafting import CandidateTree
from specdec.engine.workers import check_draft_sample_method, race_winner, truncate_top_n
from specdec.errors import InvalidRequestError, ResourceExhaustedError, SequenceNotFoundError, SpecDecError
from specdec.feature_rows import chunk_rows
from specdec.features import FeatureChunk
from specdec.history import common_prefix, mark_of, unchanged_prefix
from specdec.proposal import Proposal
from specdec.sampling import apply_penalties, penalty_context, process_logits, sample

@dataclass
class _HeadSequence:
    cache: HeadCache
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)  # the committed tokens the cache was computed with
    source: Any = None  # the history the tokens were last read from, and its mark (specdec.history)
    mark: Any = None
    consumed: int = 0  # positions [0, consumed) hold the target's features in the cache
    last: tuple[torch.Tensor, torch.Tensor] | None = None  # (logits, prenorm) of position consumed - 1
    # features of positions [consumed, consumed + held_rows) taken on rounds another drafter proposed for (a hybrid's
    # suffix rounds), fed to the head only when it next drafts: one pass over them all instead of one per round
    held: list[torch.Tensor] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)
    state: DraftingState = field(default_factory=DraftingState)

    @property
    def held_rows(self) -> int:
        return sum(part.shape[0] for part in self.held)

    def keep_held(self, rows: int) -> None:
        """Keep the first ``rows`` held rows."""
        kept, n = [], 0
        for part in self.held:
            if n >= rows:
                break
            kept.append(part[:rows - n])
            n += kept[-1].shape[0]
        self.held = kept


class HeadStore:
    """The head's sequences (the ``runner`` a service and the LLM use for a worker's sequences)."""

    def __init__(self, head: Eagle3Head, max_model_len: int, max_sequences: int = 256):
        self.head = head
        self.max_model_len = max_model_len
        self.max_sequences = max_sequences
        self.sequences: dict[str, _HeadSequence] = {}
        self.lock = threading.RLock()
        self.role = "draft"

    def get_or_create(self, sequence_id: str, seed: int | None, priority: int | None = None) -> _HeadSequence:
        """(``priority``: the model runners' signature, which a hybrid's lookup calls; a head has no preemption)"""
        seq = self.sequences.get(sequence_id)
        if seq is None:
            if len(self.sequences) >= self.max_sequences:
                raise ResourceExhaustedError(f"draft: {len(self.sequences)} sequences cached, the cap is "
                                             f"{self.max_sequences}; release finished sequences or raise max_sequences")
            cfg, p = self.head.cfg, self.head.norm
            generator = torch.Generator(device=p.device)
            generator.manual_seed(seed if seed is not None else torch.seed())
            seq = self.sequences[sequence_id] = _HeadSequence(HeadCache(cfg.num_key_value_heads, cfg.dim, p.dtype,
                                                                        p.device), generator)
        seq.last_used = time.monotonic()
        return seq

    def get(self, sequence_id: str) -> _HeadSequence:
        try:
            return self.sequences[sequence_id]
        except KeyError:
            raise SequenceNotFoundError(f"draft: unknown sequence {sequence_id!r}") from None

    def release(self, sequence_id: str) -> bool:
        return self.sequences.pop(sequence_id, None) is not None

    def __contains__(self, sequence_id: str) -> bool:
        return sequence_id in self.sequences


class Eagle3Worker:
    """The draft worker interface (``propose`` / ``propose_batch`` / ``release``) over an EAGLE-3 head."""

    def __init__(self, store: HeadStore, draft_sample_method: str = "greedy", top_n: int | None = None,
                 eos_token_ids: frozenset[int] = frozenset(), tree: TreeShape | None = None):
        """``tree``: greedy drafting grows EAGLE-2's dynamic trees (top-k children of the likeliest candidates, level
        by level, the best ``max_nodes`` proposed: ``_propose_tree``); None: chains."""
        check_draft_sample_method(draft_sample_method)
        self.tree = tree
        self.runner = store
        self.head = store.head
        self.draft_sample_method = draft_sample_method
        self.top_n = top_n
        self.eos_token_ids = eos_token_ids
        self.tli = None
        self._target_ids = store.head.target_ids()  # draft id -> target id

    def propose_batch(self, calls: list[ProposeCall]) -> list[Proposal | SpecDecError]:
        results: list[Any] = []
        with self.runner.lock, torch.inference_mode():
            for call in calls:
                try:
                    results.append(self._propose(call))
                except SpecDecError as exc:
                    results.append(exc)
        return results

    def _gather(self, seq: _HeadSequence, tokens: list[int], chunks: list[FeatureChunk]) -> list[torch.Tensor]:
        """The features of positions [seq.consumed, len(tokens) - 1) that the held rows and ``chunks`` hold without a
        gap, from seq.consumed on, as parts in order (the held ones first, not copied)."""
        want_end = len(tokens) - 1
        rows, start = [], seq.consumed
        for part in seq.held:
            if start >= want_end:
                break
            rows.append(part[:want_end - start])
            start += rows[-1].shape[0]
        for chunk in chunks:
            if start >= want_end:
                break
            if chunk.end <= start or chunk.start > start:  # before what is held, or a gap
                continue
            data = chunk_rows(chunk)
            if data.shape[-1] != 3 * self.head.cfg.target_width:
                raise InvalidRequestError(f"features of width {data.shape[-1]}; this EAGLE-3 head reads "
                                          f"3 x {self.head.cfg.target_width}", param="features")
            take = data[start - chunk.start: min(chunk.end, want_end) - chunk.start]
            rows.append(take)
            start += take.shape[0]
        return [r for r in rows if r.shape[0]]

    def _feed(self, seq: _HeadSequence, tokens: list[int], chunks: list[FeatureChunk]) -> None:
        """Feed the positions [seq.consumed, len(tokens) - 1) whose features the held rows and ``chunks`` hold."""
        parts = self._gather(seq, tokens, chunks)
        seq.held = []
        if not parts:
            return
        feats = torch.cat([r.to(parts[-1].dtype) for r in parts]) if len(parts) > 1 else parts[0]
        start = seq.consumed + feats.shape[0]
        device = self.head.norm.device
        ids = torch.tensor(tokens[seq.consumed + 1: start + 1], dtype=torch.long, device=device)
        positions = torch.arange(seq.consumed, start, device=device)
        logits, prenorm = self.head.step(ids, feats.to(device), positions, seq.cache)
        seq.consumed, seq.last = start, (logits[-1], prenorm[-1])

    def _sync(self, call: ProposeCall, feed: bool = True) -> _HeadSequence:
        """The call's sequence with its cache following the call's tokens and fed the features the call brings
        (``feed=False``: held for the next round the head drafts, in ``seq.held``)."""
        tokens = call.token_ids
        if not tokens:
            raise InvalidRequestError("draft: the sequence is empty", param="prompt")
        if len(tokens) + call.num_speculative_tokens > self.runner.max_model_len + 1:
            raise InvalidRequestError(f"{len(tokens)} tokens + {call.num_speculative_tokens} draft tokens exceed "
                                      f"max_model_len={self.runner.max_model_len}", param="max_model_len")
        seq = self.runner.get_or_create(call.sequence_id, call.params.seed)
        # the held tokens follow the call's by what changed only (a round costs its new ids, not the history)
        same = common_prefix(seq.tokens, tokens, unchanged_prefix(seq.source, seq.mark, tokens))
        del seq.tokens[same:]
        seq.tokens.extend(tokens[same:])
        seq.source, seq.mark = mark_of(tokens)
        # position p's entry was computed with tokens up to p + 1: it stays while those are unchanged
        keep = min(seq.consumed, max(same - 1, 0))
        if keep < seq.consumed:
            seq.cache.truncate(keep)
            seq.consumed, seq.last, seq.held = keep, None, []
        else:  # position p's feature stays while tokens up to p are unchanged
            seq.keep_held(max(0, same - seq.consumed))
        if feed:
            self._feed(seq, tokens, call.features or [])
        else:
            seq.held = self._gather(seq, tokens, call.features or [])
        return seq

    def absorb(self, calls: list[ProposeCall]) -> list[int | SpecDecError]:
        """Take each call's features without drafting (a round another drafter proposed for, as suffix decoding in
        a hybrid): held, and fed in one pass when the head next drafts. Per call the first position the head still
        lacks a feature for, or the error."""
        out: list[Any] = []
        with self.runner.lock, torch.inference_mode():
            for call in calls:
                try:
                    seq = self._sync(call, feed=False)
                    out.append(seq.consumed + seq.held_rows)
                except SpecDecError as exc:
                    out.append(exc)
        return out

    def _propose(self, call: ProposeCall) -> Proposal:
        method = call.draft_sample_method or self.draft_sample_method
        check_draft_sample_method(method)
        seq = self._sync(call)
        tokens = call.token_ids
        k = call.num_speculative_tokens
        if seq.consumed < len(tokens) - 1 or seq.last is None or k == 0:
            return Proposal([], features_from=seq.consumed)
        probabilistic = method == "probabilistic" and not call.params.greedy
        if self.tree is not None and not probabilistic:
            return self._propose_tree(call, seq, tokens, self.tree)
        drafts, qs = [], []
        logits, prenorm = seq.last
        device = prenorm.device
        for i in range(k):
            if i:  # the head's own output stands in for the target's feature
                ids = torch.tensor([drafts[-1]], dtype=torch.long, device=device)
                position = torch.tensor([len(tokens) - 2 + i], device=device)
                step_logits, step_prenorm = self.head.step(ids, prenorm[None], position, seq.cache)
                logits, prenorm = step_logits[0], step_prenorm[0]
            if not probabilistic and not call.params.has_penalties:  # the argmax, in the draft's vocabulary
                drafts.append(int(self._target_ids[int(logits.argmax())]))
                continue
            last = self.head.to_target_logits(logits)
            if call.params.has_penalties:  # as the target will process this position
                last = apply_penalties(last, call.params, penalty_context(call.params, tokens, self.eos_token_ids,
                                                                          after=drafts))
            if probabilistic:
                q = truncate_top_n(process_logits(last, call.params), self.top_n)
                if call.params.couples:  # the race the target runs, over q (specdec.seeding)
                    drafts.append(race_winner(q, call.params.seed, len(tokens) + len(drafts)))
                else:
                    drafts.append(int(sample(q, seq.generator)))
                qs.append(q)
            else:
                drafts.append(int(last.argmax()))
        seq.cache.truncate(seq.consumed)  # drafted entries never outlive the round
        return Proposal(drafts, torch.stack(qs) if qs else None, features_from=seq.consumed)

    def _propose_tree(self, call: ProposeCall, seq: _HeadSequence, tokens: list[int], shape: TreeShape) -> Proposal:
        """EAGLE-2's dynamic tree from the head: the root's top-k children from the head's last output; each level
        feeds the top-k candidates by cumulative log-probability in one head pass (each beside its parent's output,
        at its depth's position, attending to the history and its own path) and adds their top-k children; after
        ``num_speculative_tokens`` levels the ``max_nodes`` likeliest are proposed, likeliest first. The nodes'
        cache entries go after the round, as a chain's drafts do."""
        logits, prenorm = seq.last
        device, past = prenorm.device, seq.cache.length
        tree, top = CandidateTree(), list(range(shape.top_k))
        hidden = {-1: prenorm}  # node -> the head's output after it (the feature of its children)
        fed: list[int] = []  # nodes in cache order after the history
        depth = {-1: -1}

        # without penalties the candidates are ranked in the draft's vocabulary and mapped to target ids
        id_map = None if call.params.has_penalties else self._target_ids

        def logprobs(node: int, row: torch.Tensor) -> torch.Tensor:
            if id_map is not None:
                return torch.log_softmax(row.float(), dim=-1)
            last = apply_penalties(self.head.to_target_logits(row), call.params, penalty_context(
                call.params, tokens, self.eos_token_ids, after=tree.path(node)))  # as the target will see it
            return torch.log_softmax(last.float(), dim=-1)

        tree.add_children(-1, logprobs(-1, logits), top, id_map)
        for _ in range(1, call.num_speculative_tokens):
            expand = sorted(tree.level, key=lambda i: (-tree.scores[i], i))[:shape.top_k]
            for n in expand:
                depth[n] = depth[tree.parents[n]] + 1
            mask = torch.zeros(len(expand), past + len(fed) + len(expand), dtype=torch.bool, device=device)
            mask[:, :past] = True
            where = {node: past + i for i, node in enumerate(fed + expand)}  # each node's cache entry
            rows_at, cols_at = [], []
            for j, n in enumerate(expand):
                node = n
                while node >= 0:  # its path: itself (fed now) and its ancestors (fed before)
                    rows_at.append(j)
                    cols_at.append(where[node])
                    node = tree.parents[node]
            mask[rows_at, cols_at] = True
            ids = torch.tensor([tree.tokens[n] for n in expand], dtype=torch.long, device=device)
            features = torch.stack([hidden[tree.parents[n]] for n in expand])
            positions = torch.tensor([len(tokens) - 1 + depth[n] for n in expand], device=device)
            rows, outs = self.head.step(ids, features, positions, seq.cache, mask=mask)
            fed += expand
            if id_map is not None:  # every node's top k at once
                values, ranked = torch.log_softmax(rows.float(), dim=-1).topk(shape.top_k)
                values, ranked = values.tolist(), id_map[ranked].tolist()
            level = []
            for j, n in enumerate(expand):
                hidden[n] = outs[j]
                if id_map is not None:
                    tree.add_ranked(n, values[j], ranked[j], top)
                else:
                    tree.add_children(n, logprobs(n, rows[j]), top, id_map)
                level += tree.level
            tree.level = level
        seq.cache.truncate(seq.consumed)  # drafted entries never outlive the round
        proposal = tree.proposal(shape.max_nodes)
        proposal.features_from = seq.consumed
        return proposal

    def propose(self, sequence_id: str, token_ids: list[int], num_speculative_tokens: int, params: Any) -> Proposal:
        (result,) = self.propose_batch([ProposeCall(sequence_id, token_ids, num_speculative_tokens, params)])
        if isinstance(result, BaseException):
            raise result
        return result

    def release(self, sequence_id: str) -> None:
        with self.runner.lock:
            self.runner.release(sequence_id)
