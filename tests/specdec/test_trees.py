"""specdec.trees.fit_trees: a batch's trees cut to the rows a verify pass costs by (its tiles)."""

from __future__ import annotations

import random

import pytest

from specdec.trees import fit_trees, levels


def test_levels():
    assert levels([]) == 0 and levels([-1]) == 1 and levels([-1, 0, 1]) == 3 and levels([-1, -1, 0, 2]) == 3


@pytest.mark.parametrize("sizes, tree_levels, other, keep", [
    ([15], [3], 1, [15]),  # alone: one tile of 16 (a history row + 15 nodes)
    ([15, 15], [3, 3], 2, [7, 7]),  # two share it
    ([15, 2], [3, 2], 2, [12, 2]),  # a small tree's unused share goes to the other
    ([15, 15, 15], [3, 3, 3], 3, [5, 4, 4]),  # 3 + 13 = 16 rows, the remainder to the first
    ([15, 15], [3, 3], 30, [9, 9]),  # 30 other rows (a prompt): chains need 36 rows -> 3 tiles, 18 left for the trees
    ([6, 6], [3, 3], 2, [6, 6]),  # fits: nothing cut
    ([15, 15], [12, 12], 2, [15, 15]),  # chains this deep fill two tiles already: the trees fit in them
])
def test_trees_share_the_tiles_their_chains_would_fill(sizes, tree_levels, other, keep):
    assert fit_trees(sizes, tree_levels, other, 16) == keep


def test_no_tile_no_cut():
    assert fit_trees([15, 15], [3, 3], 2, 0) == [15, 15] == fit_trees([15, 15], [3, 3], 2, -1)


def test_random_batches_never_add_a_tile_and_keep_each_tree_a_node():
    rng = random.Random(0)
    for _ in range(2000):
        n, tile = rng.randint(1, 9), rng.choice([8, 16, 64])
        tree_levels = [rng.randint(1, 8) for _ in range(n)]
        sizes = [rng.randint(lv, 32) for lv in tree_levels]
        other = n + rng.choice([0, 0, rng.randint(0, 100)])
        keep = fit_trees(sizes, tree_levels, other, tile)
        chains = -(-(other + sum(tree_levels)) // tile)  # the tiles the same batch's chains fill
        tiles = -(-(other + sum(keep)) // tile)
        assert all(1 <= k <= s for k, s in zip(keep, sizes))
        assert tiles <= max(1, chains) or keep == sizes
        if keep != sizes:  # what was cut filled the tiles
            assert other + sum(keep) == max(1, chains) * tile
