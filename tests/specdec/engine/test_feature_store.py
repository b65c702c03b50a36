"""specdec.engine.feature_store: an EAGLE target's features kept beside its KV blocks."""

import torch

from specdec.engine.feature_store import STORE_DTYPE, BlockFeatures

LAYERS = (2, 15, 27)


def rows(start: int, n: int, width: int = 6) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.float32)[:, None].expand(n, width).clone()


def test_rows_written_across_blocks_read_back_in_order():
    store = BlockFeatures(block_size=4)
    blocks = [7, 3, 9]
    store.write(blocks, 0, LAYERS, rows(0, 6))
    store.write(blocks, 6, LAYERS, rows(6, 4))
    assert store.available(blocks, 0, 10, LAYERS) == 10
    got = store.read(blocks, 2, 10)
    assert got.dtype == STORE_DTYPE
    assert got[:, 0].tolist() == list(range(2, 10))
    assert store.available(blocks, 0, 12, LAYERS) == 10  # position 10 was never written
    assert store.available(blocks, 0, 10, (1, 2, 3)) == 0  # other layers: nothing stored for them


def test_a_write_past_a_gap_is_not_kept_and_a_rollback_cuts_the_block():
    store = BlockFeatures(block_size=4)
    blocks = [0, 1]
    store.write(blocks, 0, LAYERS, rows(0, 2))
    store.write(blocks, 3, LAYERS, rows(3, 3))  # position 2 missing: block 0 keeps 2 rows; block 1 gets 4..5
    assert store.available(blocks, 0, 6, LAYERS) == 2
    assert store.available(blocks, 4, 6, LAYERS) == 6
    store.cut(blocks, 5)  # rolled back to 5 positions: block 1 keeps position 4 only
    assert store.available(blocks, 4, 6, LAYERS) == 5
    store.cut(blocks, 4)  # a cut at a block boundary leaves the earlier block whole
    assert store.available(blocks, 0, 2, LAYERS) == 2


def test_a_block_handed_out_again_forgets_its_rows():
    store = BlockFeatures(block_size=4)
    store.write([5], 0, LAYERS, rows(0, 4))
    assert len(store) == 1 and store.nbytes == 4 * 6 * 2
    store.forget([5])
    assert store.available([5], 0, 4, LAYERS) == 0 and len(store) == 0
    store.write([5], 0, (1,), rows(0, 4))  # a block rewritten with other layers holds those only
    store.write([5], 0, LAYERS, rows(0, 2))
    assert store.available([5], 0, 4, LAYERS) == 2 and store.available([5], 0, 4, (1,)) == 0


def test_the_store_stays_within_its_bytes_forgetting_the_oldest_blocks():
    """Host memory beside the KV pool is bounded (KVCacheManager gives FEATURE_BUDGET_FRACTION of the pool): past
    the bound, the blocks written longest ago are forgotten (their positions are fed again when asked)."""
    block = 4 * 6 * 2  # 4 rows x width 6 in bfloat16
    store = BlockFeatures(block_size=4, max_bytes=2 * block)
    for b in range(3):
        store.write([b], 0, LAYERS, rows(0, 4))
    assert store.nbytes == 2 * block and len(store) == 2
    assert store.available([0], 0, 4, LAYERS) == 0  # the oldest went
    assert store.available([1], 0, 4, LAYERS) == 4 and store.available([2], 0, 4, LAYERS) == 4
    store.forget([1, 2])
    assert store.nbytes == 0


def test_a_target_pools_features_within_a_share_of_its_kv_pool(target_lm):
    from specdec.engine.feature_store import FEATURE_BUDGET_FRACTION
    from specdec.engine.runner import ModelRunner

    runner = ModelRunner(target_lm, 256, role="target")
    assert runner.cache.features.max_bytes == int(FEATURE_BUDGET_FRACTION * runner.kv.nbytes) > 0
