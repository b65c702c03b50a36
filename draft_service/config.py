"""Draft service settings: every field is a flag (--max-batch-size) and an env var (SPECDEC_DRAFT_MAX_BATCH_SIZE)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.config import DEFAULT_DRAFT, TLI_PROPOSALS, spec_default
from specdec.serving.backend_service import BackendServiceConfig

ENV_PREFIX = "SPECDEC_DRAFT"


@dataclass
class DraftServiceConfig(BackendServiceConfig):
    model: str = field(default=DEFAULT_DRAFT, metadata={"help": "draft model: built-in name, HF folder, .gguf or hub "
                                                                "id (default: the embedded default pair's draft)"})
    port: int = field(default=50051, metadata={"help": "gRPC port (0: any free port)"})
    draft_sample_method: str = field(default=spec_default("draft_sample_method"), metadata={"help": "greedy or probabilistic (default when a request leaves it unspecified)"})
    target_tokenizer: str | None = field(default=None, metadata={"help": "the target's model/tokenizer, for a draft with another vocabulary (Token-Level Intersection): proposals are then in target ids"})
    tli_proposals: str = field(default=spec_default("tli_proposals"), metadata={"help": f"with --target-tokenizer, greedy drafting proposes the drafted text tokenized for the target ('text') or intersection tokens only ('intersection'); one of {list(TLI_PROPOSALS)}"})
    method: str = field(default=spec_default("method"), metadata={"help": "draft_model (a model drafts) or ngram (the sequence's "
                                                                  "own history drafts; no model is loaded)"})
    prompt_lookup_max: int | None = field(default=None, metadata={"help": "n-gram lookup: longest n tried (with "
                                                                          "method draft_model: hybrid drafting)"})
    prompt_lookup_min: int | None = field(default=None, metadata={"help": "n-gram lookup: shortest n tried"})
    draft_top_n: int = field(default=256, metadata={"help": "probabilistic drafting samples from the renormalised top-N (0: full vocabulary); q is sent sparsely"})
