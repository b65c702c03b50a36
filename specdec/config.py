"""``speculative_config``: parsing and validation shared by the offline API, the CLI and the services."""

from __future__ import annotations

import json
import logging
import re
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from specdec.proposal import MAX_NUM_SPECULATIVE_TOKENS, check_num_speculative_tokens
from specdec.errors import ConfigError

logger = logging.getLogger(__name__)

# n-gram lookup (vLLM's prompt_lookup_max / prompt_lookup_min; specdec.ngram)
DEFAULT_PROMPT_LOOKUP_MAX = 4
DEFAULT_PROMPT_LOOKUP_MIN = 2


def check_lookup(prompt_lookup_min: int, prompt_lookup_max: int) -> None:
    for name, value in (("prompt_lookup_min", prompt_lookup_min), ("prompt_lookup_max", prompt_lookup_max)):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 64:
            raise ConfigError(f"{name} must be an integer in [1, 64], got {value!r}")
    if prompt_lookup_min > prompt_lookup_max:
        raise ConfigError(f"prompt_lookup_min ({prompt_lookup_min}) must not exceed prompt_lookup_max "
                          f"({prompt_lookup_max})")


# token trees (specdec.trees): speculative_token_tree "dynamic" lets each drafter grow its own trees
DYNAMIC = "dynamic"
# How a model drafter grows its trees (specdec.engine.tree_drafting): SGLang's keys speculative_eagle_topk (children
# per expanded node) and speculative_num_draft_tokens (nodes proposed). 15 nodes and the root: 16 rows, one
# invariant 16-row tile of a CPU target's verify pass.
DEFAULT_TOP_K = 4
DEFAULT_MAX_NODES = 15


@dataclass(frozen=True)
class TreeShape:
    """How a model drafter grows its trees: ``top_k`` children per expanded node, ``max_nodes`` proposed; or a
    static shape (vLLM's ``speculative_token_tree``): each node a path of child ranks from the root, ``(0,)`` the
    draft's likeliest first token, ``(0, 1)`` the second likeliest after it."""

    top_k: int = DEFAULT_TOP_K
    max_nodes: int = DEFAULT_MAX_NODES
    static: tuple[tuple[int, ...], ...] | None = None


def parse_token_tree(value: str) -> tuple[tuple[int, ...], ...]:
    """vLLM's static ``speculative_token_tree`` (a list of tuples of child ranks, e.g. ``"[(0,), (1,), (0, 0)]"``),
    checked: every node's parent path is listed, no node twice, at most MAX_NUM_SPECULATIVE_TOKENS nodes, ranks in
    [0, 16). Returned in breadth-first order (shorter paths first, then by ranks)."""
    import ast

    def bad(why: str) -> ConfigError:
        return ConfigError(f"speculative_token_tree {value!r} is not a tree shape: {why} (vLLM's syntax: a list of "
                           "tuples of child ranks, e.g. \"[(0,), (1,), (0, 0)]\", or \"dynamic\")")

    try:
        nodes = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise bad("it does not parse") from None
    if not isinstance(nodes, (list, tuple)) or not nodes:
        raise bad("it must be a non-empty list")
    paths = []
    for node in nodes:
        if not isinstance(node, tuple) or not node or not all(
                isinstance(r, int) and not isinstance(r, bool) and 0 <= r < 16 for r in node):
            raise bad(f"{node!r} is not a tuple of ranks in [0, 16)")
        paths.append(node)
    if len(set(paths)) != len(paths):
        raise bad("a node is listed twice")
    if len(paths) > MAX_NUM_SPECULATIVE_TOKENS:
        raise bad(f"{len(paths)} nodes; at most {MAX_NUM_SPECULATIVE_TOKENS}")
    missing = [p for p in paths if len(p) > 1 and p[:-1] not in set(paths)]
    if missing:
        raise bad(f"{missing[0]!r}'s parent {missing[0][:-1]!r} is not listed")
    return tuple(sorted(paths, key=lambda p: (len(p), p)))


# suffix decoding (vLLM's suffix_decoding_* keys; specdec.suffix)
DEFAULT_MAX_TREE_DEPTH = 24
DEFAULT_MAX_CACHED_REQUESTS = 10_000
DEFAULT_MAX_SPEC_FACTOR = 1.0
DEFAULT_MIN_TOKEN_PROB = 0.1


@dataclass(frozen=True)
class SuffixSettings:
    """The ``suffix_decoding_*`` keys (see ``SpeculativeConfig``), checked."""

    max_tree_depth: int = DEFAULT_MAX_TREE_DEPTH
    max_cached_requests: int = DEFAULT_MAX_CACHED_REQUESTS
    max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR
    min_token_prob: float = DEFAULT_MIN_TOKEN_PROB
    token_tree: bool = False  # speculative_token_tree "dynamic": propose every branch held, as a token tree
    min_score: float = 0.0  # a proposal whose score (the tokens it expects accepted) is below this is not made

    def __post_init__(self):
        def whole(name, value, low, high):
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ConfigError(f"suffix_decoding_{name} must be an integer in [{low}, {high}], got {value!r}")

        def real(name, value, low, high):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
                raise ConfigError(f"suffix_decoding_{name} must be a number in [{low}, {high}], got {value!r}")

        whole("max_tree_depth", self.max_tree_depth, 1, 1024)
        whole("max_cached_requests", self.max_cached_requests, 0, 10_000_000)
        real("max_spec_factor", self.max_spec_factor, 0.0, 1024.0)
        real("min_token_prob", self.min_token_prob, 0.0, 1.0)
        real("min_score", self.min_score, 0.0, 1024.0)


SUFFIX_INSTALL_HINT = ("method \"suffix\" needs ArcticInference's suffix tree: pip install nanobind==2.9.2 cmake ninja "
                       "&& pip install --no-build-isolation arctic-inference==0.3.0 (scripts/install.sh does this)")


def suffix_tree_class():
    """ArcticInference's SuffixTree (method "suffix"), or a ConfigError that says what to install."""
    try:
        from arctic_inference.suffix_decoding._C import SuffixTree
    except ImportError as exc:
        raise ConfigError(f"{SUFFIX_INSTALL_HINT} ({exc})") from None
    return SuffixTree


def suffix_available() -> tuple[bool, str]:
    """(True, "") where ArcticInference's suffix tree imports here, else (False, what to install)."""
    try:
        suffix_tree_class()
    except ConfigError as exc:
        return False, str(exc)
    return True, ""


SUPPORTED_METHODS = ("draft_model", "ngram", "suffix", "eagle3")
FEATURE_METHODS = ("eagle3",)  # heads that draft from the target's hidden states (specdec.features)
MODEL_FREE_METHODS = ("ngram", "suffix")  # drafted from token histories: no model needed
# A draft service's --model that names no model (with a model-free method; serve passes the method's name)
NO_MODEL_NAMES = ("none", *MODEL_FREE_METHODS)
SUFFIX_KEYS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob", "suffix_decoding_min_score",
               "suffix_decoding_merge_score", "enable_suffix_decoding")
# speculative_token_tree (vLLM's key): None drafts chains; "dynamic" (specdec.trees.DYNAMIC) lets each drafter grow
# token trees, verified in one pass: suffix decoding its trees' branches (up to num_speculative_tokens nodes), a
# draft model or an EAGLE-3 head top-k candidates (SGLang's speculative_eagle_topk and speculative_num_draft_tokens),
# n-gram lookup its matches' continuations, or a static shape for a draft model (vLLM's syntax: parse_token_tree).
TREE_KEYS = ("speculative_token_tree", "speculative_eagle_topk", "speculative_num_draft_tokens")
DRAFT_KEYS = SUFFIX_KEYS + TREE_KEYS  # what the draft service takes of a speculative_config beside its model
TOKEN_TREES = (DYNAMIC,)
TREE_METHODS = ("suffix", "draft_model", "ngram", "eagle3")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
TLI_PROPOSALS = ("text", "intersection")  # how a TLI draft's greedy drafts become target ids

# The embedded default pair of `specdec serve` with no model named.
DEFAULT_TARGET = "smollm2-135m"
DEFAULT_NUM_SPECULATIVE_TOKENS = 2  # k when a speculative_config names none
# --quantization / speculative_config "quantization" (vLLM's names): the decoder products' formulation
# (specdec.engine.quant). None (the default) picks by role: int8 for a draft, none for a target.
QUANTIZATIONS = ("none", "int8", "fp8")
AUTO_QUANTIZATION = "auto"  # the role's default: int8 for a draft, none for a target
# The suffix/draft-model pair (draft_model_pair_config, the default before the EAGLE-3 head) drafts suffix-hybrid: a
# confident suffix-tree match (the sequence's own history and
# earlier requests' outputs, specdec.suffix) proposes up to DEFAULT_PAIR_NUM_SPECULATIVE_TOKENS tokens, else the
# draft model proposes DEFAULT_PAIR_DRAFT_MODEL_K. Measured (benchmarks/bench_suffix.py, served, greedy, fp32,
# 2 cores avx2): agent traffic 3.02x, input-grounded 2.20x, open prose 1.11x the target alone, against 1.36x /
# 1.34x / 1.04x for the n-gram hybrid it replaced (suffix alone: 3.15x / 2.34x / 1.13x in the same run).
# The model's k: a float32 target pass of 2 tokens costs what one does, the draft agrees ~30% of the time on
# the next token, so k=1 (benchmarks/bench_default_pair.py). The suffix cap: a batch-invariant target's pass
# costs one 16-row tile for up to 16 rows (specdec.engine.lean_linear.INVARIANT_TILE_ROWS), so up to 15
# drafts verify at the price of one token; a 16th starts a second tile. The factor: drafts of up to 4x the
# matched length (vLLM's default is 1): agent traffic 2.68x (factor 1), 2.94x (2), 3.14x (4) at k<=15, and
# 2.87x at k<=31 with factor 2 (bench_suffix.py --only-variants, one run).
DEFAULT_PAIR_NUM_SPECULATIVE_TOKENS = 15
# The embedded default pair puts suffix decoding before the shipped EAGLE-3 head (DEFAULT_EAGLE3_HEAD, "method":
# "eagle3", "enable_suffix_decoding": true): a suffix match that expects at least DEFAULT_PAIR_SUFFIX_MIN_SCORE
# accepted tokens proposes (up to DEFAULT_PAIR_NUM_SPECULATIVE_TOKENS), else the head grows a token tree of depth
# DEFAULT_PAIR_HEAD_DEPTH from the target's own hidden states. Measured (benchmarks/bench_trees.py, served, greedy,
# default dtypes, 2-core AMD EPYC avx512, side by side, two runs): open chat 1.55-1.65x the target alone against
# 1.20-1.27x for the suffix/draft-model pair it replaced (2.04 tokens per pass against 1.46), agent-like traffic 3.01x
# against 3.06-3.07x, 8 streams (no drafting from 3) 0.81-1.01x its tokens/s, every output identical; mixed prompts
# (bench_eagle3.py) 1.77-1.80x against 1.49x.
DEFAULT_PAIR_HEAD_DEPTH = 3
DEFAULT_PAIR_SUFFIX_MIN_SCORE = 1.5
# With token trees, a suffix tree expecting fewer than DEFAULT_PAIR_SUFFIX_MERGE_SCORE accepted tokens is merged with
# the head's tree of the same round (specdec.trees.merge: the likeliest nodes of both, 15 at most). Measured
# (benchmarks/bench_trees.py, served, greedy, default dtypes, 2-core AMD EPYC avx512, two runs): open chat 2.34 tokens
# per pass against 2.04 unmerged (1.87x the target alone against 1.65-1.69x); agent-like traffic 4.22 against 3.96
# tokens per pass, 2.97x against 3.05-3.09x (the head's round costs more than its extra tokens gain where the suffix
# match is long: merging every round, 2.90x; below 6 the confident matches skip the head).
DEFAULT_PAIR_SUFFIX_MERGE_SCORE = 6.0
# The default pair's head expands its 6 likeliest candidates per level, 6 children each (SGLang's
# speculative_eagle_topk; 4 elsewhere), the 15 likeliest of them kept. Measured (the offline LLM, greedy, the 16 open
# chat and 40 agent-like prompts of benchmarks/bench_trees.py, 64 tokens, 2-core AMD EPYC avx512): open chat 2.40
# tokens per pass against 2.34 with 4 (5: 2.37, 8: 2.39), agent-like 4.24 against 4.22; the head's round costs 0.17 ms
# more (3.54 against 3.37 ms, about 0.4% of a round), its wider level passes batched in one product each. Served
# (benchmarks/bench_trees.py, the same machine, side by side): open chat 1.96x the target alone against 1.97x with 4,
# agent-like 3.28x against 3.31x (alike within this machine's noise), every output identical.
DEFAULT_PAIR_HEAD_TOP_K = 6
DEFAULT_PAIR_DRAFT_MODEL_K = 1
DEFAULT_PAIR_SUFFIX_MAX_SPEC_FACTOR = 4.0
# The default pair verifies without drafts while this many sequences generate (vLLM's disable_by_batch_size).
# Measured (benchmarks/bench_concurrency.py, served, greedy, 48 tokens, 2 cores, best of 2): the target
# alone batched gains more from concurrency than speculation does: at 1 stream the pair runs ~1.0x the
# target alone on open-ended prompts (1.14x on mixed ones), at 4 streams 0.83x, at 16 0.75-0.90x; so
# speculation stays on for 1-2 streams and is off from 3.
DEFAULT_PAIR_DISABLE_BY_BATCH_SIZE = 3
# The default pair drafts token trees (specdec.trees): its suffix rounds propose the suffix trees' branches, its
# head's rounds EAGLE-2's dynamic trees (top DEFAULT_PAIR_HEAD_TOP_K children per node, 15 nodes). For the suffix/draft-model pair (its
# model rounds: the draft's top 4 candidates), measured (benchmarks/bench_trees.py, served, greedy, fp32, 2-core Xeon
# with AMX, one run): open chat 1.29x the target alone against 1.17x with chains (1.38 tokens per pass against
# 1.25), agent-like traffic 3.44x against 3.36x, every output identical; 8 streams of suffix trees no slower
# than chains (232 against 230 tokens/s; from 3 streams the pair does not speculate anyway).
DEFAULT_PAIR_TOKEN_TREE = DYNAMIC
# Without ArcticInference (suffix decoding), the suffix/draft-model pair drafts with its model alone: trees of depth
# 3, the model-only setting bench_trees.py measured best (same run: 1.18x on open chat, 1.20x on agent-like traffic).
# The default pair then drafts with its head alone, trees of depth DEFAULT_PAIR_HEAD_DEPTH.
DEFAULT_PAIR_FALLBACK_K = 3
# The OpenAI HTTP port of `specdec serve`, docker-compose and the chart (the gateway alone has none unless
# --http-port is given), and where `specdec bench` looks by default.
DEFAULT_HTTP_PORT = 8000


_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
               "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30,
               "ti": 2**40, "tib": 2**40}
_BYTE_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_byte_size(value: "str | int | float") -> int:
    """A number of bytes from ``2GiB``, ``512MiB``, ``1.5GB``, ``1e9``, ``2Gi`` or a plain integer.

    Units are case-insensitive: k/KB/M/MB/G/GB/T/TB are powers of 1000, Ki/KiB/Mi/MiB/Gi/GiB/Ti/TiB powers
    of 1024 (as Kubernetes' quantities). The result must be a whole, positive number of bytes."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size in bytes, got {value!r}")
    if isinstance(value, (int, float)):
        text = repr(value)
        number, unit = float(value), ""
    else:
        text = str(value)
        match = _BYTE_SIZE.match(text)
        if match is None or match.group(2).lower() not in _BYTE_UNITS:
            raise ValueError(f"expected a size in bytes such as 2GiB, 512MiB, 1e9 or 1073741824, got {text!r}")
        digits, unit = match.group(1), match.group(2).lower()
        number = int(digits) if digits.isdigit() else float(digits)  # whole numbers stay exact
    size = number * _BYTE_UNITS[unit]
    if size != size or size < 1 or size != int(size):  # NaN, zero / negative, fractions of a byte
        raise ValueError(f"expected a whole, positive number of bytes, got {text!r}")
    return int(size)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` keys for draft-model speculation."""

    model: str | None = None  # the draft model (method "draft_model"); none for "ngram"
    method: str = "draft_model"
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    use_heterogeneous_vocab: bool = False
    draft_sample_method: str = "greedy"
    # Greedy drafting with TLI: "text" drafts over the whole draft vocabulary and tokenizes the drafted
    # text for the target (more target tokens reachable); "intersection" drafts intersection tokens only.
    tli_proposals: str = "text"
    max_model_len: int | None = None
    revision: str | None = None
    # N-gram lookup (vLLM's keys): method "ngram" drafts only by lookup; "draft_model" with
    # prompt_lookup_max set is hybrid: a lookup match proposes, else the draft model does.
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # vLLM's key: rounds verify without drafts while this many sequences are generating
    disable_by_batch_size: int | None = None
    # each sequence picks its k per round, up to num_speculative_tokens (specdec.adaptive); false pins k
    adaptive_k: bool = False
    # overlapped drafting: the draft drafts the next round while the target verifies this one, betting
    # that this round is accepted in full (specdec.decoding.Lookahead); false: the rounds run in turn
    overlap: bool = False
    # the draft's --quantization (vLLM's key): auto (a draft's default: int8), none, int8 or fp8 (CUDA)
    quantization: str = AUTO_QUANTIZATION
    # Suffix decoding (vLLM's keys; method "suffix", see specdec.suffix): the trees' depth (the longest
    # context matched plus draft), the finished sequences whose outputs the global tree keeps (0: none),
    # a draft of at most factor x the matched length, a branch stops below this empirical probability.
    # With "model" set, suffix drafting is hybrid: a confident suffix match proposes, else the draft model.
    suffix_decoding_max_tree_depth: int = DEFAULT_MAX_TREE_DEPTH
    suffix_decoding_max_cached_requests: int = DEFAULT_MAX_CACHED_REQUESTS
    suffix_decoding_max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR
    suffix_decoding_min_token_prob: float = DEFAULT_MIN_TOKEN_PROB
    # A suffix proposal whose score (the sum of its drafts' empirical probabilities: the tokens it expects accepted)
    # is below this is not made: in a hybrid the model drafts that round instead (0: every match proposes).
    suffix_decoding_min_score: float = 0.0
    # Token trees in a hybrid (suffix decoding before a draft model or head, speculative_token_tree "dynamic"; no
    # effect otherwise): a suffix tree whose score is below this is merged with the model's tree of the same round
    # (one tree of both drafters' likeliest nodes, up to num_speculative_tokens: specdec.trees.merge); at or above
    # it the suffix tree proposes alone (0: never merged).
    suffix_decoding_merge_score: float = 0.0
    # ArcticInference's key: suffix decoding before a learned drafter (here: method "eagle3"). A confident suffix
    # match proposes, else the EAGLE-3 head, which takes the target's features every round either way.
    # (A draft model's hybrid is spelled "method": "suffix" with "model".)
    enable_suffix_decoding: bool = False
    # Hybrid drafting (a lookup method with "model"): the draft model's drafts per round, where a lookup (long
    # when its match is long) has none; None: num_speculative_tokens. A model draft pays per token drafted.
    draft_model_num_speculative_tokens: int | None = None
    # Token trees (vLLM's key; specdec.trees): None drafts chains; "dynamic" proposes the drafters' trees: suffix
    # decoding every branch its trees hold above min_token_prob (up to num_speculative_tokens nodes); a draft model
    # the top speculative_eagle_topk tokens of each node it expands, num_speculative_tokens levels deep (in a hybrid:
    # draft_model_num_speculative_tokens), speculative_num_draft_tokens nodes kept (SGLang's keys and defaults)
    speculative_token_tree: str | None = None
    speculative_eagle_topk: int = DEFAULT_TOP_K
    speculative_num_draft_tokens: int = DEFAULT_MAX_NODES

    @property
    def model_free(self) -> bool:
        """Drafted from token histories alone (method ngram / suffix without a model): nothing to load."""
        return self.model is None and self.method in MODEL_FREE_METHODS

    def suffix_settings(self) -> SuffixSettings:
        return SuffixSettings(self.suffix_decoding_max_tree_depth, self.suffix_decoding_max_cached_requests,
                              self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob,
                              self.speculative_token_tree == DYNAMIC, self.suffix_decoding_min_score)

    def tree_shape(self) -> TreeShape | None:
        """How the draft model grows its trees (None: it drafts chains)."""
        if self.speculative_token_tree is None or self.model is None or (
                self.use_heterogeneous_vocab and self.tli_proposals != "intersection"):
            return None
        static = None if self.speculative_token_tree == DYNAMIC else parse_token_tree(self.speculative_token_tree)
        return TreeShape(self.speculative_eagle_topk, self.speculative_num_draft_tokens, static)

    @property
    def uses_lookup(self) -> bool:
        """Drafts by lookup in token histories (n-gram or suffix), alone or before the draft model."""
        return self.method in MODEL_FREE_METHODS or self.prompt_lookup_max is not None or self.enable_suffix_decoding

    @property
    def uses_suffix(self) -> bool:
        """Drafts from suffix trees (method suffix, or enable_suffix_decoding before an EAGLE-3 head)."""
        return self.method == "suffix" or self.enable_suffix_decoding

    def lookup_range(self) -> tuple[int, int]:
        """(prompt_lookup_min, prompt_lookup_max) with the defaults filled in."""
        high = self.prompt_lookup_max if self.prompt_lookup_max is not None else DEFAULT_PROMPT_LOOKUP_MAX
        low = self.prompt_lookup_min if self.prompt_lookup_min is not None else min(DEFAULT_PROMPT_LOOKUP_MIN, high)
        return low, high

    @classmethod
    def valid_keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_any(cls, value: "SpeculativeConfig | dict[str, Any] | str | None") -> "SpeculativeConfig | None":
        """Accept a SpeculativeConfig, a dict, or a JSON string (as on the command line)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a dict or JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(cls.valid_keys()))
        if unknown:
            raise ConfigError(
                f"unknown speculative_config key(s) {unknown}; valid keys are {cls.valid_keys()}"
            )
        if value.get("method", "draft_model") not in MODEL_FREE_METHODS and not value.get("model"):
            raise ConfigError("speculative_config needs 'model': the draft model (name, folder, .gguf or hub id), "
                              "or \"method\": \"ngram\" / \"suffix\" for drafting without a model")
        if value.get("method") == "suffix" and "num_speculative_tokens" not in value:
            # vLLM's default for suffix decoding: as long as the tree is deep (within what a round takes)
            from specdec.proposal import MAX_NUM_SPECULATIVE_TOKENS

            depth = value.get("suffix_decoding_max_tree_depth", spec_default("suffix_decoding_max_tree_depth"))
            if isinstance(depth, int) and not isinstance(depth, bool) and depth >= 1:
                value = {**value, "num_speculative_tokens": min(depth, MAX_NUM_SPECULATIVE_TOKENS)}
        cfg = cls(**value)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.method not in SUPPORTED_METHODS:
            raise ConfigError(
                f"speculative_config method {self.method!r} is not supported; specdec implements "
                f"{list(SUPPORTED_METHODS)}"
            )
        check_num_speculative_tokens(self.num_speculative_tokens, ConfigError)
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ConfigError(
                f"draft_sample_method must be one of {list(DRAFT_SAMPLE_METHODS)}, got {self.draft_sample_method!r}"
            )
        if self.tli_proposals not in TLI_PROPOSALS:
            raise ConfigError(f"tli_proposals must be one of {list(TLI_PROPOSALS)}, got {self.tli_proposals!r}")
        if not isinstance(self.use_heterogeneous_vocab, bool):
            raise ConfigError("use_heterogeneous_vocab must be true or false")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ConfigError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.disable_by_batch_size is not None and (not isinstance(self.disable_by_batch_size, int)
                                                       or self.disable_by_batch_size < 1):
            raise ConfigError(f"disable_by_batch_size must be an integer >= 1, got {self.disable_by_batch_size!r}")
        check_quantization(self.quantization)
        k = self.draft_model_num_speculative_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= self.num_speculative_tokens):
            raise ConfigError(f"draft_model_num_speculative_tokens must be an integer in [1, num_speculative_tokens="
                              f"{self.num_speculative_tokens}], got {k!r}")
        if k is not None and (self.model is None or not self.uses_lookup):
            raise ConfigError("draft_model_num_speculative_tokens is the draft model's k in hybrid drafting: it needs "
                              "\"model\" and a lookup method (\"method\": \"suffix\", or prompt_lookup_max)")
        for key in ("adaptive_k", "overlap", "enable_suffix_decoding"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key} must be true or false")
        if self.method in FEATURE_METHODS:
            if self.use_heterogeneous_vocab:
                raise ConfigError(f"method {self.method!r} drafts from the target's own hidden states and embedding: "
                                  "a head cannot draft for another vocabulary (use_heterogeneous_vocab needs "
                                  "\"method\": \"draft_model\")")
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise ConfigError(f"method {self.method!r} does not combine with n-gram lookup (prompt_lookup_max); "
                                  "enable_suffix_decoding puts suffix decoding before the head")
            if self.overlap:
                raise ConfigError(f"method {self.method!r} drafts from the features of the round just verified: it "
                                  "cannot draft during that verification (set overlap false)")
        if self.speculative_token_tree is not None:
            if not isinstance(self.speculative_token_tree, str):
                raise ConfigError(f"speculative_token_tree must be \"dynamic\" or a static shape in vLLM's syntax "
                                  f"(a string), got {self.speculative_token_tree!r}")
            if self.speculative_token_tree not in TOKEN_TREES:
                parse_token_tree(self.speculative_token_tree)
                if self.method != "draft_model" or self.uses_lookup:
                    raise ConfigError("a static speculative_token_tree shapes a draft model's trees (method "
                                      "\"draft_model\" without lookup); suffix trees grow by what the trees hold: "
                                      "use \"dynamic\"")
            if self.method not in TREE_METHODS:
                raise ConfigError(f"speculative_token_tree {self.speculative_token_tree!r} grows trees from suffix "
                                  f"decoding, n-gram lookup, draft models and EAGLE-3 heads; method {self.method!r} "
                                  "drafts chains")
            if self.use_heterogeneous_vocab and self.tli_proposals != "intersection":
                raise ConfigError("speculative_token_tree with use_heterogeneous_vocab needs tli_proposals "
                                  "\"intersection\": a TLI draft's text proposals are retokenized paths, chains only "
                                  "(set tli_proposals \"intersection\", or unset speculative_token_tree)")
        for key, high in (("speculative_eagle_topk", 16), ("speculative_num_draft_tokens", 32)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:
                raise ConfigError(f"{key} must be an integer in [1, {high}], got {value!r}")
        if self.enable_suffix_decoding and self.method not in FEATURE_METHODS:
            raise ConfigError(f"enable_suffix_decoding puts suffix decoding before an EAGLE-3 head (\"method\": "
                              f"\"eagle3\"); with method {self.method!r} use \"method\": \"suffix\" (with \"model\" "
                              "for a draft model behind it)")
        merge = self.suffix_decoding_merge_score
        if not isinstance(merge, (int, float)) or isinstance(merge, bool) or not 0 <= merge <= 1024:
            raise ConfigError(f"suffix_decoding_merge_score must be a number in [0, 1024], got {merge!r}")
        if self.uses_suffix:
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise ConfigError("method \"suffix\" drafts from suffix trees; prompt_lookup_max / prompt_lookup_min "
                                  "are the ngram method's keys (set one method)")
            self.suffix_settings()  # checks the suffix_decoding_* keys
        elif self.uses_lookup:
            check_lookup(*self.lookup_range())
        elif self.prompt_lookup_min is not None:
            raise ConfigError("prompt_lookup_min needs prompt_lookup_max (or \"method\": \"ngram\")")


def check_quantization(value: str | None) -> None:
    """ConfigError unless ``value`` is one of QUANTIZATIONS or "auto" (None too: the role's default)."""
    if value is not None and value not in (AUTO_QUANTIZATION, *QUANTIZATIONS):
        raise ConfigError(f"quantization must be one of {[AUTO_QUANTIZATION, *QUANTIZATIONS]}, got {value!r}")


def spec_default(key: str) -> Any:
    """The default of a ``speculative_config`` key: the parts' settings of the same name take it from here."""
    return SpeculativeConfig.__dataclass_fields__[key].default


def check_vocab_compatible(target_fp: str, draft_fp: str, target_name: str, draft_name: str, cfg: SpeculativeConfig) -> bool:
    """Same tokenizer (False), or a heterogeneous vocabulary explicitly requested (True: use TLI)."""
    if target_fp == draft_fp:
        return False
    if not cfg.use_heterogeneous_vocab:
        raise ConfigError(
            f"draft {draft_name!r} and target {target_name!r} have different vocabularies (tokenizer "
            f"fingerprints {draft_fp} vs {target_fp}); set \"use_heterogeneous_vocab\": true in "
            "speculative_config to draft through Token-Level Intersection"
        )
    return True


DEFAULT_DRAFT = "smollm2-135m-draft"
DEFAULT_EAGLE3_HEAD = "smollm2-135m-eagle3"  # trained by `specdec distill --method eagle3` for smollm2-135m
# Drafts distilled with `specdec distill` and shipped inside the package (normal HF folders; the EAGLE-3 head in the
# published EAGLE-3 layout).
SHIPPED_MODELS: dict[str, Path] = {name: Path(__file__).resolve().parent / "assets" / name
                                   for name in (DEFAULT_DRAFT, DEFAULT_EAGLE3_HEAD)}


def default_draft_path():
    """The embedded default draft (distilled for smollm2-135m) shipped inside the package, if present."""
    path = SHIPPED_MODELS[DEFAULT_DRAFT]
    return path if (path / "config.json").exists() else None


def default_head_path():
    """The embedded EAGLE-3 head (trained for smollm2-135m) shipped inside the package, if present."""
    path = SHIPPED_MODELS[DEFAULT_EAGLE3_HEAD]
    return path if (path / "config.json").exists() else None


def default_speculative_config() -> dict | None:
    """The embedded default pair's speculative_config: suffix decoding before the shipped EAGLE-3 head, token trees
    (``DEFAULT_PAIR_HEAD_DEPTH`` and the constants above). Where ArcticInference's suffix tree is not installed (it
    is built from source with a C++ compiler), the head drafts alone and says so once: the first command still
    serves. Without a shipped head: the draft-model pair (``draft_model_pair_config``); without either, None."""
    if default_head_path() is None:
        return draft_model_pair_config()
    return _shipped_pair("the embedded default pair", "its EAGLE-3 head", DEFAULT_EAGLE3_HEAD,
                         alone={"method": "eagle3", "num_speculative_tokens": DEFAULT_PAIR_HEAD_DEPTH,
                                "speculative_eagle_topk": DEFAULT_PAIR_HEAD_TOP_K},
                         hybrid={"method": "eagle3", "enable_suffix_decoding": True,
                                 "speculative_eagle_topk": DEFAULT_PAIR_HEAD_TOP_K,
                                 "draft_model_num_speculative_tokens": DEFAULT_PAIR_HEAD_DEPTH,
                                 "suffix_decoding_min_score": DEFAULT_PAIR_SUFFIX_MIN_SCORE,
                                 "suffix_decoding_merge_score": DEFAULT_PAIR_SUFFIX_MERGE_SCORE})


def draft_model_pair_config() -> dict | None:
    """The suffix/draft-model pair (the default before the EAGLE-3 head): suffix trees first, else the distilled
    draft model (``DEFAULT_DRAFT``) at k = DEFAULT_PAIR_DRAFT_MODEL_K; without ArcticInference, the model alone at
    depth DEFAULT_PAIR_FALLBACK_K. None while no draft is shipped."""
    if default_draft_path() is None:
        return None
    return _shipped_pair("the suffix/draft-model pair", "its draft model", DEFAULT_DRAFT,
                         alone={"method": "draft_model", "num_speculative_tokens": DEFAULT_PAIR_FALLBACK_K},
                         hybrid={"method": "suffix", "draft_model_num_speculative_tokens": DEFAULT_PAIR_DRAFT_MODEL_K})


def _shipped_pair(name: str, drafter: str, model: str, alone: dict, hybrid: dict) -> dict:
    """A shipped pair's config: ``hybrid`` behind suffix decoding (up to DEFAULT_PAIR_NUM_SPECULATIVE_TOKENS, factor
    DEFAULT_PAIR_SUFFIX_MAX_SPEC_FACTOR) where ArcticInference is installed, else ``alone`` (said once); both with
    the pairs' load limit and token trees."""
    common = {"model": model, "disable_by_batch_size": DEFAULT_PAIR_DISABLE_BY_BATCH_SIZE,
              "speculative_token_tree": DEFAULT_PAIR_TOKEN_TREE}
    ok, why = suffix_available()
    if not ok:
        _warn_once(f"{name} drafts with {drafter} alone (no suffix decoding): {why}")
        return {**alone, **common}
    return {"num_speculative_tokens": DEFAULT_PAIR_NUM_SPECULATIVE_TOKENS,
            "suffix_decoding_max_spec_factor": DEFAULT_PAIR_SUFFIX_MAX_SPEC_FACTOR, **hybrid, **common}


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning("%s", message)


def legacy_speculative_config(speculative_config: Any, speculative_model: str | None,
                              num_speculative_tokens: int | None, flags: bool = False) -> Any:
    """``speculative_config``, or one built from the deprecated ``speculative_model`` /
    ``num_speculative_tokens`` pair (with a DeprecationWarning). ``flags``: name them as command-line
    flags in the messages (``--speculative-model``) rather than keyword arguments."""
    if speculative_model is None and num_speculative_tokens is None:
        return speculative_config
    model, k, new = (("--speculative-model", "--num-speculative-tokens", "--speculative-config") if flags else
                     ("speculative_model=", "num_speculative_tokens=", "speculative_config"))
    example = ("'{\"model\": ..., \"num_speculative_tokens\": ...}'" if flags else
               "={'method': 'draft_model', 'model': ..., 'num_speculative_tokens': ...}")
    warnings.warn(f"{model} and {k} are deprecated; use {new}{' ' if flags else ''}{example}", DeprecationWarning,
                  stacklevel=3)
    logger.warning("%s / %s are deprecated; use %s", model, k, new)
    if speculative_config:
        raise ConfigError(f"give either {new} or the deprecated {model}, not both")
    if speculative_model is None:
        raise ConfigError(f"{k} needs {model} (or use {new})")
    legacy: dict[str, Any] = {"model": speculative_model}
    if num_speculative_tokens is not None:
        legacy["num_speculative_tokens"] = num_speculative_tokens
    return legacy
