"""The draft worker's view of a heterogeneous-vocabulary pair (Token-Level Intersection).

The draft reads the committed text re-tokenized with its own tokenizer (incrementally, via
:class:`DraftContext`), drafts only tokens that exist in both vocabularies, and its proposals — and
their distribution q, restricted to the intersection and renormalised — travel in target ids.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from specdec.tli.draft_context import DraftContext
from specdec.tli.vocab_mapping import VocabMapping, check_useful, load_or_build_mapping

logger = logging.getLogger(__name__)


class TLIAdapter:
    def __init__(self, draft_tokenizer: Any, target_tokenizer: Any, target_vocab_size: int,
                 mapping: VocabMapping | None = None):
        self.draft_tokenizer = draft_tokenizer
        self.target_tokenizer = target_tokenizer
        self.target_vocab_size = target_vocab_size
        self.mapping = check_useful(mapping or load_or_build_mapping(draft_tokenizer, target_tokenizer))
        self._d2t = self.mapping.draft_to_target
        # The draft's own BOS stays in front of its context when its tokenizer adds one.
        probe = draft_tokenizer("a").input_ids
        bos = draft_tokenizer.bos_token_id
        self._prefix = [bos] if bos is not None and probe and probe[0] == bos else []

    @property
    def target_fingerprint(self) -> str:
        return self.mapping.target_fingerprint

    def draft_history(self, state: dict, target_ids: list[int]) -> list[int]:
        """The draft ids of the committed text ``target_ids`` stand for; ``state`` is per sequence."""
        ctx: DraftContext | None = state.get("ctx")
        seen: list[int] = state.get("target_ids", [])
        if ctx is None or len(seen) > len(target_ids) or target_ids[: len(seen)] != seen:
            ctx = DraftContext(self.draft_tokenizer, target_tokenizer=self.target_tokenizer, prefix_ids=self._prefix)
            seen = []
            state["ctx"] = ctx
        ctx.extend_target_ids(target_ids[len(seen):])
        state["target_ids"] = list(target_ids)
        return ctx.ids

    def restrict(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V_draft] with non-intersection tokens at -inf."""
        return self.mapping.restrict_draft_logits(logits)

    def to_target(self, draft_id: int) -> int:
        return int(self._d2t[draft_id])

    def q_to_target(self, q: torch.Tensor) -> torch.Tensor:
        """q over draft ids [V_draft] (zero outside the intersection) → the same q over target ids."""
        out = q.new_zeros(self.target_vocab_size)
        ids = self.mapping._on("draft_ids", q.device)
        tids = self.mapping._on("target_ids", q.device)
        keep = ids < q.shape[-1]
        out[tids[keep]] = q[ids[keep]]
        return out
