"""Sampling parameters and speculation statistics: plain data, no torch (the gateway, which runs no model,
reads them). The logits processing that applies them is ``specdec.sampling``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from specdec.errors import InvalidRequestError


_MIN_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # the most top logprobs a position may return (vLLM's default max_logprobs, OpenAI's top_logprobs)


@dataclass
class SamplingParams:
    """vLLM-compatible sampling parameters (the subset specdec implements)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # the target's raw log-probabilities: of each generated token and its top N (N = logprobs; 0: the
    # token alone), and of each prompt token (prompt_logprobs = N). None: not computed.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Penalties and biases (OpenAI's and vLLM's semantics; see apply_penalties): presence and frequency
    # over the generated tokens, repetition over prompt + generated, logit_bias added to the logits,
    # min_tokens holding EOS and stop_token_ids back until that many tokens were generated.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    # min_p (after temperature: tokens below min_p x the top token's probability are dropped) and
    # allowed_token_ids (every other token masked, before the penalties), as vLLM processes them.
    min_p: float = 0.0
    allowed_token_ids: list[int] | None = None
    # A grammar the output must follow (specdec.structured.StructuredOutputsParams): the sequence turns it
    # into allowed-token masks per verified position; the services never see it, only the masks.
    structured_outputs: Any = None
    # Where the prompt ends in the token ids a worker is given: the sequence sets it (not users) when
    # penalties or min_tokens must tell generated tokens from the prompt's.
    num_prompt_tokens: int | None = None
    # Whether ``seed`` came from the offline LLM's own generator (a request without a seed: the LLM gives
    # every sequence one, so a run is reproducible), not from the user. Set by the LLM, not users: such a
    # request counts as unseeded (``couples``), as a request without a seed does in the services.
    engine_seed: bool = False
    # Scheduling priority (vLLM's request priority; the gateway sets it under --scheduling-policy priority):
    # lower is first to start, to be prefilled and the last to be preempted. It never changes what is sampled.
    priority: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def bad(param: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {msg}", param=param)

        def number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        for name in ("temperature", "top_p"):
            if not number(getattr(self, name)):
                raise bad(name, f"must be a number, got {getattr(self, name)!r}")
        for name in ("n", "top_k"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise bad(name, f"must be an integer, got {getattr(self, name)!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise bad("temperature", f"must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k < 2**31:
            raise bad("top_k", f"must be an integer >= 1, or 0/-1 to disable, got {self.top_k!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not number(v) or not -2.0 <= v <= 2.0:
                raise bad(name, f"must be a number in [-2, 2], got {v!r}")
        if not number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", f"must be a number in (0, 2] (1: off), got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must map token ids to numbers")
            for t, v in self.logit_bias.items():
                if not isinstance(t, int) or isinstance(t, bool) or t < 0 or not number(v) or not -100 <= v <= 100:
                    raise bad("logit_bias", f"must map token ids (>= 0) to numbers in [-100, 100], got {t!r}: {v!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0 or (
                self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", f"must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if not number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be a number in [0, 1] (0: off), got {self.min_p!r}")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if (not isinstance(ids, list) or not ids
                    or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids)):
                raise bad("allowed_token_ids", f"must be a non-empty list of token ids (integers >= 0), got {ids!r}")
        if self.structured_outputs is not None:
            # the grammar decides which tokens may come (and where the output ends): either of these could
            # leave a position with no token allowed
            for name in ("min_tokens", "allowed_token_ids"):
                if getattr(self, name):
                    raise bad(name, "cannot be combined with structured outputs (the grammar decides which tokens "
                                    "may come and where the output ends); leave it unset")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}] (top logprobs per token), got {v!r}")

    @property
    def needs_history(self) -> bool:
        """Whether processing reads the sequence's tokens (penalties, min_tokens)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or self.min_tokens > 0)

    @property
    def has_penalties(self) -> bool:
        """Whether anything beyond temperature / top-k / top-p processes the logits."""
        return self.needs_history or bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def couples(self) -> bool:
        """A seeded sampled request (the user gave the seed): the requests the coupled rule applies to
        (``specdec.seeding``; the target's ``seeded_sampling`` setting decides whether it does)."""
        return self.seed is not None and not self.engine_seed and not self.greedy

    @property
    def greedy(self) -> bool:
        # Below 1e-5 the scaled logits overflow; such a temperature is greedy in effect (as in vLLM).
        return self.temperature < _MIN_TEMPERATURE

    def clone(self, **changes) -> "SamplingParams":
        return replace(self, **changes)


@dataclass
class SpecDecodeStats:
    """Speculation statistics of one request (vLLM's counter names)."""

    num_drafts: int = 0  # rounds that proposed at least one token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_target_passes: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # overlap: proposals drafted ahead while the target verified (specdec.decoding.Lookahead), counted when
    # the next round decides them, and how many became that round's proposal (the rest were dropped)
    num_lookaheads: int = 0
    num_lookaheads_used: int = 0
    # token trees (specdec.trees): rounds that proposed a tree, their nodes and their accepted paths' tokens (also
    # counted in num_drafts, num_draft_tokens and num_accepted_tokens)
    num_tree_drafts: int = 0
    num_tree_draft_tokens: int = 0
    num_tree_accepted_tokens: int = 0

    def record(self, num_draft_tokens: int, num_accepted_tokens: int, tree: bool = False) -> None:
        self.num_target_passes += 1
        if num_draft_tokens == 0:
            return
        if tree:
            self.num_tree_drafts += 1
            self.num_tree_draft_tokens += num_draft_tokens
            self.num_tree_accepted_tokens += num_accepted_tokens
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for i in range(num_accepted_tokens):
            self.accepted_per_position[i] += 1

    def merge(self, other: "SpecDecodeStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_target_passes += other.num_target_passes
        self.num_lookaheads += other.num_lookaheads
        self.num_lookaheads_used += other.num_lookaheads_used
        self.num_tree_drafts += other.num_tree_drafts
        self.num_tree_draft_tokens += other.num_tree_draft_tokens
        self.num_tree_accepted_tokens += other.num_tree_accepted_tokens
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        a = self.accepted_per_position + [0] * (n - len(self.accepted_per_position))
        b = other.accepted_per_position + [0] * (n - len(other.accepted_per_position))
        self.accepted_per_position = [x + y for x, y in zip(a, b)]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per drafting round: 1 + accepted / drafts (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_target_passes": self.num_target_passes,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "accepted_per_position": list(self.accepted_per_position),
            "num_lookaheads": self.num_lookaheads,
            "num_lookaheads_used": self.num_lookaheads_used,
            "num_tree_drafts": self.num_tree_drafts,
            "num_tree_draft_tokens": self.num_tree_draft_tokens,
            "num_tree_accepted_tokens": self.num_tree_accepted_tokens,
        }
