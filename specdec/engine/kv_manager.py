"""The KV cache manager: which blocks of the pool hold each sequence's keys and values (vLLM's KVCacheManager).

Every call carries the sequence's full token history; the manager keeps the common prefix of what a
sequence's blocks hold and that history (``sync``: rollback by pointer, then what the prefix cache holds of
the rest), so a caller never has to know what is cached, and a runner that lost a sequence just recomputes it.

Memory: every sequence's keys and values live in one pool of fixed-size blocks (``specdec.engine.kv_cache``)
sized by a byte budget. Full blocks of confirmed history are shared between sequences and requests that
begin with the same tokens (prefix caching, ``specdec.engine.block_pool``). When a pass needs more blocks
than are free (``reserve``), cached blocks nobody holds are evicted, then the last-ranked other sequences
are preempted (their blocks freed; a caller that comes back resends the history, mostly found again in the
prefix cache), and a row that still does not fit is preempted itself.

The manager decides nothing about a pass's rows (``specdec.engine.scheduler``) and runs no model
(``specdec.engine.runner``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from specdec.drafting_state import DraftingState
from specdec.engine.block_pool import ROOT
from specdec.engine.feature_store import FEATURE_BUDGET_FRACTION, BlockFeatures
from specdec.engine.kv_cache import KVPool, KVStats
from specdec.engine.scheduler import DECODING_WINDOW_S
from specdec.errors import InvalidRequestError, ResourceExhaustedError, SequenceNotFoundError
from specdec.sampling import make_generator
from specdec.seeding import round_seed, stream_key

logger = logging.getLogger(__name__)


@dataclass
class CachedSequence:
    """One sequence as the manager holds it: the tokens its blocks hold, and what the drafters keep beside."""

    sequence_id: str
    generator: torch.Generator
    created: int  # arrival order: among equal priorities, the youngest is preempted first
    tokens: list[int] = field(default_factory=list)  # the tokens whose keys/values the blocks hold
    blocks: list[int] = field(default_factory=list)  # block table: block i holds positions [i * bs, (i + 1) * bs)
    entries: list[int] = field(default_factory=list)  # prefix-cache entry of each leading full block registered
    confirmed: int = 0  # tokens of the last call's history: what a caller has confirmed (may be shared)
    last_used: float = field(default_factory=time.monotonic)
    state: DraftingState = field(default_factory=DraftingState)  # the drafters' and the service's, typed
    stream_key: int | None = None  # seeded: the generator is re-seeded per round (specdec.seeding)
    prefilling: bool = False  # its prompt is being fed in chunks (its last call was UNFINISHED)
    priority: int = 0  # its request's (lower first); with arrival, the order of prefill and of preemption
    # an EAGLE target's features of the positions fed since its call began: (start, [tokens, width]) per pass
    captured: list = field(default_factory=list)

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


class KVCacheManager:
    """The sequences of one model and their blocks in its pool: open, sync, reserve, preempt, release."""

    def __init__(self, pool: KVPool, role: str, max_sequences: int, device: torch.device):
        self.kv = pool
        self.block_size = pool.block_size
        self.role = role
        self.max_sequences = max_sequences
        self.device = device
        self.sequences: dict[str, CachedSequence] = {}
        self._arrivals = 0
        self.lock = threading.RLock()  # the runner's: calls, the batcher's thread and releases take it
        self.features = BlockFeatures(self.block_size, int(FEATURE_BUDGET_FRACTION * pool.nbytes))  # an EAGLE
        # target's features beside the blocks (host memory, a bounded share of the pool's size)

    # -- sequences ---------------------------------------------------------------------------------
    def open(self, sequence_id: str, seed: int | None, priority: int = 0) -> tuple[CachedSequence, float | None]:
        """The sequence (created on its first call) and the seconds since its last call where it was decoding
        then (its prompt fed; None otherwise): the round period the scheduler sizes prefill chunks by."""
        seq = self.sequences.get(sequence_id)
        if seq is None:
            if len(self.sequences) >= self.max_sequences:
                raise ResourceExhaustedError(
                    f"{self.role}: {len(self.sequences)} sequences cached, the cap is {self.max_sequences}; "
                    "release finished sequences or raise max_sequences"
                )
            key = stream_key(seed, self.role)
            self._arrivals += 1
            seq = CachedSequence(sequence_id, make_generator(key, self.device), self._arrivals, stream_key=key)
            self.sequences[sequence_id] = seq
        now = time.monotonic()
        idle = now - seq.last_used if seq.length and not seq.prefilling else None
        seq.last_used = now
        seq.priority = priority
        return seq, idle

    def get(self, sequence_id: str) -> CachedSequence:
        try:
            return self.sequences[sequence_id]
        except KeyError:
            raise SequenceNotFoundError(f"{self.role}: unknown sequence {sequence_id!r}") from None

    def prefilling(self) -> bool:
        """Whether some sequence's prompt is being fed in chunks."""
        return any(s.prefilling for s in self.sequences.values())

    def decoding(self, exclude: set[str] = frozenset(), window_s: float = DECODING_WINDOW_S) -> int:
        """Sequences decoding (called within ``window_s``, their prompts fed) apart from ``exclude``: those whose
        next call a pass that prefills should make way for."""
        now = time.monotonic()
        with self.lock:  # the batcher asks from its own thread while calls add and release sequences
            return sum(1 for sid, s in self.sequences.items() if sid not in exclude and s.length and not s.prefilling
                       and now - s.last_used < window_s)

    def release(self, sequence_id: str) -> bool:
        """Forget the sequence; the full blocks of its confirmed history stay in the prefix cache."""
        seq = self.sequences.pop(sequence_id, None)
        if seq is None:
            return False
        self.register(seq, min(seq.confirmed, seq.length))
        self.kv.blocks.free(seq.blocks)
        seq.blocks, seq.entries, seq.tokens = [], [], []
        return True

    def stats(self) -> KVStats:
        return self.kv.stats()

    @property
    def capacity_tokens(self) -> int:
        return self.kv.capacity_tokens

    # -- the blocks of a sequence ------------------------------------------------------------------
    def sync(self, seq: CachedSequence, token_ids: list[int], reuse: bool = True) -> list[int]:
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
        self.register(seq, seq.length)
        if reuse:
            self._adopt(seq, token_ids)
        seq.confirmed = len(token_ids)
        return token_ids[seq.length:]

    def truncate(self, seq: CachedSequence, n: int) -> None:
        """Keep the first ``n`` cached positions (rollback by pointer: blocks past them are let go)."""
        if n > seq.length:
            raise ValueError(f"cannot truncate a sequence of {seq.length} cached tokens to {n}")
        bs, pool = self.block_size, self.kv.blocks
        if n % bs and -(-n // bs) <= len(seq.blocks) and pool.is_shared(seq.blocks[n // bs]):
            n -= n % bs  # the next pass would write into a shared block: recompute its first tokens instead
        keep = -(-n // bs)
        self.features.cut(seq.blocks, n)
        if len(seq.blocks) > keep:
            pool.free(seq.blocks[keep:])
            del seq.blocks[keep:]
        del seq.entries[n // bs:]
        del seq.tokens[n:]

    def register(self, seq: CachedSequence, upto: int) -> None:
        """Put the full blocks of the first ``upto`` (confirmed) tokens into the prefix cache."""
        if not self.kv.blocks.enable_prefix_caching:
            return
        bs = self.block_size
        parent = seq.entries[-1] if seq.entries else ROOT
        for i in range(len(seq.entries), upto // bs):
            parent = self.kv.blocks.register(parent, tuple(seq.tokens[i * bs:(i + 1) * bs]), seq.blocks[i])
            seq.entries.append(parent)

    def _adopt(self, seq: CachedSequence, token_ids: list[int]) -> None:
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

    def check_capacity(self, end: int) -> None:
        """Raise InvalidRequestError if a sequence of ``end`` tokens could never fit the pool."""
        if end > self.kv.capacity_tokens:
            raise InvalidRequestError(
                f"{self.role}: a sequence of {end} tokens can never fit this service's KV cache of "
                f"{self.kv.capacity_tokens} tokens; raise --kv-cache-memory", param="max_model_len")

    def reserve(self, seqs: list[CachedSequence], counts: list[int]) -> list[bool]:
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
                victim = self._last_ranked(exclude=in_pass) or self._last_ranked(
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
            fresh = pool.allocate(need[i], after=seqs[i].blocks[-1] if seqs[i].blocks else None)
            self.features.forget(fresh)
            seqs[i].blocks += fresh
        return ok

    def _last_ranked(self, exclude: dict | None = None,
                     among: list[CachedSequence] | None = None) -> CachedSequence | None:
        pool = among if among is not None else [s for s in self.sequences.values()
                                                if s.sequence_id not in exclude and s.blocks]
        return max(pool, key=lambda s: s.rank, default=None)  # the last-ranked: lowest priority, then youngest

    def _preempt(self, seq: CachedSequence) -> None:
        logger.info("%s: KV cache full, preempting sequence %r (%d tokens)", self.role, seq.sequence_id, seq.length)
        self.release(seq.sequence_id)
        self.kv.preemptions += 1
