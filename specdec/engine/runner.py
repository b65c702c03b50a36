"""Model runner: one model, many sequences, ragged forward passes over one KV block pool (pure torch).

Every call carries the sequence's full token history; the runner feeds only what a sequence's blocks
lack (common-prefix sync), so a caller never has to know what is cached, and a runner that lost a
sequence just recomputes it. ``specdec.engine.workers`` builds the draft and target workers on it.

Memory: every sequence's keys and values live in one pool of fixed-size blocks (``specdec.engine.kv_cache``)
sized by a byte budget. Full blocks of confirmed history are shared between sequences and requests that
begin with the same tokens (prefix caching, ``specdec.engine.block_pool``). When a pass needs more blocks
than are free, cached blocks nobody holds are evicted, then the youngest other sequences are preempted
(their blocks freed; a caller that comes back resends the history, mostly found again in the prefix
cache), and a row that still does not fit is preempted itself and answered with ``SequencePreemptedError``.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.engine.attention import PagedPass
from specdec.engine.block_pool import ROOT
from specdec.engine.kv_cache import (DEFAULT_BLOCK_SIZE, DEFAULT_ENABLE_PREFIX_CACHING, DEFAULT_GPU_MEMORY_UTILIZATION,
                                     KVPool, KVStats, SequenceKVCache, kv_budget)
from specdec.engine.lean_decoder import lean_decoder, unsupported_reason
from specdec.engine.lean_linear import INVARIANT_TILE_ROWS, SkinnyLinear
from specdec.engine.memory import release_unread, weight_bytes
from specdec.engine.quant import quantization_unavailable
from specdec.engine.quant_plan import build_plan, save_plan
from specdec.config import AUTO_QUANTIZATION
from specdec.errors import ConfigError, InvalidRequestError, ResourceExhaustedError, SequenceNotFoundError, SequencePreemptedError
from specdec.engine.models import LoadedModel
from specdec.engine.scoring import RowLogits, check_scoring, scoring_pass_bytes
from specdec.engine.scheduler import (DECODING_WINDOW_S, DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD,
                                      DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_PARTIAL_PREFILLS, PassScheduler)
from specdec.sampling import make_generator
from specdec.seeding import round_seed, stream_key

logger = logging.getLogger(__name__)

# Run passes through specdec.engine.lean_decoder where the architecture allows (drafts and targets; see
# ModelRunner). The one default of the services' --lean-forward / --no-lean-forward and LLM(lean_forward=).
DEFAULT_LEAN_FORWARD = True
# Batch-invariant passes (--batch-invariant): a position's logits the same bits in any pass (docs/exactness.md: "Exact by
# construction"). None: on for a target on CPU, where benchmarks/bench_batch_invariant.py measured what they
# cost; off on CUDA until its Triton products are measured there, and off for drafts.
DEFAULT_BATCH_INVARIANT: bool | None = None
# --quantization (vLLM's name; specdec.engine.quant): "auto" (or None) picks by role. A draft's products run int8 (W8A8,
# SmoothQuant-calibrated): its numerics change only how often its tokens are accepted, never the output, and
# benchmarks/bench_quantization.py measured the pair faster with it. A target runs in its --dtype unless told.
DEFAULT_QUANTIZATION = AUTO_QUANTIZATION
DEFAULT_QUANTIZATION_BY_ROLE = {"draft": "int8", "target": "none"}


class Unfinished:
    """A row's result when its prompt is prefilled in chunks: this pass fed a chunk (or nothing); the batcher
    runs the call again in its next batch (``requeue``), where sync feeds what is still missing."""

    requeue = True

    def __repr__(self) -> str:
        return "UNFINISHED"


UNFINISHED = Unfinished()


@dataclass
class _Sequence:
    sequence_id: str
    generator: torch.Generator
    created: int  # arrival order: the youngest is preempted first
    tokens: list[int] = field(default_factory=list)  # the tokens whose keys/values the blocks hold
    blocks: list[int] = field(default_factory=list)  # block table: block i holds positions [i * bs, (i + 1) * bs)
    entries: list[int] = field(default_factory=list)  # prefix-cache entry of each leading full block registered
    confirmed: int = 0  # tokens of the last call's history: what a caller has confirmed (may be shared)
    last_used: float = field(default_factory=time.monotonic)
    vocab_state: dict = field(default_factory=dict)  # a TLI draft's re-tokenized context
    stream_key: int | None = None  # seeded: the generator is re-seeded per round (specdec.seeding)
    prefilling: bool = False  # its prompt is being fed in chunks (its last call was UNFINISHED)
    priority: int = 0  # its request's (lower first); with arrival, the order of prefill and of preemption

    @property
    def rank(self) -> tuple[int, int]:
        """Scheduling order: priority, then arrival (the lowest rank is served first and preempted last)."""
        return self.priority, self.created

    @property
    def length(self) -> int:
        return len(self.tokens)

    def begin_round(self, position: int) -> None:
        """Make this round's random draws a function of (seed, role, position) for seeded sequences:
        a sequence rebuilt from its history then draws what the original would have drawn."""
        if self.stream_key is not None:
            self.generator.manual_seed(round_seed(self.stream_key, position))


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
        self.max_sequences = max_sequences
        cfg = lm.model.config.get_text_config()
        self.num_layers = cfg.num_hidden_layers
        # Logits are cut or padded to this size (the target's vocabulary) so ids line up.
        self.logits_vocab_size = logits_vocab_size or lm.vocab_size
        self.sequences: dict[str, _Sequence] = {}
        self._arrivals = 0
        # transformers 5.x renamed `past_key_values` to `cache`
        params = inspect.signature(lm.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.lock = threading.RLock()
        # The network that runs the passes: a lean decoder (specdec.engine.lean_decoder) where the architecture
        # allows, else the transformers model itself. The lean forward is the default for every role: it runs
        # a ragged pass over the pool in place; transformers' forward runs one sequence at a time over a copy
        # of its history (benchmarks/bench_lean_target.py, benchmarks/bench_kv_pool.py).
        if lean_forward is None:
            lean_forward = DEFAULT_LEAN_FORWARD
        # A draft proposes only from its draft vocabulary, if its folder has one (the lean forward computes
        # just those logits; the transformers forward is masked to the same ids).
        self.vocab_subset = lm.draft_vocab if role == "draft" else None
        self.net: Any = lm.model
        # Batch-invariant passes (see docs/exactness.md): the lean forward with fixed-shape
        # products and, on CPU, the C attention kernel; where either is missing the passes are not invariant.
        requested = batch_invariant is not None
        if not requested:  # the default: a CPU target's (a draft's numerics never change the output)
            batch_invariant = lm.device.type == "cpu" and role == "target"
        why_not = batch_invariance_unavailable(lm, lean_forward) if batch_invariant else None
        if why_not:  # a warning where asked for; by default (a model the lean forward cannot run) a note
            logger.log(logging.WARNING if requested else logging.INFO,
                       "%s %s: batch-invariant passes are unavailable (%s); a position's logits may differ in the "
                       "last bits with the shape of the pass", role, lm.name, why_not)
        self.batch_invariant = batch_invariant and not why_not
        self.quantization = resolve_quantization(quantization, role, lm, lean_forward)
        if lean_forward:
            reason = unsupported_reason(lm.model)
            if reason is None:
                # a target's settings are chosen by the perplexity they keep; a draft's change only its acceptance
                plan, cache_file = (None, None) if self.quantization == "none" else build_plan(
                    lm, self.quantization, self.vocab_subset, evaluate=role == "target" and self.vocab_subset is None)
                self.net = lean_decoder(lm.model, self.vocab_subset, batch_invariant=self.batch_invariant, quant=plan)
                save_plan(plan, cache_file)
                if plan is not None:
                    plan.release()
                if release_unread_weights:  # a service's own model: one copy of each weight (specdec.engine.memory)
                    freed = release_unread(lm.model, self.net)
                    logger.info("%s %s: let go of %.0f MiB of weights the lean forward holds packed", role, lm.name,
                                freed / 2**20)
            else:
                logger.info("%s %s: keeping transformers' forward, the lean forward does not support this model: %s",
                            role, lm.name, reason)
        self.paged = self.net is not lm.model
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
        # decode first, then prefill chunks under one token budget per pass (specdec.engine.scheduler)
        self.scheduler = PassScheduler(max_num_batched_tokens, long_prefill_token_threshold, max_num_partial_prefills,
                                       block_size, row_multiple=INVARIANT_TILE_ROWS if self.paged and self.batch_invariant else 1,
                                       short_kind="verify" if role == "target" else "decode")
        self._windows = self.net.windows() if self.paged else {}

    # -- sequence bookkeeping ------------------------------------------------------------------
    def get_or_create(self, sequence_id: str, seed: int | None, priority: int = 0) -> _Sequence:
        seq = self.sequences.get(sequence_id)
        if seq is None:
            if len(self.sequences) >= self.max_sequences:
                raise ResourceExhaustedError(
                    f"{self.role}: {len(self.sequences)} sequences cached, the cap is {self.max_sequences}; "
                    "release finished sequences or raise max_sequences"
                )
            key = stream_key(seed, self.role)
            self._arrivals += 1
            seq = _Sequence(sequence_id, make_generator(key, self.lm.device), self._arrivals, stream_key=key)
            self.sequences[sequence_id] = seq
        now = time.monotonic()
        # a decoding sequence's next call: its round period (while nothing prefills: a chunk sized from a period
        # that holds chunks would grow without end)
        if seq.length and not seq.prefilling and not any(s.prefilling for s in self.sequences.values()):
            self.scheduler.note_round(now - seq.last_used)
        seq.last_used = now
        seq.priority = priority
        return seq

    def decoding(self, exclude: set[str] = frozenset(), window_s: float = DECODING_WINDOW_S) -> int:
        """Sequences decoding (called within ``window_s``, their prompts fed) apart from ``exclude``: those whose
        next call a pass that prefills should make way for."""
        now = time.monotonic()
        with self.lock:  # the batcher asks from its own thread while calls add and release sequences
            return sum(1 for sid, s in self.sequences.items() if sid not in exclude and s.length and not s.prefilling
                       and now - s.last_used < window_s)

    def get(self, sequence_id: str) -> _Sequence:
        try:
            return self.sequences[sequence_id]
        except KeyError:
            raise SequenceNotFoundError(f"{self.role}: unknown sequence {sequence_id!r}") from None

    def release(self, sequence_id: str) -> bool:
        """Forget the sequence; the full blocks of its confirmed history stay in the prefix cache."""
        seq = self.sequences.pop(sequence_id, None)
        if seq is None:
            return False
        self._register(seq, min(seq.confirmed, seq.length))
        self.kv.blocks.free(seq.blocks)
        seq.blocks, seq.entries, seq.tokens = [], [], []
        return True

    def __contains__(self, sequence_id: str) -> bool:
        return sequence_id in self.sequences

    def weight_bytes(self) -> int:
        """Bytes of the model's weights as held (each storage once: the transformers model and the lean forward's
        products, packed copies included; ``specdec.engine.memory``)."""
        return weight_bytes(self.lm.model, self.net)

    def kv_stats(self) -> KVStats:
        return self.kv.stats()

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv.capacity_tokens

    # -- the blocks of a sequence ----------------------------------------------------------------
    def sync(self, seq: _Sequence, token_ids: list[int], reuse: bool = True) -> list[int]:
        """Roll the sequence back to its common prefix with ``token_ids`` (the caller's confirmed history),
        take what the prefix cache holds of the rest; return the tokens to feed.

        At least one token is always returned, so the caller gets logits for the last position.
        ``reuse=False``: take nothing from the prefix cache (a caller that scores every position).
        """
        if not token_ids:
            raise InvalidRequestError(f"{self.role}: the sequence is empty", param="prompt")
        cached = seq.tokens
        n = min(len(cached), len(token_ids) - 1)
        if cached[:n] != token_ids[:n]:
            n = next(i for i, (a, b) in enumerate(zip(cached, token_ids)) if a != b)
        self.truncate(seq, n)
        self._register(seq, seq.length)
        if reuse:
            self._adopt(seq, token_ids)
        seq.confirmed = len(token_ids)
        return token_ids[seq.length:]

    def truncate(self, seq: _Sequence, n: int) -> None:
        """Keep the first ``n`` cached positions (rollback by pointer: blocks past them are let go)."""
        if n > seq.length:
            raise ValueError(f"cannot truncate a sequence of {seq.length} cached tokens to {n}")
        bs, pool = self.block_size, self.kv.blocks
        if n % bs and -(-n // bs) <= len(seq.blocks) and pool.is_shared(seq.blocks[n // bs]):
            n -= n % bs  # the next pass would write into a shared block: recompute its first tokens instead
        keep = -(-n // bs)
        if len(seq.blocks) > keep:
            pool.free(seq.blocks[keep:])
            del seq.blocks[keep:]
        del seq.entries[n // bs:]
        del seq.tokens[n:]

    def _register(self, seq: _Sequence, upto: int) -> None:
        """Put the full blocks of the first ``upto`` (confirmed) tokens into the prefix cache."""
        if not self.kv.blocks.enable_prefix_caching:
            return
        bs = self.block_size
        parent = seq.entries[-1] if seq.entries else ROOT
        for i in range(len(seq.entries), upto // bs):
            parent = self.kv.blocks.register(parent, tuple(seq.tokens[i * bs:(i + 1) * bs]), seq.blocks[i])
            seq.entries.append(parent)

    def _adopt(self, seq: _Sequence, token_ids: list[int]) -> None:
        """Extend the sequence with cached blocks that continue its chain (a shared system prompt, a
        recomputed preempted sequence); the last token is always left to feed."""
        pool, bs = self.kv.blocks, self.block_size
        have, want = len(seq.blocks), (len(token_ids) - 1) // bs
        if not pool.enable_prefix_caching or want <= have or seq.length != have * bs or len(seq.entries) != have:
            return
        found = pool.lookup(seq.entries[-1] if seq.entries else ROOT,
                            [tuple(token_ids[i * bs:(i + 1) * bs]) for i in range(have, want)])
        for block, entry in found:
            seq.blocks.append(block)
            seq.entries.append(entry)
        seq.tokens.extend(token_ids[have * bs: len(seq.blocks) * bs])

    def check_append(self, seq: _Sequence, new_token_ids: list[int]) -> None:
        """Raise InvalidRequestError if ``new_token_ids`` cannot follow the sequence's cache."""
        end = seq.length + len(new_token_ids)
        if end > self.max_model_len:
            raise InvalidRequestError(
                f"sequence of {end} tokens exceeds max_model_len={self.max_model_len}", param="max_model_len"
            )
        if end > self.kv.capacity_tokens:
            raise InvalidRequestError(
                f"{self.role}: a sequence of {end} tokens can never fit this service's KV cache of "
                f"{self.kv.capacity_tokens} tokens; raise --kv-cache-memory", param="max_model_len")
        self._check_ids(new_token_ids)

    def check_scoring(self, num_tokens: int) -> None:
        """Raise InvalidRequestError if scoring ``num_tokens`` positions in one pass could not be held
        (``specdec.engine.scoring``): the lean forward's logits are bounded, the rest is not."""
        sdpa = self.paged and self.lm.device.type == "cpu" and not self.batch_invariant
        need = scoring_pass_bytes(num_tokens, self.logits_vocab_size, self.paged, sdpa,
                                  self.net.heads // self.net.kv_heads if self.paged else 1, len(self._windows))
        check_scoring(self.role, num_tokens, need)

    def _reserve(self, seqs: list[_Sequence], counts: list[int]) -> list[bool]:
        """Blocks for every row's new tokens, first by rank (priority, then the oldest). Short of blocks, the
        last-ranked sequences outside the pass are preempted (the lowest priority, the youngest), then the
        last-ranked rows of the pass; False: that row was preempted."""
        bs, pool = self.block_size, self.kv.blocks
        need = [max(0, -(-(s.length + n) // bs) - len(s.blocks)) for s, n in zip(seqs, counts)]
        ok = [True] * len(seqs)
        in_pass = {s.sequence_id: i for i, s in enumerate(seqs)}
        for i in sorted(range(len(seqs)), key=lambda i: seqs[i].rank):
            if not ok[i]:
                continue
            while pool.num_free < need[i]:
                victim = self._youngest(exclude=in_pass) or self._youngest(
                    among=[seqs[j] for j in in_pass.values() if ok[j] and seqs[j].rank > seqs[i].rank])
                if victim is None:
                    break
                self._preempt(victim)
                if victim.sequence_id in in_pass:
                    ok[in_pass[victim.sequence_id]] = False
            if pool.num_free < need[i]:
                ok[i] = False
                self._preempt(seqs[i])
                continue
            seqs[i].blocks += pool.allocate(need[i], after=seqs[i].blocks[-1] if seqs[i].blocks else None)
        return ok

    def _youngest(self, exclude: dict | None = None, among: list[_Sequence] | None = None) -> _Sequence | None:
        pool = among if among is not None else [s for s in self.sequences.values()
                                                if s.sequence_id not in exclude and s.blocks]
        return max(pool, key=lambda s: s.rank, default=None)  # the last-ranked: lowest priority, then youngest

    def _preempt(self, seq: _Sequence) -> None:
        logger.info("%s: KV cache full, preempting sequence %r (%d tokens)", self.role, seq.sequence_id, seq.length)
        self.release(seq.sequence_id)
        self.kv.preemptions += 1

    # -- model work ------------------------------------------------------------------------------
    def forward(self, seq: _Sequence, new_token_ids: list[int], num_logits: int = 1) -> torch.Tensor:
        """Append ``new_token_ids`` to the sequence; return logits of the last ``num_logits`` positions,
        [num_logits, logits_vocab_size] float32. Raises SequencePreemptedError if the pool has no room."""
        (out,) = self.forward_batch([seq], [new_token_ids], [num_logits])
        if isinstance(out, BaseException):
            raise out
        return out

    @torch.inference_mode()
    def forward_batch(self, seqs: list[_Sequence], new_token_ids: list[list[int]], num_logits: list[int],
                      chunkable: list[bool] | None = None, lazy: list[bool] | None = None,
                      ) -> list[torch.Tensor | RowLogits | SequencePreemptedError | Unfinished]:
        """Several sequences in ONE ragged pass; the same results as ``forward`` row by row. A row the pool
        had no room for is a SequencePreemptedError (its sequence is forgotten; resend its history).

        ``chunkable`` rows may be fed in part when the pass would exceed ``max_num_batched_tokens`` (chunked
        prefill): such a row's result is UNFINISHED, and calling again with its history feeds the rest.
        ``lazy`` rows (a prompt scored at every position) come back as ``RowLogits`` on the lean forward:
        their logits are projected a slice at a time when read (``specdec.engine.scoring``)."""
        for seq, new in zip(seqs, new_token_ids):
            self.check_append(seq, new)
        unfinished: set[int] = set()
        feeds = [len(n) for n in new_token_ids]
        if chunkable is not None:
            ids = {s.sequence_id for s in seqs}
            take = self.scheduler.plan(feeds, chunkable, [s.rank for s in seqs], self.decoding(ids) > 0)
            unfinished = {i for i, c in enumerate(chunkable) if c and take[i] < feeds[i]}
            new_token_ids = [n[:take[i]] if i in unfinished else n for i, n in enumerate(new_token_ids)]
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
        ok = self._reserve(seqs, [len(n) for n in new_token_ids])
        results: list = [(UNFINISHED if i in unfinished else None) if ok[i] else SequencePreemptedError(
            f"{self.role}: the KV cache is full; sequence {s.sequence_id!r} was preempted: resend its history")
            for i, s in enumerate(seqs)]
        rows = [i for i in range(len(seqs)) if ok[i] and new_token_ids[i]]  # a waiting prompt feeds nothing now
        if not rows:
            return results
        began = time.monotonic()
        if self.paged:
            out = self._forward_paged([seqs[i] for i in rows], [new_token_ids[i] for i in rows],
                                      [num_logits[i] for i in rows], [bool(lazy and lazy[i]) for i in rows])
        else:
            out = [self._align_vocab(self._forward_copied(seqs[i], new_token_ids[i], num_logits[i]).float())
                   for i in rows]
        for i, logits in zip(rows, out):
            seqs[i].tokens.extend(new_token_ids[i])
            results[i] = UNFINISHED if i in unfinished else logits
        self.scheduler.note_pass(sum(len(new_token_ids[i]) for i in rows), time.monotonic() - began)
        return results

    def _forward_paged(self, seqs: list[_Sequence], news: list[list[int]], num_logits: list[int],
                       lazy: list[bool]) -> list[torch.Tensor | RowLogits]:
        device = self.lm.device
        starts, counts = [s.length for s in seqs], [len(n) for n in news]
        paged = PagedPass(self.kv, [s.blocks for s in seqs], starts, counts, self._windows,
                          kernel="cpu" if self.batch_invariant and device.type == "cpu" else None,
                          group=self.net.heads // self.net.kv_heads)
        ids = torch.tensor([t for new in news for t in new], dtype=torch.long, device=device)  # [tokens]
        positions = torch.tensor([p for s, n in zip(starts, counts) for p in range(s, s + n)], device=device)
        hidden = self.net.hidden_paged(ids, positions, paged)  # [tokens, hidden]
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

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last hidden states [rows, hidden] -> logits [rows, logits_vocab_size] fp32 (the lean forward's head)."""
        return self._align_vocab(self.net.logits(hidden).float())

    def _forward_copied(self, seq: _Sequence, new: list[int], num_logits: int) -> torch.Tensor:
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
            use_cache=True, logits_to_keep=num_logits + pad, **{self._cache_kwarg: cache})
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


def resolve_quantization(requested: str | None, role: str, lm: LoadedModel, lean_forward: bool | None) -> str:
    """The quantization a runner uses: ``requested``, else its role's default (int8 for a draft: its numerics
    change only the acceptance, never the output; none for a target). A requested mode that cannot run here
    raises ConfigError saying why; a default that cannot falls back to none (logged)."""
    if requested == AUTO_QUANTIZATION:
        requested = None
    quantization = requested if requested is not None else DEFAULT_QUANTIZATION_BY_ROLE[role]
    why = quantization_unavailable(quantization, lm.device)
    if why is None and quantization != "none":
        if lean_forward is False:
            why = "the lean forward is off (--no-lean-forward); quantized products run in the lean forward only"
        elif unsupported_reason(lm.model):
            why = f"the lean forward does not support this model: {unsupported_reason(lm.model)}"
    if why is None:
        return quantization
    if requested is not None:
        raise ConfigError(f"{role} {lm.name}: --quantization {quantization} is unavailable: {why}")
    logger.info("%s %s: %s products unavailable (%s); running unquantized", role, lm.name, quantization, why)
    return "none"


def batch_invariance_unavailable(lm: LoadedModel, lean_forward: bool | None) -> str | None:
    """Why this model's passes cannot be batch-invariant here (None: they can)."""
    if lean_forward is False:
        return "the lean forward is off"
    reason = unsupported_reason(lm.model)
    if reason:
        return f"the lean forward does not support this model: {reason}"
    if lm.device.type == "cpu":
        from kernels.cpu_attention import available

        ok, why = available()
        return None if ok else why
    if lm.device.type != "cuda":
        return f"no batch-invariant kernels for {lm.device.type}"
    return None


def set_num_threads(n: int) -> None:
    """torch's intra-op threads of the calling thread's pool (serving code calls this, never torch)."""
    torch.set_num_threads(n)
