"""The bookkeeping of a KV block pool: free blocks, reference counts, the prefix cache (no tensors here).

A model runner's KV memory is ``num_blocks`` blocks of ``block_size`` token slots (``specdec.engine.kv_cache``
holds the tensors). A sequence holds a block table: the ids of the blocks that hold its positions in order.

* **Allocation** prefers the block right after the sequence's last one; a new run goes in the middle of the
  longest free run, leaving room to grow on both sides: a sequence's blocks mostly stay consecutive, so
  attention reads them as a few long slices (``specdec.engine.attention``), not block by block.
* **Prefix caching** (vLLM's automatic prefix caching): a full block whose tokens a caller confirmed is
  registered under the key ``(parent entry, its tokens)``, where the parent entry is the registration of the
  block before it in the same chain. Keys compare the tokens themselves, so two different prefixes can never
  share an entry (no hash collisions to reason about). A later sequence that begins with the same tokens
  takes those blocks (reference counted) instead of recomputing them.
* **Eviction**: a registered block nobody holds stays cached, least-recently-used first to go when a
  sequence needs room. An unregistered block nobody holds is free at once.
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict
from dataclasses import dataclass

ROOT = 0  # the parent entry of a chain's first block


@dataclass
class _Entry:
    id: int  # unique for the life of the pool: a child's key names it
    key: tuple
    block: int


class BlockPool:
    """``num_blocks`` blocks; each is free, held (reference count > 0), or cached (registered, count 0)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs at least one block of one slot, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.refs = [0] * num_blocks
        # the free blocks (count 0, not registered) as maximal runs of consecutive ids: starts in order,
        # start -> length, last -> start. A new run is placed by the longest free run without visiting every free
        # block, and a pool of 262k blocks keeps 3 small containers, not a set of 262k ids.
        self._num_free_blocks = num_blocks
        self._run_starts = [0]
        self._run_len = {0: num_blocks}
        self._run_of_last = {num_blocks - 1: 0}
        self._cached: OrderedDict[int, None] = OrderedDict()  # count 0, registered: least recently used first
        self._entries: dict[tuple, _Entry] = {}  # key -> entry
        self._entry_of: dict[int, _Entry] = {}  # block -> its entry
        self._ids = itertools.count(1)
        self.queries = self.hits = 0  # tokens looked up / found in the prefix cache (vLLM's counters)

    # -- counts ---------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks a sequence can get now: free ones and cached ones nobody holds."""
        return self._num_free_blocks + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    # -- allocation -----------------------------------------------------------------------------------
    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """``n`` blocks for a sequence whose last block is ``after`` (None: it has none), held once each."""
        if n > self.num_free:
            raise MemoryError(f"{n} blocks asked, {self.num_free} free")
        out: list[int] = []
        prev = after
        while len(out) < n:
            nxt = prev + 1 if prev is not None else None
            if nxt is None or nxt >= self.num_blocks or not self._take(nxt):
                nxt = self._run_start(n - len(out))
                self._take(nxt, evict=True)
            out.append(nxt)
            prev = nxt
        return out

    def _take(self, block: int, evict: bool = False) -> bool:
        if self._is_free(block):
            self._unfree(block)
        elif evict and block in self._cached:
            self._evict(block)
        else:  # held, or cached and worth keeping: a cached neighbour is not evicted for adjacency
            return False
        self.refs[block] = 1
        return True

    def _run_start(self, n: int) -> int:
        """A block to start a new run of ``n`` at: inside the longest run of free blocks, as far from its start as
        leaves equal room before and after (so the sequences on both sides can grow in place), else a cached one."""
        if not self._run_starts:
            return next(iter(self._cached))
        best_start, best_len = -1, 0
        for start in self._run_starts:  # ascending: the first of the longest runs
            length = self._run_len[start]
            if length > best_len:
                best_start, best_len = start, length
        return best_start + max(0, best_len - n) // 2

    # -- free runs ------------------------------------------------------------------------------------
    def _add_run(self, start: int, length: int) -> None:
        bisect.insort(self._run_starts, start)
        self._run_len[start] = length
        self._run_of_last[start + length - 1] = start

    def _drop_run(self, start: int) -> int:
        del self._run_starts[bisect.bisect_left(self._run_starts, start)]
        length = self._run_len.pop(start)
        del self._run_of_last[start + length - 1]
        return length

    def _is_free(self, block: int) -> bool:
        i = bisect.bisect_right(self._run_starts, block) - 1
        return i >= 0 and block < self._run_starts[i] + self._run_len[self._run_starts[i]]

    def _unfree(self, block: int) -> None:
        """Free ``block`` leaves the free set: the run holding it splits around it."""
        self._num_free_blocks -= 1
        start = self._run_starts[bisect.bisect_right(self._run_starts, block) - 1]
        length = self._drop_run(start)
        if block > start:
            self._add_run(start, block - start)
        if block < start + length - 1:
            self._add_run(block + 1, start + length - 1 - block)

    def _refree(self, block: int) -> None:
        """``block`` joins the free set, merged with the runs that end just before and start just after it."""
        self._num_free_blocks += 1
        start, length = block, 1
        before = self._run_of_last.get(block - 1)
        if before is not None:
            start, length = before, self._drop_run(before) + 1
        if block + 1 in self._run_len:
            length += self._drop_run(block + 1)
        self._add_run(start, length)

    def _evict(self, block: int) -> None:
        del self._cached[block]
        entry = self._entry_of.pop(block)
        del self._entries[entry.key]

    def hold(self, block: int) -> None:
        """One more holder of ``block`` (a prefix-cache hit)."""
        if self.refs[block] == 0:
            del self._cached[block]
        self.refs[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one hold of each block; a block nobody holds becomes cached (registered) or free."""
        for b in blocks:
            if self.refs[b] <= 0:
                raise AssertionError(f"block {b} freed more often than held")
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self._entry_of:
                    self._cached[b] = None
                else:
                    self._refree(b)

    def is_shared(self, block: int) -> bool:
        """Whether writing into ``block`` could change what someone else reads (held twice, or registered)."""
        return self.refs[block] > 1 or block in self._entry_of

    # -- the prefix cache -----------------------------------------------------------------------------
    def register(self, parent: int, tokens: tuple, block: int) -> int:
        """Register full ``block`` holding ``tokens`` after the chain entry ``parent``; the entry's id.

        If those tokens are cached already (in another block), that entry stands and its id is returned."""
        if not self.enable_prefix_caching:
            return -1
        key = (parent, tokens)
        entry = self._entries.get(key)
        if entry is None:
            if block in self._entry_of:  # registered under another chain: keep the first
                return self._entry_of[block].id
            entry = _Entry(next(self._ids), key, block)
            self._entries[key] = entry
            self._entry_of[block] = entry
        return entry.id

    def lookup(self, parent: int, token_blocks: list[tuple]) -> list[tuple[int, int]]:
        """The cached blocks continuing chain ``parent`` with these full blocks of tokens, in order, as
        (block, entry id), each now held by the caller; stops at the first miss."""
        found: list[tuple[int, int]] = []
        if not self.enable_prefix_caching:
            return found
        self.queries += self.block_size * len(token_blocks)
        for tokens in token_blocks:
            entry = self._entries.get((parent, tokens))
            if entry is None:
                break
            self.hold(entry.block)
            found.append((entry.block, entry.id))
            parent = entry.id
        self.hits += self.block_size * len(found)
        return found

    def check(self) -> None:
        """Assert the invariants (tests): every block is in exactly one state; counts are never negative."""
        for b in range(self.num_blocks):
            held, free, cached = self.refs[b] > 0, self._is_free(b), b in self._cached
            assert self.refs[b] >= 0, b
            assert held + free + cached == 1, (b, self.refs[b], free, cached)
            assert not cached or b in self._entry_of, b
        runs = [(start, self._run_len[start]) for start in self._run_starts]
        assert runs == sorted(runs) and sum(length for _, length in runs) == self._num_free_blocks, runs
        for (start, length), after in zip(runs, runs[1:] + [(self.num_blocks + 1, 0)]):
            assert length > 0 and start + length < after[0], (start, length, after)  # maximal: a gap between runs
            assert all(self.refs[b] == 0 and b not in self._cached for b in range(start, start + length)), (start, length)
            assert self._run_of_last[start + length - 1] == start
        assert len(self._run_of_last) == len(runs)
        assert all(self._entries[e.key] is e for e in self._entry_of.values())
