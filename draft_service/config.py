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
    method: str = field(default=spec_default("method"), metadata={"help": "draft_model (a model drafts), ngram (the sequence's "
                                                                  "own history drafts; no model is loaded) or suffix (suffix "
                                                                  "trees over the sequence and earlier outputs; hybrid with "
                                                                  "--model's draft, no model with --model none) or eagle3 "
                                                                  "(--model is an EAGLE-3 head drafting from the target's "
                                                                  "features; with --target-model)"})
    target_model: str | None = field(default=None, metadata={"help": "--method eagle3: the target the head drafts for "
                                                                   "(its token embedding and shape are read from it; "
                                                                   "default: --target-tokenizer)"})
    prompt_lookup_max: int | None = field(default=None, metadata={"help": "n-gram lookup: longest n tried (with "
                                                                          "method draft_model: hybrid drafting)"})
    prompt_lookup_min: int | None = field(default=None, metadata={"help": "n-gram lookup: shortest n tried"})
    suffix_decoding_max_tree_depth: int = field(default=spec_default("suffix_decoding_max_tree_depth"), metadata={"help": "suffix decoding: the trees' depth (longest matched context plus draft)"})
    suffix_decoding_max_cached_requests: int = field(default=spec_default("suffix_decoding_max_cached_requests"), metadata={"help": "suffix decoding: finished sequences whose outputs the global tree keeps, oldest evicted first (0: no global tree)"})
    suffix_decoding_max_spec_factor: float = field(default=spec_default("suffix_decoding_max_spec_factor"), metadata={"help": "suffix decoding: a draft is at most this x the matched length"})
    suffix_decoding_min_token_prob: float = field(default=spec_default("suffix_decoding_min_token_prob"), metadata={"help": "suffix decoding: a draft stops where its empirical probability falls below this"})
    suffix_decoding_min_score: float = field(default=spec_default("suffix_decoding_min_score"), metadata={"help": "suffix decoding: a proposal whose score (the tokens it expects accepted) is below this is not made; in a hybrid the model drafts instead (0: every match)"})
    suffix_decoding_merge_score: float = field(default=spec_default("suffix_decoding_merge_score"), metadata={"help": "token trees in a hybrid: a suffix tree whose score is below this is merged with the model's (or head's) tree of the same round, the likeliest nodes of both kept (0: never)"})
    enable_suffix_decoding: bool = field(default=spec_default("enable_suffix_decoding"), metadata={"help": "--method eagle3: suffix decoding before the head (ArcticInference's key): a confident suffix match proposes, else the head"})
    speculative_token_tree: str | None = field(default=spec_default("speculative_token_tree"), metadata={"help": "token trees: dynamic proposes trees verified in one pass (suffix decoding: every branch its trees hold, up to the round's k nodes; the draft model: its top-k candidates), or a draft model's static shape in vLLM's syntax, e.g. [(0,), (1,), (0, 0)] (default: chains)"})
    speculative_eagle_topk: int = field(default=spec_default("speculative_eagle_topk"), metadata={"help": "token trees: the draft model's children per expanded node (SGLang's key)"})
    speculative_num_draft_tokens: int = field(default=spec_default("speculative_num_draft_tokens"), metadata={"help": "token trees: the nodes a draft model's tree proposes (SGLang's key)"})
    draft_model_num_speculative_tokens: int | None = field(default=None, metadata={"help": "hybrid drafting (a lookup method with a model): the model's drafts per round (default: the gateway's k)"})
    draft_top_n: int = field(default=256, metadata={"help": "probabilistic drafting samples from the renormalised top-N (0: full vocabulary); q is sent sparsely"})
