"""specdec.trees.fit_trees: a batch's trees cut to the rows a verify pass costs by (its tiles)."""

from __future__ import annotations

import random

import pytest

from specdec.trees import check_parents, fit_trees, levels, merge, path_to


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


def test_merge_joins_shared_paths_and_keeps_the_likeliest_nodes_parents_first():
    suffix = ([5, 6, 7], None, [0.9, 0.8, 0.3])  # a chain 5 6 7
    head = ([5, 9, 6, 4], [-1, -1, 0, 2], [0.6, 0.3, 0.5, 0.4])  # 5 -> 6 -> 4, and 9
    tokens, parents, probs = merge([suffix, head], max_nodes=10)
    # 5 and 5-6 are one node each (the higher estimate); 5-6-4 rises above 5-6-7 by its estimate; 5-6-7 and 9 tie,
    # and 5-6-7 was met first
    assert tokens == [5, 6, 4, 7, 9] and parents == [-1, 0, 1, 1, -1] and probs == [0.9, 0.8, 0.4, 0.3, 0.3]
    assert merge([suffix, head], max_nodes=3) == ([5, 6, 4], [-1, 0, 1], [0.9, 0.8, 0.4])
    # a child's estimate above its parent's (the parent from the other tree) lifts the parent
    assert merge([([1], None, [0.2]), ([1, 2], None, [0.1, 0.7])], 5) == ([1, 2], [-1, 0], [0.7, 0.7])
    assert merge([([], None, []), ([3], None, [0.5])], 5) == ([3], [-1], [0.5])


def _random_tree(rng, size):
    parents, probs, tokens = [], [], []
    for i in range(size):
        parent = rng.randrange(-1, i)
        parents.append(parent)
        tokens.append(rng.randrange(4))  # few tokens: siblings and the other tree share paths often
        probs.append((probs[parent] if parent >= 0 else 1.0) * rng.random())
    return tokens, parents, probs


def _paths(tokens, parents, probs):
    """Each token path's best estimate (a random tree may hold a path twice)."""
    out: dict = {}
    for i in range(len(tokens)):
        path = tuple(tokens[n] for n in path_to(parents, i))
        out[path] = max(out.get(path, 0.0), probs[i])
    return out


@pytest.mark.parametrize("seed", range(20))
def test_merge_of_random_trees_is_the_union_of_their_paths_cut_by_estimate(seed):
    rng = random.Random(seed)
    a, b = _random_tree(rng, rng.randrange(0, 12)), _random_tree(rng, rng.randrange(0, 12))
    whole = merge([a, b], max_nodes=64)
    check_parents(whole[1], len(whole[0]))
    union = _paths(*whole)
    assert len(union) == len(whole[0])  # no path twice
    assert set(union) == set(_paths(*a)) | set(_paths(*b))
    for path, p in union.items():  # a path's estimate: the best of any tree's for it or a path through it
        assert p == max(q for t in (a, b) for other, q in _paths(*t).items() if other[:len(path)] == path)
    budget = rng.randrange(1, 16)
    cut = merge([a, b], max_nodes=budget)
    assert cut == tuple(x[:budget] for x in whole)  # the first nodes of the whole merge: a tree, likeliest first
    check_parents(cut[1], len(cut[0]))
    assert cut[2] == sorted(cut[2], reverse=True)
