"""Model runner: one model, many sequences, ragged forward passes over one KV block pool (pure torch).

The runner executes: each call's rows go through the network in one pass. Which blocks hold a sequence, and
what to do when the pool is full, is the KV cache manager's (``specdec.engine.kv_manager``); how much of each
prompt a pass feeds is the scheduler's (``specdec.engine.scheduler``). ``specdec.engine.workers`` builds the
draft and target workers on it.
"""

from __future__ import annotations

import inspect
import logging
import time

import torch

from specdec.calls import UNFINISHED, Unfinished
from specdec.engine.attention import PagedPass
from specdec.engine.kv_cache import (DEFAULT_BLOCK_SIZE, DEFAULT_ENABLE_PREFIX_CACHING, DEFAULT_GPU_MEMORY_UTILIZATION,
                                     KVPool, KVStats, SequenceKVCache, kv_budget)
from specdec.engine.kv_manager import CachedSequence, KVCacheManager
from specdec.engine.lean_linear import INVARIANT_TILE_ROWS, SkinnyLinear
from specdec.engine.memory import weight_bytes
from specdec.engine.models import LoadedModel
from specdec.engine.network import DEFAULT_BATCH_INVARIANT, DEFAULT_QUANTIZATION, build_network
from specdec.engine.scheduler import (DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD, DEFAULT_MAX_NUM_BATCHED_TOKENS,
                                      DEFAULT_MAX_NUM_PARTIAL_PREFILLS, PassScheduler)
from specdec.engine.scoring import RowLogits, check_scoring, scoring_pass_bytes
from specdec.errors import InvalidRequestError, SequencePreemptedError

logger = logging.getLogger(__name__)


class ModelRunner:
    """One model, many sequences: ragged forward passes over one KV block pool."""

    def __init__(
        self,
        lm: LoadedModel,
        max_model_len: int,
        role: str,
        max_sequences: int = 256,
        logits_vocab_size: int | None = None,
        min_query_tokens: int | None = None,
        lean_forward: bool | None = None,
        *,
        kv_cache_memory: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        enable_prefix_caching: bool = DEFAULT_ENABLE_PREFIX_CACHING,
        gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        long_prefill_token_threshold: int = DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD,
        max_num_partial_prefills: int = DEFAULT_MAX_NUM_PARTIAL_PREFILLS,
        batch_invariant: bool | None = DEFAULT_BATCH_INVARIANT,
        quantization: str | None = DEFAULT_QUANTIZATION,
        release_unread_weights: bool = False,
    ):
        self.lm = lm
        self.max_model_len = max_model_len
        self.role = role
        cfg = lm.model.config.get_text_config()
        self.num_layers = cfg.num_hidden_layers
        # Logits are cut or padded to this size (the target's vocabulary) so ids line up.
        self.logits_vocab_size = logits_vocab_size or lm.vocab_size
        # transformers 5.x renamed `past_key_values` to `cache`
        params = inspect.signature(lm.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        # the network that runs the passes, and how (specdec.engine.network)
        network = build_network(lm, role, lean_forward, batch_invariant, quantization, release_unread_weights)
        self.net, self.paged, self.vocab_subset = network.net, network.paged, network.vocab_subset
        self.batch_invariant, self.quantization = network.batch_invariant, network.quantization
        self._mask: torch.Tensor | None = None
        if self.vocab_subset is not None and not self.paged:
            self._mask = torch.ones(lm.vocab_size, dtype=torch.bool, device=lm.device)
            self._mask[self.vocab_subset.to(lm.device)] = False
        # transformers' forward only: a pass over 2 or 3 new tokens is padded to this many (the padding is
        # scored, then dropped). fp32 F.linear with 2-3 rows takes a slow path on CPU (MKL): measured 1.7x
        # (SmolLM2-135M) and 2.6x (Gemma-3-270M) the cost of one token, while 4 rows cost 1.3-1.6x. Models
        # loaded by specdec use SkinnyLinear there instead, and the lean forward picks its products per row
        # count (specdec.engine.lean_linear), which makes 2-3 rows cheap: no padding.
        if min_query_tokens is None:
            slow_rows = not self.paged and lm.device.type == "cpu" and lm.dtype == torch.float32 and not any(
                isinstance(m, SkinnyLinear) for m in lm.model.modules())
            min_query_tokens = 4 if slow_rows else 1
        self.min_query_tokens = min_query_tokens
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.kv = KVPool(self.num_layers, kv_heads, head_dim, lm.dtype, lm.device,
                         kv_budget(lm.device, kv_cache_memory, gpu_memory_utilization), block_size,
                         enable_prefix_caching)
        self.block_size = block_size
        self.cache = KVCacheManager(self.kv, role, max_sequences, lm.device)  # which blocks hold each sequence
        self.lock = self.cache.lock
        # decode first, then prefill chunks under one token budget per pass (specdec.engine.scheduler)
        self.scheduler = PassScheduler(max_num_batched_tokens, long_prefill_token_threshold, max_num_partial_prefills,
                                       block_size, row_multiple=INVARIANT_TILE_ROWS if self.paged and self.batch_invariant else 1,
                                       short_kind="verify" if role == "target" else "decode")
        self._windows = self.net.windows() if self.paged else {}

    # -- sequences (the KV cache manager's) ------------------------------------------------------------
    def get_or_create(self, sequence_id: str, seed: int | None, priority: int = 0) -> CachedSequence:
        seq, idle = self.cache.open(sequence_id, seed, priority)
        # a decoding sequence's next call: its round period (while nothing prefills: a chunk sized from a period
        # that holds chunks would grow without end)
        if idle is not None and not self.cache.prefilling():
            self.scheduler.note_round(idle)
        return seq

    @property
    def sequences(self) -> dict[str, CachedSequence]:
        return self.cache.sequences

    def sync(self, seq: CachedSequence, token_ids: list[int], reuse: bool = True) -> list[int]:
        """The tokens of ``token_ids`` the sequence's blocks lack (``KVCacheManager.sync``)."""
        return self.cache.sync(seq, token_ids, reuse)

    def release(self, sequence_id: str) -> bool:
        return self.cache.release(sequence_id)

    def weight_bytes(self) -> int:
        """Bytes of the model's weights as held (each storage once: the transformers model and the lean forward's
        products, packed copies included; ``specdec.engine.memory``)."""
        return weight_bytes(self.lm.model, self.net)

    def kv_stats(self) -> KVStats:
        return self.cache.stats()

    def check_append(self, seq: CachedSequence, new_token_ids: list[int]) -> None:
        """Raise InvalidRequestError if ``new_token_ids`` cannot follow the sequence's cache."""
        end = seq.length + len(new_token_ids)
        if end > self.max_model_len:
            raise InvalidRequestError(
                f"sequence of {end} tokens exceeds max_model_len={self.max_model_len}", param="max_model_len"
            )
        self.cache.check_capacity(end)
        self._check_ids(new_token_ids)

    def check_scoring(self, num_tokens: int) -> None:
        """Raise InvalidRequestError if scoring ``num_tokens`` positions in one pass could not be held
        (``specdec.engine.scoring``): the lean forward's logits are bounded, the rest is not."""
        sdpa = self.paged and self.lm.device.type == "cpu" and not self.batch_invariant
        need = scoring_pass_bytes(num_tokens, self.logits_vocab_size, self.paged, sdpa,
                                  self.net.heads // self.net.kv_heads if self.paged else 1, len(self._windows))
        check_scoring(self.role, num_tokens, need)

    # -- model work ------------------------------------------------------------------------------
    def forward(self, seq: CachedSequence, new_token_ids: list[int], num_logits: int = 1) -> torch.Tensor:
        """Append ``new_token_ids`` to the sequence; return logits of the last ``num_logits`` positions,
        [num_logits, logits_vocab_size] float32. Raises SequencePreemptedError if the pool has no room."""
        (out,) = self.forward_batch([seq], [new_token_ids], [num_logits])
        if isinstance(out, BaseException):
            raise out
        return out

    @torch.inference_mode()
    def forward_batch(self, seqs: list[CachedSequence], new_token_ids: list[list[int]], num_logits: list[int],
                      chunkable: list[bool] | None = None, lazy: list[bool] | None = None,
                      capture: list[tuple[int, ...]] | None = None, trees: list[list[int] | None] | None = None,
                      ) -> list[torch.Tensor | RowLogits | SequencePreemptedError | Unfinished]:
        """Several sequences in ONE ragged pass; the same results as ``forward`` row by row. A row the pool
        had no room for is a SequencePreemptedError (its sequence is forgotten; resend its history).

        ``chunkable`` rows may be fed in part when the pass would exceed ``max_num_batched_tokens`` (chunked
        prefill): such a row's result is UNFINISHED, and calling again with its history feeds the rest.
        ``lazy`` rows (a prompt scored at every position) come back as ``RowLogits`` on the lean forward:
        their logits are projected a slice at a time when read (``specdec.engine.scoring``).
        ``capture``: per row, the decoder layers whose inputs at the fed positions are appended to the sequence's
        ``captured`` (start position, [tokens, layers x hidden]): an EAGLE-3 head's features (``specdec.features``).
        ``trees``: per row, the parents of its last tokens when they are a token tree's nodes (``specdec.trees``;
        the lean forward only, ``supports_trees``): written in node order, each attending to its path; then
        ``keep_path`` moves the accepted path into place."""
        for seq, new in zip(seqs, new_token_ids):
            self.check_append(seq, new)
        unfinished: set[int] = set()
        feeds = [len(n) for n in new_token_ids]
        if chunkable is not None:
            ids = {s.sequence_id for s in seqs}
            take = self.scheduler.plan(feeds, chunkable, [s.rank for s in seqs], self.cache.decoding(ids) > 0)
            unfinished = {i for i, c in enumerate(chunkable) if c and take[i] < feeds[i]}
            new_token_ids = [n[:take[i]] if i in unfinished else n for i, n in enumerate(new_token_ids)]
            if trees:  # a row fed in part feeds no tree (its call comes again; sync drops what it fed past the history)
                trees = [None if i in unfinished else t for i, t in enumerate(trees)]
            num_logits = [0 if i in unfinished else m for i, m in enumerate(num_logits)]
            for i, s in enumerate(seqs):
                s.prefilling = i in unfinished
            if unfinished:
                sch = self.scheduler
                logger.debug("%s: pass of %d rows feeds %d tokens, %s of prompts (chunk %d; round period %s ms, "
                             "%s ms per token)", self.role, len(seqs), sum(take),
                             [take[i] for i in sorted(unfinished)], sch.prefill_chunk(),
                             None if sch.round_period() is None else round(1e3 * sch.round_period(), 1),
                             None if sch.seconds_per_token is None else round(1e3 * sch.seconds_per_token, 2))
        ok = self.cache.reserve(seqs, [len(n) for n in new_token_ids])
        results: list = [(UNFINISHED if i in unfinished else None) if ok[i] else SequencePreemptedError(
            f"{self.role}: the KV cache is full; sequence {s.sequence_id!r} was preempted: resend its history")
            for i, s in enumerate(seqs)]
        rows = [i for i in range(len(seqs)) if ok[i] and new_token_ids[i]]  # a waiting prompt feeds nothing now
        if not rows:
            return results
        began = time.monotonic()
        layers = tuple(sorted({i for c in capture or [] for i in c}))
        if self.paged:
            out = self._forward_paged([seqs[i] for i in rows], [new_token_ids[i] for i in rows],
                                      [num_logits[i] for i in rows], [bool(lazy and lazy[i]) for i in rows],
                                      [capture[i] if capture else () for i in rows], layers,
                                      [trees[i] for i in rows] if trees else None)
        else:
            if trees and any(trees):
                raise ValueError("token trees need the lean forward (ModelRunner.supports_trees)")
            out = [self._align_vocab(self._forward_copied(seqs[i], new_token_ids[i], num_logits[i],
                                                          capture[i] if capture else ()).float())
                   for i in rows]
        for i, logits in zip(rows, out):
            seqs[i].tokens.extend(new_token_ids[i])
            results[i] = UNFINISHED if i in unfinished else logits
        self.scheduler.note_pass(sum(len(new_token_ids[i]) for i in rows), time.monotonic() - began)
        return results

    def _forward_paged(self, seqs: list[CachedSequence], news: list[list[int]], num_logits: list[int],
                       lazy: list[bool], capture: list[tuple[int, ...]], layers: tuple[int, ...],
                       trees: list[list[int] | None] | None = None) -> list[torch.Tensor | RowLogits]:
        device = self.lm.device
        starts, counts = [s.length for s in seqs], [len(n) for n in news]
        paged = PagedPass(self.kv, [s.blocks for s in seqs], starts, counts, self._windows,
                          kernel="cpu" if self.batch_invariant and device.type == "cpu" else None,
                          group=self.net.heads // self.net.kv_heads, trees=trees)
        ids = torch.tensor([t for new in news for t in new], dtype=torch.long, device=device)  # [tokens]
        positions = paged.positions  # a tree's node sits at its depth's position
        hidden = self.net.hidden_paged(ids, positions, paged, layers) if layers else \
            self.net.hidden_paged(ids, positions, paged)  # [tokens, hidden]
        if layers:  # each asking row's features, its layers' columns in the order it asked
            width = self.net.captured.shape[-1] // len(layers)
            offset = 0
            for seq, start, n, want in zip(seqs, starts, counts, capture):
                if want:
                    rows = self.net.captured[offset:offset + n]
                    seq.captured.append((start, rows if want == layers else torch.cat(
                        [rows[:, layers.index(i) * width:(layers.index(i) + 1) * width] for i in want], dim=-1)))
                offset += n
        keep, offset, ranges = [], 0, []
        for n, m, z in zip(counts, num_logits, lazy):  # each row's last m positions reach the LM head
            ranges.append((offset + n - m, offset + n))
            if not z:
                keep += range(offset + n - m, offset + n)
            offset += n
        sizes = [m for m, z in zip(num_logits, lazy) if not z]
        eager = iter(self._project(hidden[torch.tensor(keep, dtype=torch.long, device=device)]).split(sizes)
                     if sizes else [])
        return [RowLogits(hidden[a:b], self._project, self.logits_vocab_size) if z else next(eager)
                for (a, b), z in zip(ranges, lazy)]

    @property
    def supports_trees(self) -> bool:
        """Whether passes may hold token trees (the lean forward's paged attention; transformers' forward: no)."""
        return self.paged

    def keep_path(self, seqs: list[CachedSequence], roots: list[int], paths: list[list[int]]) -> None:
        """After a tree pass: each sequence's accepted nodes ``paths[i]`` (written at ``roots[i] + node``) move to
        the positions of a chain, ``roots[i] + depth``, in every layer (the caller then truncates the rest)."""
        bs, src, dst = self.block_size, [], []
        for seq, root, path in zip(seqs, roots, paths):
            for depth, node in enumerate(path):
                if node != depth:
                    a, b = root + node, root + depth
                    src.append(seq.blocks[a // bs] * bs + a % bs)
                    dst.append(seq.blocks[b // bs] * bs + b % bs)
                    seq.tokens[b] = seq.tokens[a]
        if not src:
            return
        src_t = torch.tensor(src, dtype=torch.long, device=self.lm.device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=self.lm.device)
        with torch.inference_mode():  # every layer at once; the sources are read whole before any write
            for data in (self.kv.key_data, self.kv.value_data):  # [layers, kv_heads, slots, d]
                data.index_copy_(2, dst_t, data.index_select(2, src_t))

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last hidden states [rows, hidden] -> logits [rows, logits_vocab_size] fp32 (the lean forward's head)."""
        return self._align_vocab(self.net.logits(hidden).float())

    def _forward_copied(self, seq: CachedSequence, new: list[int], num_logits: int,
                        capture: tuple[int, ...] = ()) -> torch.Tensor:
        """transformers' forward for one sequence, over a copy of its history; the new entries go back to its blocks."""
        device, bs = self.lm.device, self.block_size
        start, n = seq.length, len(new)
        cache = SequenceKVCache(self.num_layers, self.max_model_len)
        slots = torch.tensor([seq.blocks[p // bs] * bs + p % bs for p in range(start + n)], device=device)
        if start:
            cache.load([k[:, slots[:start]][None] for k in self.kv.keys], [v[:, slots[:start]][None] for v in self.kv.values])
        pad = self._query_width(n) - n
        if start + n + pad > self.max_model_len:
            pad = 0
        fed = new + new[-1:] * pad  # causal: padding after the real tokens never changes them
        out = self.net(
            input_ids=torch.tensor([fed], dtype=torch.long, device=device),  # [1, n + pad]
            position_ids=torch.arange(start, start + n + pad, device=device)[None],  # [1, n + pad]
            use_cache=True, logits_to_keep=num_logits + pad, output_hidden_states=bool(capture),
            **{self._cache_kwarg: cache})
        if capture:  # hidden_states[i]: the input of decoder layer i
            seq.captured.append((start, torch.cat([out.hidden_states[i][0, :n] for i in capture], dim=-1)))
        for layer, keys, values in zip(cache.layers, self.kv.keys, self.kv.values):
            keys.index_copy_(1, slots[start:], layer.keys[0, :, start:start + n])
            values.index_copy_(1, slots[start:], layer.values[0, :, start:start + n])
        width = out.logits.shape[1]
        return out.logits[0, width - pad - num_logits: width - pad]

    def _query_width(self, width: int) -> int:
        """Tokens to feed so a transformers pass has at least ``min_query_tokens`` rows (one token stays one)."""
        return width if width == 1 or width >= self.min_query_tokens else self.min_query_tokens

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
