"""Engine: the draft worker (proposes) and the target worker (verifies), pure torch.

Workers own per-sequence KV caches keyed by a sequence id. Every call carries the sequence's full
token history; a worker feeds only what its cache lacks (common-prefix sync), so a caller never has
to know what a worker has cached, and a worker that lost a sequence just recomputes it.
The gRPC services wrap exactly these classes.
"""

from __future__ import annotations

import hashlib
import inspect
import threading
import time
from dataclasses import dataclass, field

import torch

from specdec.errors import InvalidRequestError, ResourceExhaustedError, SequenceNotFoundError
from specdec.kv_cache import SequenceKVCache
from specdec.models import LoadedModel
from specdec.rejection import greedy_accept, rejection_sample
from specdec.sampling import SamplingParams, make_generator, process_logits, sample

MAX_NUM_SPECULATIVE_TOKENS = 16


@dataclass
class Proposal:
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None = None  # [k, vocab] q; None: one-hot (greedy drafting)


@dataclass
class VerifyResult:
    num_accepted_tokens: int
    next_token_id: int  # bonus token when all drafts were accepted, else the recovered token

    def emitted(self, draft_token_ids: list[int]) -> list[int]:
        return draft_token_ids[: self.num_accepted_tokens] + [self.next_token_id]


@dataclass
class _Sequence:
    cache: SequenceKVCache
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)  # the tokens whose KV is in `cache`
    last_used: float = field(default_factory=time.monotonic)


def _derive_seed(seed: int | None, role: str) -> int | None:
    if seed is None:
        return None
    return int.from_bytes(hashlib.sha256(f"{seed}:{role}".encode()).digest()[:8], "little") & (2**63 - 1)


class ModelRunner:
    """One model, many sequences: forward passes over per-sequence KV caches."""

    def __init__(
        self,
        lm: LoadedModel,
        max_model_len: int,
        role: str,
        max_sequences: int = 256,
        logits_vocab_size: int | None = None,
    ):
        self.lm = lm
        self.max_model_len = max_model_len
        self.role = role
        self.max_sequences = max_sequences
        self.num_layers = lm.model.config.get_text_config().num_hidden_layers
        # Logits are cut or padded to this size (the target's vocabulary) so ids line up.
        self.logits_vocab_size = logits_vocab_size or lm.vocab_size
        self.sequences: dict[str, _Sequence] = {}
        # transformers 5.x renamed `past_key_values` to `cache`
        params = inspect.signature(lm.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.lock = threading.RLock()

    # -- sequence bookkeeping ------------------------------------------------------------------
    def get_or_create(self, sequence_id: str, seed: int | None) -> _Sequence:
        seq = self.sequences.get(sequence_id)
        if seq is None:
            if len(self.sequences) >= self.max_sequences:
                raise ResourceExhaustedError(
                    f"{self.role}: {len(self.sequences)} sequences cached, the cap is {self.max_sequences}; "
                    "release finished sequences or raise max_sequences"
                )
            seq = _Sequence(
                cache=SequenceKVCache(self.num_layers, self.max_model_len),
                generator=make_generator(_derive_seed(seed, self.role), self.lm.device),
            )
            self.sequences[sequence_id] = seq
        seq.last_used = time.monotonic()
        return seq

    def get(self, sequence_id: str) -> _Sequence:
        try:
            return self.sequences[sequence_id]
        except KeyError:
            raise SequenceNotFoundError(f"{self.role}: unknown sequence {sequence_id!r}") from None

    def release(self, sequence_id: str) -> bool:
        return self.sequences.pop(sequence_id, None) is not None

    def __contains__(self, sequence_id: str) -> bool:
        return sequence_id in self.sequences

    # -- model work ------------------------------------------------------------------------------
    def sync(self, seq: _Sequence, token_ids: list[int]) -> list[int]:
        """Roll the cache back to its common prefix with ``token_ids``; return the tokens to feed.

        At least one token is always returned, so the caller gets logits for the last position.
        """
        cached = seq.tokens
        n = min(len(cached), len(token_ids) - 1)
        if cached[:n] != token_ids[:n]:
            n = next(i for i, (a, b) in enumerate(zip(cached, token_ids)) if a != b)
        if n < len(cached):
            seq.cache.truncate(n)
            del cached[n:]
        return token_ids[n:]

    @torch.inference_mode()
    def forward(self, seq: _Sequence, new_token_ids: list[int], num_logits: int = 1) -> torch.Tensor:
        """Append ``new_token_ids`` to the sequence; return logits of the last ``num_logits`` positions.

        Returns [num_logits, logits_vocab_size] float32 logits.
        """
        start = seq.cache.length
        end = start + len(new_token_ids)
        if end > self.max_model_len:
            raise InvalidRequestError(
                f"sequence of {end} tokens exceeds max_model_len={self.max_model_len}", param="max_model_len"
            )
        device = self.lm.device
        input_ids = torch.tensor([new_token_ids], dtype=torch.long, device=device)  # [1, n]
        positions = torch.arange(start, end, device=device).unsqueeze(0)  # [1, n]
        out = self.lm.model(
            input_ids=input_ids,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=num_logits,
            **{self._cache_kwarg: seq.cache},
        )
        seq.tokens.extend(new_token_ids)
        logits = out.logits[0, -num_logits:].float()  # [num_logits, model_vocab]
        return self._align_vocab(logits)

    def _align_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        v, target_v = logits.shape[-1], self.logits_vocab_size
        if v == target_v:
            return logits
        if v > target_v:
            return logits[..., :target_v]
        pad = logits.new_full((*logits.shape[:-1], target_v - v), float("-inf"))
        return torch.cat([logits, pad], dim=-1)


class DraftWorker:
    """Proposes k tokens per call by k autoregressive steps of the draft model."""

    def __init__(self, runner: ModelRunner, draft_sample_method: str = "greedy"):
        if draft_sample_method not in ("greedy", "probabilistic"):
            raise InvalidRequestError(
                f"draft_sample_method must be 'greedy' or 'probabilistic', got {draft_sample_method!r}",
                param="draft_sample_method",
            )
        self.runner = runner
        self.draft_sample_method = draft_sample_method

    def propose(
        self, sequence_id: str, token_ids: list[int], num_speculative_tokens: int, params: SamplingParams
    ) -> Proposal:
        k = num_speculative_tokens
        runner = self.runner
        with runner.lock:
            seq = runner.get_or_create(sequence_id, params.seed)
            probabilistic = self.draft_sample_method == "probabilistic" and not params.greedy
            logits = runner.forward(seq, runner.sync(seq, token_ids))[-1]  # [vocab]
            draft_token_ids: list[int] = []
            draft_probs: list[torch.Tensor] = []
            for i in range(k):
                if probabilistic:
                    q = process_logits(logits, params)  # [vocab]
                    token = int(sample(q, seq.generator))
                    draft_probs.append(q)
                else:
                    token = int(logits.argmax())
                draft_token_ids.append(token)
                if i + 1 < k:
                    logits = runner.forward(seq, [token])[-1]
        return Proposal(draft_token_ids, torch.stack(draft_probs) if draft_probs else None)

    def release(self, sequence_id: str) -> None:
        with self.runner.lock:
            self.runner.release(sequence_id)


class TargetWorker:
    """Scores the drafts and the bonus position in ONE forward pass, accepts, rolls back."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def verify(
        self, sequence_id: str, token_ids: list[int], proposal: Proposal, params: SamplingParams
    ) -> VerifyResult:
        draft = proposal.draft_token_ids
        k = len(draft)
        runner = self.runner
        with runner.lock:
            seq = runner.get_or_create(sequence_id, params.seed)
            logits = runner.forward(seq, runner.sync(seq, token_ids) + draft, num_logits=k + 1)  # [k+1, vocab]
            draft_t = torch.tensor(draft, dtype=torch.long)
            if params.greedy:
                n, next_token = greedy_accept(draft_t, logits.argmax(-1))
            else:
                target_probs = process_logits(logits, params)  # [k+1, vocab]
                n, next_token = rejection_sample(draft_t, proposal.draft_probs, target_probs, seq.generator)
            # The accepted drafts' keys/values stay; the rejected tail is dropped by moving the pointer.
            keep = len(token_ids) + n
            seq.cache.truncate(keep)
            del seq.tokens[keep:]
        return VerifyResult(n, next_token)

    def release(self, sequence_id: str) -> None:
        with self.runner.lock:
            self.runner.release(sequence_id)


def check_num_speculative_tokens(k: int) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
        raise InvalidRequestError(
            f"num_speculative_tokens must be an integer in [1, {MAX_NUM_SPECULATIVE_TOKENS}], got {k!r}",
            param="num_speculative_tokens",
        )
