"""Token-Level Intersection (TLI): speculative decoding with a draft whose tokenizer differs from the target's.

* :mod:`specdec.tli.vocab_mapping` — per-token bytes of a tokenizer, the draft <-> target id mapping over
  tokens with identical bytes, its disk cache and the usefulness check.
* :mod:`specdec.tli.draft_context` — keeps the draft's token ids for the committed text up to date by
  re-tokenizing only a short tail, so the draft's KV cache for the stable prefix can be kept.
"""

from specdec.tli.draft_context import DraftContext, encode_exact
from specdec.tli.vocab_mapping import (
    TokenTable,
    VocabMapping,
    analyze_tokenizer,
    check_useful,
    load_or_build_mapping,
    mapping_cache_path,
    special_token_ids,
    token_bytes,
)

__all__ = [
    "DraftContext",
    "TokenTable",
    "VocabMapping",
    "analyze_tokenizer",
    "check_useful",
    "encode_exact",
    "load_or_build_mapping",
    "mapping_cache_path",
    "special_token_ids",
    "token_bytes",
]
