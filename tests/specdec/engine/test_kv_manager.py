"""specdec/engine/kv_manager.py: the blocks of each sequence over the pool, with no model at all (the runner's
passes over them: tests/specdec/engine/test_runner.py)."""

from __future__ import annotations

import pytest
import torch

from specdec.drafting_state import DraftingState
from specdec.engine.kv_cache import KVPool
from specdec.engine.kv_manager import CachedSequence, KVCacheManager
from specdec.errors import InvalidRequestError, ResourceExhaustedError, SequenceNotFoundError

BLOCK = 4


def _manager(num_blocks: int = 8, max_sequences: int = 16, prefix_caching: bool = True) -> KVCacheManager:
    per_block = KVPool.bytes_per_token(1, 1, 2, torch.float32) * BLOCK
    pool = KVPool(1, 1, 2, torch.float32, torch.device("cpu"), per_block * num_blocks, BLOCK, prefix_caching)
    return KVCacheManager(pool, "target", max_sequences, torch.device("cpu"))


def _feed(m: KVCacheManager, seq: CachedSequence, history: list[int]) -> list[int]:
    """What a runner's pass does with a call: sync, reserve blocks for the rest, hold its tokens."""
    new = m.sync(seq, history)
    assert m.reserve([seq], [len(new)]) == [True]
    seq.tokens.extend(new)
    return new


def test_a_sequence_keeps_its_common_prefix_and_feeds_the_rest():
    m = _manager()
    seq, idle = m.open("a", seed=None)
    assert idle is None and isinstance(seq.state, DraftingState) and seq.state.held_target_ids is None
    assert _feed(m, seq, list(range(10))) == list(range(10))
    assert len(seq.blocks) == 3
    assert m.sync(seq, list(range(10)) + [42]) == [42]  # the next round: only the new token
    # a rewritten tail: rolled back by pointer, to the start of the block it ends in, since that block is now in
    # the prefix cache (shared: the next pass must not write into it)
    assert m.sync(seq, [0, 1, 2, 3, 4, 9, 9]) == [4, 9, 9]
    assert seq.tokens == [0, 1, 2, 3] and len(seq.blocks) == 1
    with pytest.raises(InvalidRequestError, match="empty"):
        m.sync(seq, [])
    again, idle = m.open("a", seed=None)
    assert again is seq and idle is not None and idle >= 0  # a decoding sequence's round period


def test_a_released_sequence_leaves_its_full_blocks_to_the_next_with_the_same_prefix():
    m = _manager()
    a, _ = m.open("a", seed=None)
    _feed(m, a, list(range(9)))
    assert m.release("a") and not m.release("a") and "a" not in m.sequences
    b, _ = m.open("b", seed=None)
    assert m.sync(b, list(range(9)) + [7]) == [8, 7]  # two full blocks found in the prefix cache
    assert b.tokens == list(range(8))
    with pytest.raises(SequenceNotFoundError):
        m.get("a")


def test_the_pool_preempts_the_last_ranked_sequence_first():
    m = _manager(num_blocks=4, prefix_caching=False)
    old_low, _ = m.open("old-low", seed=None, priority=5)
    young, _ = m.open("young", seed=None)
    _feed(m, old_low, list(range(8)))  # 2 blocks
    _feed(m, young, list(range(100, 108)))  # 2 blocks: the pool is full
    new, _ = m.open("new", seed=None)
    assert m.reserve([new], [4]) == [True]
    # the lowest priority goes first, although it is the oldest
    assert "old-low" not in m.sequences and "young" in m.sequences and m.kv.preemptions == 1


def test_a_row_that_cannot_fit_is_preempted_itself_and_capacity_is_checked():
    m = _manager(num_blocks=2, prefix_caching=False)
    seq, _ = m.open("a", seed=None)
    assert m.reserve([seq], [3 * BLOCK]) == [False] and "a" not in m.sequences
    with pytest.raises(InvalidRequestError, match="can never fit"):
        m.check_capacity(2 * BLOCK + 1)
    m.check_capacity(2 * BLOCK)


def test_the_sequence_cap_and_the_decoding_count():
    m = _manager(max_sequences=2)
    a, _ = m.open("a", seed=None)
    b, _ = m.open("b", seed=None)
    with pytest.raises(ResourceExhaustedError, match="cap is 2"):
        m.open("c", seed=None)
    _feed(m, a, [1, 2, 3])
    _feed(m, b, [4, 5, 6])
    b.prefilling = True
    assert m.prefilling() and m.decoding() == 1 and m.decoding(exclude={"a"}) == 0
