"""Model runner: one model, many sequences, forward passes over per-sequence KV caches (pure torch).

Every call carries the sequence's full token history; the runner feeds only what a sequence's cache
lacks (common-prefix sync), so a caller never has to know what is cached, and a runner that lost a
sequence just recomputes it. ``specdec.engine.workers`` builds the draft and target workers on it.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.errors import InvalidRequestError, ResourceExhaustedError, SequenceNotFoundError
from specdec.engine.kv_cache import BatchKVView, SequenceKVCache
from specdec.engine.lean_decoder import lean_decoder, unsupported_reason
from specdec.engine.models import LoadedModel, SkinnyLinear
from specdec.sampling import make_generator
from specdec.seeding import round_seed, stream_key

logger = logging.getLogger(__name__)

# Run passes through specdec.engine.lean_decoder where the architecture allows (drafts and targets; see
# ModelRunner). The one default of the services' --lean-forward / --no-lean-forward and LLM(lean_forward=).
DEFAULT_LEAN_FORWARD = True


@dataclass
class _Sequence:
    cache: SequenceKVCache
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)  # the tokens whose KV is in `cache`
    last_used: float = field(default_factory=time.monotonic)
    vocab_state: dict = field(default_factory=dict)  # a TLI draft's re-tokenized context
    stream_key: int | None = None  # seeded: the generator is re-seeded per round (specdec.seeding)

    def begin_round(self, position: int) -> None:
        """Make this round's random draws a function of (seed, role, position) for seeded sequences:
        a sequence rebuilt from its history then draws what the original would have drawn."""
        if self.stream_key is not None:
            self.generator.manual_seed(round_seed(self.stream_key, position))


class ModelRunner:
    """One model, many sequences: forward passes over per-sequence KV caches."""

    def __init__(
        self,
        lm: LoadedModel,
        max_model_len: int,
        role: str,
        max_sequences: int = 256,
        logits_vocab_size: int | None = None,
        min_query_tokens: int | None = None,
        lean_forward: bool | None = None,
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
        # The network that runs the passes: a lean decoder (specdec.engine.lean_decoder) where the architecture
        # allows, else the transformers model itself. Both take the same call and return ``.logits``. The lean
        # forward is the default for every role: a draft's small steps are mostly Python overhead in
        # transformers' forward, and a target's passes of a few tokens mostly matmuls that the lean forward
        # runs on faster paths (benchmarks/bench_lean_target.py).
        if lean_forward is None:
            lean_forward = DEFAULT_LEAN_FORWARD
        # A draft proposes only from its draft vocabulary, if its folder has one (the lean forward computes
        # just those logits; the transformers forward is masked to the same ids).
        self.vocab_subset = lm.draft_vocab if role == "draft" else None
        self.net: Any = lm.model
        if lean_forward:
            reason = unsupported_reason(lm.model)
            if reason is None:
                self.net = lean_decoder(lm.model, self.vocab_subset)
            else:
                logger.info("%s %s: keeping transformers' forward, the lean forward does not support this model: %s",
                            role, lm.name, reason)
        self._mask: torch.Tensor | None = None
        if self.vocab_subset is not None and self.net is lm.model:
            self._mask = torch.ones(lm.vocab_size, dtype=torch.bool, device=lm.device)
            self._mask[self.vocab_subset.to(lm.device)] = False
        # A pass over 2 or 3 new tokens is padded to this many (the padding is scored, then dropped
        # from the cache). fp32 F.linear with 2-3 rows takes a slow path on CPU (MKL): measured 1.7x
        # (SmolLM2-135M) and 2.6x (Gemma-3-270M) the cost of one token, while 4 rows cost 1.3-1.6x.
        # Models loaded by specdec use SkinnyLinear there instead, and the lean forward picks its products
        # per row count (specdec.engine.lean_linear), which makes 2-3 rows cheap: no padding.
        if min_query_tokens is None:
            slow_rows = self.net is lm.model and lm.device.type == "cpu" and lm.dtype == torch.float32 and not any(
                isinstance(m, SkinnyLinear) for m in lm.model.modules())
            min_query_tokens = 4 if slow_rows else 1
        self.min_query_tokens = min_query_tokens

    # -- sequence bookkeeping ------------------------------------------------------------------
    def get_or_create(self, sequence_id: str, seed: int | None) -> _Sequence:
        seq = self.sequences.get(sequence_id)
        if seq is None:
            if len(self.sequences) >= self.max_sequences:
                raise ResourceExhaustedError(
                    f"{self.role}: {len(self.sequences)} sequences cached, the cap is {self.max_sequences}; "
                    "release finished sequences or raise max_sequences"
                )
            key = stream_key(seed, self.role)
            seq = _Sequence(
                cache=SequenceKVCache(self.num_layers, self.max_model_len),
                generator=make_generator(key, self.lm.device),
                stream_key=key,
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
        if not token_ids:
            raise InvalidRequestError(f"{self.role}: the sequence is empty", param="prompt")
        cached = seq.tokens
        n = min(len(cached), len(token_ids) - 1)
        if cached[:n] != token_ids[:n]:
            n = next(i for i, (a, b) in enumerate(zip(cached, token_ids)) if a != b)
        # A pass that raised half-way can leave the cache longer than the token list: the cache's
        # own length decides, so stale keys/values are never read at the wrong positions.
        if n < len(cached) or seq.cache.length != n:
            n = min(n, seq.cache.length)
            seq.cache.truncate(n)
            del cached[n:]
        return token_ids[n:]

    def check_append(self, seq: _Sequence, new_token_ids: list[int]) -> None:
        """Raise InvalidRequestError if ``new_token_ids`` cannot follow the sequence's cache."""
        end = seq.cache.length + len(new_token_ids)
        if end > self.max_model_len:
            raise InvalidRequestError(
                f"sequence of {end} tokens exceeds max_model_len={self.max_model_len}", param="max_model_len"
            )
        self._check_ids(new_token_ids)

    @torch.inference_mode()
    def forward(self, seq: _Sequence, new_token_ids: list[int], num_logits: int = 1) -> torch.Tensor:
        """Append ``new_token_ids`` to the sequence; return logits of the last ``num_logits`` positions.

        Returns [num_logits, logits_vocab_size] float32 logits.
        """
        self.check_append(seq, new_token_ids)
        start = seq.cache.length
        end = start + len(new_token_ids)
        device = self.lm.device
        n = len(new_token_ids)
        pad = self._query_width(1, n) - n
        if end + pad > self.max_model_len:
            pad = 0
        fed = new_token_ids + new_token_ids[-1:] * pad  # causal: padding after the real tokens never changes them
        input_ids = torch.tensor([fed], dtype=torch.long, device=device)  # [1, n + pad]
        positions = torch.arange(start, end + pad, device=device).unsqueeze(0)  # [1, n + pad]
        out = self.net(
            input_ids=input_ids,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=num_logits + pad,
            **{self._cache_kwarg: seq.cache},
        )
        if pad:
            seq.cache.truncate(end)
        seq.tokens.extend(new_token_ids)
        logits = out.logits[0, out.logits.shape[1] - pad - num_logits : out.logits.shape[1] - pad].float()
        return self._align_vocab(logits)

    @torch.inference_mode()
    def forward_batch(
        self, seqs: list[_Sequence], new_token_ids: list[list[int]], num_logits: list[int]
    ) -> list[torch.Tensor]:
        """Several sequences in ONE forward pass (padded); same results as ``forward`` row by row.

        Sequences with an empty cache (a prompt's first pass) run on their own: a padded batch
        needs every row's cache allocated, and a prefill gains nothing from batching anyway.
        """
        results: list[torch.Tensor | None] = [None] * len(seqs)
        rows = []
        for i, (seq, new) in enumerate(zip(seqs, new_token_ids)):
            if seq.cache.length == 0 or len(seqs) == 1:
                results[i] = self.forward(seq, new, num_logits[i])
            else:
                rows.append(i)
        if len(rows) == 1:
            i = rows[0]
            results[i] = self.forward(seqs[i], new_token_ids[i], num_logits[i])
        elif rows:
            for i, logits in zip(rows, self._forward_padded([seqs[i] for i in rows], [new_token_ids[i] for i in rows],
                                                             [num_logits[i] for i in rows])):
                results[i] = logits
        return results  # type: ignore[return-value]

    def _forward_padded(self, seqs: list[_Sequence], new_token_ids: list[list[int]], num_logits: list[int]) -> list[torch.Tensor]:
        device = self.lm.device
        lengths = [len(n) for n in new_token_ids]
        width = self._query_width(len(seqs), max(lengths))  # the extra columns are never scattered back
        starts = [s.cache.length for s in seqs]
        for seq, new in zip(seqs, new_token_ids):
            self.check_append(seq, new)
        view = BatchKVView([s.cache for s in seqs], width)
        input_ids = torch.zeros((len(seqs), width), dtype=torch.long, device=device)  # [batch, width]
        for row, new in enumerate(new_token_ids):
            input_ids[row, : len(new)] = torch.tensor(new, dtype=torch.long)
        positions = torch.tensor(starts, device=device)[:, None] + torch.arange(width, device=device)  # [batch, width]
        positions = positions.clamp_max_(self.max_model_len - 1)  # padding columns stay in the model's range
        # Only the columns some row needs logits for go through the LM head: [first, width).
        first = min(len(new) - n for new, n in zip(new_token_ids, num_logits))
        out = self.net(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=self._padded_masks(positions, max(starts) + width),
            use_cache=True,
            logits_to_keep=width - first,
            **{self._cache_kwarg: view},
        )
        view.scatter_back([s.cache for s in seqs], lengths)
        results = []
        for row, (seq, new, n_logits) in enumerate(zip(seqs, new_token_ids, num_logits)):
            seq.tokens.extend(new)
            logits = out.logits[row, len(new) - n_logits - first : len(new) - first].float()  # [n_logits, model_vocab]
            results.append(self._align_vocab(logits))
        return results

    def _query_width(self, batch: int, width: int) -> int:
        """Tokens per row to feed so a pass of ``batch`` rows of ``width`` new tokens has at least
        ``min_query_tokens`` rows in its matmuls (single tokens of one sequence stay as they are)."""
        if batch * width == 1 or batch * width >= self.min_query_tokens:
            return width
        return -(-self.min_query_tokens // batch)

    def _padded_masks(self, positions: torch.Tensor, kv_len: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """Additive masks [batch, 1, width, kv_len]: query at position p sees keys at positions <= p
        (and > p - window on sliding-window layers)."""
        cfg = self.lm.model.config.get_text_config()
        dtype = self.lm.model.dtype
        kv = torch.arange(kv_len, device=positions.device)
        q = positions[:, None, :, None]  # [batch, 1, width, 1]

        def additive(allowed: torch.Tensor) -> torch.Tensor:
            return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
                ~allowed, torch.finfo(dtype).min)

        causal = kv <= q
        window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types and window:
            masks = {"full_attention": additive(causal)}
            if "sliding_attention" in layer_types:
                masks["sliding_attention"] = additive(causal & (kv > q - window))
            return masks
        if window and getattr(cfg, "use_sliding_window", True):
            return additive(causal & (kv > q - window))
        return additive(causal)

    def _check_ids(self, token_ids: list[int]) -> None:
        limit = self.lm.model.get_input_embeddings().num_embeddings
        if token_ids and not 0 <= min(token_ids) <= max(token_ids) < limit:
            bad = [t for t in token_ids if not 0 <= t < limit][:5]
            raise InvalidRequestError(f"{self.role}: token ids {bad} are outside this model's vocabulary [0, {limit})",
                                      param="prompt")

    def _align_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        if self._mask is not None:
            logits = logits.masked_fill(self._mask[: logits.shape[-1]], float("-inf"))
        v, target_v = logits.shape[-1], self.logits_vocab_size
        if v == target_v:
            return logits
        if v > target_v:
            return logits[..., :target_v]
        pad = logits.new_full((*logits.shape[:-1], target_v - v), float("-inf"))
        return torch.cat([logits, pad], dim=-1)


def set_num_threads(n: int) -> None:
    """torch's intra-op threads of the calling thread's pool (serving code calls this, never torch)."""
    torch.set_num_threads(n)
