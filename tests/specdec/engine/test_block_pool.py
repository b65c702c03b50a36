"""specdec/engine/block_pool.py: allocation, reference counts, the prefix cache, eviction (no tensors)."""

from __future__ import annotations

import random

import pytest

from specdec.engine.block_pool import ROOT, BlockPool


def test_allocation_keeps_a_sequence_consecutive_and_frees_back():
    pool = BlockPool(16, 4)
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert a == [0, 1, 2] or a == sorted(a) and a[-1] - a[0] == 2
    assert len(set(a) | set(b)) == 5
    more = pool.allocate(1, after=a[-1])
    assert more == [a[-1] + 1] or more[0] not in a + b  # the neighbour when free
    pool.free(a + b + more)
    pool.check()
    assert pool.num_free == 16 and pool.num_used == 0


def test_a_new_run_starts_in_the_middle_of_the_longest_free_run():
    pool = BlockPool(10, 1)
    held = pool.allocate(10)
    pool.free([held[1], held[5], held[6], held[7]])  # free runs: [1], [5, 6, 7]
    assert pool.allocate(1) == [6]  # room on both sides
    assert pool.allocate(1, after=6) == [7]  # the neighbour
    pool.check()
    empty = BlockPool(100, 1)
    first = empty.allocate(10)
    second = empty.allocate(10)
    assert first == list(range(45, 55))  # the middle: room to grow after it
    assert second[0] not in (55,) and len(set(first) & set(second)) == 0
    assert empty.allocate(1, after=first[-1]) == [55]  # the first sequence still grows in place


def test_over_allocation_raises_and_changes_nothing():
    pool = BlockPool(4, 2)
    pool.allocate(3)
    with pytest.raises(MemoryError):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.check()


def test_double_free_is_caught():
    pool = BlockPool(4, 2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AssertionError):
        pool.free([b])


def test_prefix_cache_hits_share_blocks_and_count_tokens():
    pool = BlockPool(8, 2)
    blocks = pool.allocate(3)
    e1 = pool.register(ROOT, (1, 2), blocks[0])
    e2 = pool.register(e1, (3, 4), blocks[1])
    assert pool.is_shared(blocks[0]) and not pool.is_shared(blocks[2])
    found = pool.lookup(ROOT, [(1, 2), (3, 4), (5, 6)])
    assert found == [(blocks[0], e1), (blocks[1], e2)]
    assert pool.refs[blocks[0]] == 2 and pool.queries == 6 and pool.hits == 4
    assert pool.lookup(ROOT, [(9, 9)]) == [] and pool.hits == 4
    # the same tokens after another parent are another entry: keys compare the chain, not just the block
    assert pool.lookup(e2, [(1, 2)]) == []
    pool.free(blocks + [b for b, _ in found])
    pool.check()
    assert pool.num_free == 8  # cached blocks nobody holds count as free


def test_cached_blocks_are_evicted_least_recently_used_first_and_only_when_needed():
    pool = BlockPool(4, 1)
    blocks = pool.allocate(4)
    entries = [pool.register(ROOT, (t,), b) for t, b in zip(range(4), blocks)]
    pool.free(blocks[1:])  # cached, nobody holds them, in the order they were let go
    pool.free(blocks[:1])  # block 0 let go last: the others go first
    got = pool.allocate(3)
    assert blocks[0] not in got
    assert pool.lookup(ROOT, [(0,)]) == [(blocks[0], entries[0])]
    assert pool.lookup(ROOT, [(1,)]) == []
    pool.check()


def test_registering_the_same_tokens_twice_keeps_one_entry():
    pool = BlockPool(4, 2)
    a, b = pool.allocate(2)
    e = pool.register(ROOT, (1, 2), a)
    assert pool.register(ROOT, (1, 2), b) == e  # b stays private
    assert not pool.is_shared(b)
    pool.free([a, b])
    pool.check()
    assert pool.num_free == 4


def test_prefix_caching_off_registers_nothing():
    pool = BlockPool(4, 2, enable_prefix_caching=False)
    (a,) = pool.allocate(1)
    assert pool.register(ROOT, (1, 2), a) == -1
    assert pool.lookup(ROOT, [(1, 2)]) == [] and pool.queries == 0
    pool.free([a])
    pool.check()


def test_random_operations_keep_the_invariants():
    rng = random.Random(0)
    pool = BlockPool(32, 2)
    holders: list[list[int]] = []
    parent_of: dict[int, int] = {}
    for _ in range(2000):
        op = rng.random()
        if op < 0.35 and pool.num_free:
            n = rng.randint(1, min(4, pool.num_free))
            holders.append(pool.allocate(n, after=rng.choice([None, rng.randrange(32)])))
        elif op < 0.6 and holders:
            blocks = holders.pop(rng.randrange(len(holders)))
            parent = ROOT
            for b in blocks[: rng.randint(0, len(blocks))]:
                parent = pool.register(parent, (rng.randrange(3), rng.randrange(3)), b)
                parent_of[b] = parent
            pool.free(blocks)
        elif op < 0.8:
            found = pool.lookup(ROOT, [(rng.randrange(3), rng.randrange(3)) for _ in range(rng.randint(1, 3))])
            if found:
                holders.append([b for b, _ in found])
        pool.check()
        assert sum(pool.refs) == sum(len(h) for h in holders)
    for h in holders:
        pool.free(h)
    pool.check()
    assert pool.num_used == 0


def _run_start_by_scan(free: set[int], n: int) -> int:
    """The placement rule written out over every free block (what the pool computed before it kept runs)."""
    best_start, best_len, start, length = -1, 0, -1, 0
    for b in sorted(free):
        if length and b == start + length:
            length += 1
        else:
            start, length = b, 1
        if length > best_len:
            best_start, best_len = start, length
    return best_start + max(0, best_len - n) // 2


@pytest.mark.parametrize("seed", range(4))
def test_kept_free_runs_place_blocks_as_a_scan_of_every_free_block_would(seed):
    """The pool keeps its free blocks as runs (no sort per allocation); at every step of a random mix of
    allocations, growth in place, prefix-cache registrations and frees, a new run starts where the full
    scan says, and the runs are the free set's maximal runs (check())."""
    rng = random.Random(seed)
    pool = BlockPool(64, 1)
    seqs: list[list[int]] = []
    parent = ROOT
    for step in range(400):
        free = {b for b in range(64) if pool.refs[b] == 0 and b not in pool._cached}  # from the counts, not the runs
        if free:
            assert pool._run_start(3) == _run_start_by_scan(free, 3)
        op = rng.random()
        if op < 0.4 and pool.num_free:
            seqs.append(pool.allocate(rng.randint(1, min(6, pool.num_free))))
        elif op < 0.6 and seqs and pool.num_free:
            seq = rng.choice(seqs)
            seq += pool.allocate(1, after=seq[-1])
        elif op < 0.7 and seqs:
            seq = rng.choice(seqs)
            parent = pool.register(parent if rng.random() < 0.5 else ROOT, (step,), seq[0])
        elif seqs:
            pool.free(seqs.pop(rng.randrange(len(seqs))))
        pool.check()
    for seq in seqs:
        pool.free(seq)
    pool.check()
    assert pool.num_free == 64
