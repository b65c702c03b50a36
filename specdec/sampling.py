"""Sampling parameters and the logits processing shared by every path.

The target-only path, the draft's proposals and the target's verification all go through
``process_logits`` with the same parameters, which is what makes speculative sampling lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from specdec.errors import InvalidRequestError
from specdec.proposal import TokenLogprob


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
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}] (top logprobs per token), got {v!r}")

    @property
    def greedy(self) -> bool:
        # Below 1e-5 the scaled logits overflow; such a temperature is greedy in effect (as in vLLM).
        return self.temperature < _MIN_TEMPERATURE

    def clone(self, **changes) -> "SamplingParams":
        return replace(self, **changes)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn raw logits ``[..., vocab]`` into the sampling distribution ``[..., vocab]`` (float32).

    Greedy requests get a one-hot distribution on the argmax, so one code path serves both.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if params.top_k not in (0, -1) and params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (the top-1 always stays)
        before = sorted_probs.cumsum(-1) - sorted_probs
        remove_sorted = before >= params.top_p
        remove = torch.zeros_like(remove_sorted).scatter(-1, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of ``probs`` ``[..., vocab]`` → ``[...]`` (int64)."""
    flat = probs.reshape(-1, probs.shape[-1])
    out = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return out.reshape(probs.shape[:-1])


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """The raw log-probabilities of ``token_ids`` (one per row of ``logits`` [m, vocab]) and each row's
    ``top_n`` most likely tokens: log_softmax of the model's logits, before any processing (vLLM's
    default ``raw_logprobs``)."""
    lp = torch.log_softmax(logits[: len(token_ids)].float(), dim=-1)  # [m, vocab]
    ids = torch.tensor(token_ids, dtype=torch.long, device=lp.device)
    chosen = lp.gather(-1, ids[:, None]).squeeze(-1).tolist()
    if top_n:
        values, idx = lp.topk(min(top_n, lp.shape[-1]), dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(idx.tolist(), values.tolist())]
    else:
        tops = [[] for _ in token_ids]
    return [TokenLogprob(t, c, top) for t, c, top in zip(token_ids, chosen, tops)]


@dataclass
class SpecDecodeStats:
    """Speculation statistics of one request (vLLM's counter names)."""

    num_drafts: int = 0  # rounds that proposed at least one token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_target_passes: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_target_passes += 1
        if num_draft_tokens == 0:
            return
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
        }
