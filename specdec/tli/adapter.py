"""The draft worker's view of a heterogeneous-vocabulary pair (Token-Level Intersection).

The draft reads the committed text re-tokenized with its own tokenizer (incrementally, via
:class:`DraftContext`), drafts only tokens that exist in both vocabularies, and its proposals — and
their distribution q, restricted to the intersection and renormalised — travel in target ids.

Greedy drafting has a second way to propose (``proposals="text"``): the draft drafts over its whole
vocabulary and the *text* of its tokens is tokenized with the target's tokenizer (the way transformers'
universal assisted generation converts drafts). A draft then also proposes target tokens that exist
only in the target's vocabulary (`` revolution`` drafted as `` revol`` + ``ution``). Still lossless:
a greedy draft is a deterministic function of the committed text, and the target accepts a
deterministic proposal with one-hot q by exactly the same rule as an intersection token.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from kernels.dispatch import kernels_mode, resolve
from specdec.config import TLI_PROPOSALS
from specdec.drafting_state import DraftingState, RetokenizedContext
from specdec.errors import ConfigError
from specdec.history import TokenHistory, common_prefix, mark_of, unchanged_prefix
from specdec.tli.draft_context import DraftContext
from specdec.tli.id_maps import tli_fns
from specdec.tli.vocab_mapping import VocabMapping, analyze_tokenizer, check_useful, load_or_build_mapping

logger = logging.getLogger(__name__)


class TLIAdapter:
    def __init__(self, draft_tokenizer: Any, target_tokenizer: Any, target_vocab_size: int,
                 mapping: VocabMapping | None = None, proposals: str = "text", kernels: str | None = None):
        if proposals not in TLI_PROPOSALS:
            raise ConfigError(f"tli_proposals must be one of {list(TLI_PROPOSALS)}, got {proposals!r}")
        self.proposals = proposals
        self.kernels = kernels_mode(kernels)  # the mapping's scatter and mask: Triton or torch per device
        self._pairs: dict = {}  # (device, q width) -> (draft ids, target ids) of the intersection
        self.draft_tokenizer = draft_tokenizer
        self.target_tokenizer = target_tokenizer
        self.target_vocab_size = target_vocab_size
        self.mapping = check_useful(mapping or load_or_build_mapping(draft_tokenizer, target_tokenizer))
        self._d2t = self.mapping.draft_to_target
        # The draft's own BOS stays in front of its context when its tokenizer adds one.
        probe = draft_tokenizer("a").input_ids
        bos = draft_tokenizer.bos_token_id
        self._prefix = [bos] if bos is not None and probe and probe[0] == bos else []
        self._draft_bytes = analyze_tokenizer(draft_tokenizer).bytes
        self._target_text = DraftContext(target_tokenizer)  # tokenizes drafted text into target ids
        self._target_text_lock = threading.Lock()

    def text_proposals(self, greedy_drafting: bool) -> bool:
        """Whether greedy drafts over the whole draft vocabulary are converted through their text."""
        return greedy_drafting and self.proposals == "text"

    def text_to_target(self, draft_ids: list[int], limit: int) -> list[int]:
        """At most ``limit`` target ids for the text of ``draft_ids`` (up to a special token; a trailing
        incomplete UTF-8 character is left out). Byte-exact: the ids decode to exactly that text."""
        data = bytearray()
        for t in draft_ids:
            b = self._draft_bytes[t] if 0 <= t < len(self._draft_bytes) else None
            if b is None:  # EOS or another special token: the text ends here
                break
            data += b
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:  # the draft stopped inside a character (or made invalid bytes)
            del data[exc.start:]
        if not data or limit <= 0:
            return []
        with self._target_text_lock:
            ctx = self._target_text
            ctx.reset()
            ctx.extend_bytes(bytes(data))
            return ctx.text_ids[:limit]

    @property
    def target_fingerprint(self) -> str:
        return self.mapping.target_fingerprint

    def draft_history(self, state: DraftingState, target_ids: list[int]) -> list[int]:
        """The draft ids of the committed text ``target_ids`` stand for; ``state`` is the sequence's.

        Incremental: the context re-tokenizes only the text of the new target ids (a small window, see
        ``DraftContext``); given the same ``TokenHistory`` again, only what changed since is compared; and
        the draft ids come back in one list per sequence, changed in place by what the context changed (it
        stays valid until the next call with this state)."""
        held = state.retokenized
        if held is not None:
            seen = held.target_ids  # the target ids the context holds the text of
            known = min(unchanged_prefix(held.source, held.mark, target_ids), len(seen))
            if len(target_ids) >= len(seen) and common_prefix(seen, target_ids, known) == len(seen):
                new = target_ids[len(seen):]
                stable = held.context.extend_target_ids(new)
                seen += new
                held.draft_ids.truncate(stable)
                held.draft_ids += held.context.ids_from(len(held.draft_ids))
                held.source, held.mark = mark_of(target_ids)
                return held.draft_ids
        # a new sequence, or a history that does not extend the last one: from the start (the same lists: the
        # service compares what it holds with what it sent)
        seen, draft_ids = (held.target_ids, held.draft_ids) if held is not None else (TokenHistory(), TokenHistory())
        seen.truncate(0)
        draft_ids.truncate(0)
        ctx = DraftContext(self.draft_tokenizer, target_tokenizer=self.target_tokenizer, prefix_ids=self._prefix)
        ctx.extend_target_ids(target_ids)
        seen += target_ids
        draft_ids += ctx.ids
        state.retokenized = RetokenizedContext(ctx, seen, draft_ids, *mark_of(target_ids))
        state.held_target_ids = seen
        return draft_ids

    def _fns(self, device: torch.device):
        return tli_fns(resolve(self.kernels, device))

    def restrict(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V_draft] with non-intersection tokens at -inf."""
        _, mask_ids = self._fns(logits.device)
        return mask_ids(logits, self.mapping._on("draft_mask", logits.device), float("-inf"))

    def to_target(self, draft_id: int) -> int:
        return int(self._d2t[draft_id])

    def to_draft(self, target_id: int) -> int:
        """The draft id of an intersection token given by its target id (``to_target``'s inverse)."""
        draft_id = int(self.mapping.target_to_draft[target_id]) if 0 <= target_id < len(self.mapping.target_to_draft) else -1
        if draft_id < 0:
            raise ValueError(f"target id {target_id} is not in the draft/target intersection")
        return draft_id

    def q_to_target(self, q: torch.Tensor) -> torch.Tensor:
        """q over draft ids [V_draft] (zero outside the intersection) → the same q over target ids."""
        key = (q.device, q.shape[-1])
        pairs = self._pairs.get(key)
        if pairs is None:  # once per device and width: no host sync per call
            ids = self.mapping._on("draft_ids", q.device)
            tids = self.mapping._on("target_ids", q.device)
            keep = ids < q.shape[-1]  # a q narrower than the mapping's draft vocabulary
            pairs = self._pairs[key] = (ids[keep], tids[keep])
        ids, tids = pairs
        scatter_ids, _ = self._fns(q.device)
        return scatter_ids(q, ids, tids, self.target_vocab_size, 0.0)
