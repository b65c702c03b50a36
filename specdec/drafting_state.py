"""What a service keeps per sequence beside its KV blocks: typed, one field per user (no torch here).

A sequence's entry in the KV cache manager (``specdec.engine.kv_manager.CachedSequence``) or in a model-free
drafter's store (``specdec.ngram.NgramStore``) carries one ``DraftingState``. It is released and expired with
the sequence, so whatever a drafter derives from the history lives exactly as long as the blocks do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdec.history import Mark, TokenHistory
    from specdec.tli.draft_context import DraftContext


@dataclass
class RetokenizedContext:
    """A TLI draft's view of the committed text (``specdec.tli.adapter.TLIAdapter.draft_history``): the target
    ids whose text the context holds, and the draft's own ids for that text, both kept in place."""

    context: DraftContext
    target_ids: TokenHistory
    draft_ids: TokenHistory
    source: Any = None  # the history object the target ids were last read from, and its mark (specdec.history)
    mark: Mark | None = None


@dataclass
class AnsweredHistory:
    """The history a service answered a sequence's last call with (``specdec.serving.backend``): the ids it held
    then, the history it returned, and how many leading ids the two shared."""

    held_then: list[int] | None
    tokens: TokenHistory
    shared: int


@dataclass
class DraftingState:
    """Per-sequence state of the drafters and of the service's history bookkeeping."""

    # The committed target ids this sequence's drafting holds, where they are not its KV tokens: a TLI draft's
    # (its KV holds draft ids) and a lookup's (a hybrid draft skips the model on lookup rounds). None: the KV
    # tokens are the held history.
    held_target_ids: list[int] | None = None
    retokenized: RetokenizedContext | None = None  # TLI drafts
    lookup_index: Any = None  # n-gram or suffix drafting (specdec.ngram.NgramIndex, specdec.suffix.SuffixIndex)
    answered: AnsweredHistory | None = None  # the service's incremental history (start_position > 0 calls)
