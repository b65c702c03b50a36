"""Token trees: a proposal's drafts as nodes with parents, verified in one target pass (no torch, no grpc).

A tree of k draft nodes is ``parents`` [k]: node i's parent is ``parents[i]``, an earlier node (``0 <= parents[i]
< i``) or ``-1``, the root: the last token of the history, whose next token the pass decides first. Nodes come in
topological order (a parent before its children), so the first n nodes of a tree are a tree. A chain is the tree
``[-1, 0, 1, ...]``; a proposal without parents is a chain.

The target scores every node in one pass (each node attends to the history and its own ancestors:
``specdec.engine.attention``), then walks from the root: at each node it takes the token the target alone would
take there (greedy: the argmax; seeded: the coupled race's winner at that position; unseeded: a draw from p) and
follows the child holding that token, if any. The path it walked is accepted, the token it took at the last node
is the next token. Lossless in every mode, whatever the tree: each emitted token is the target's own choice at its
position given the tokens before it, and the drafts only decide how many of those choices one pass can confirm.
"""

from __future__ import annotations

from specdec.errors import InvalidRequestError


def check_parents(parents: list[int], k: int, param: str = "draft_parents") -> None:
    """Raise InvalidRequestError unless ``parents`` is a tree of ``k`` nodes in topological order."""
    if len(parents) != k:
        raise InvalidRequestError(f"{len(parents)} parents for {k} draft tokens: a tree needs one parent per node",
                                  param=param)
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise InvalidRequestError(f"node {i}'s parent is {p}: a parent is -1 (the root) or an earlier node",
                                      param=param)


def is_chain(parents: list[int] | None) -> bool:
    return parents is None or all(p == i - 1 for i, p in enumerate(parents))


def depths(parents: list[int]) -> list[int]:
    """Each node's depth: 0 for the root's children (the position after the history)."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def path_to(parents: list[int], node: int) -> list[int]:
    """The nodes from the root's child down to ``node`` (its ancestors, then itself)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def children(parents: list[int]) -> list[list[int]]:
    """children[0] are the root's children; children[i + 1] node i's (in node order)."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        out[p + 1].append(i)
    return out


def first_branch(parents: list[int]) -> list[int]:
    """The nodes of the tree's first branch (the first child of the root, its first child, ...): a chain."""
    kids = children(parents)
    out, node = [], -1
    while kids[node + 1]:
        node = kids[node + 1][0]
        out.append(node)
    return out


def walk(parents: list[int], token_ids: list[int], choose) -> tuple[list[int], int]:
    """The target's walk: ``choose(row)`` is the token the target takes at row ``row`` (0: the root, i + 1: node
    i); returns (the accepted nodes in path order, the next token)."""
    kids = children(parents)
    path: list[int] = []
    row = 0
    while True:
        token = choose(row)
        nxt = next((c for c in kids[row] if token_ids[c] == token), None)
        if nxt is None:
            return path, token
        path.append(nxt)
        row = nxt + 1


def levels(parents: list[int]) -> int:
    """How many positions deep the tree reaches (a chain of k: k)."""
    return max(depths(parents)) + 1 if parents else 0


def fit_trees(sizes: list[int], tree_levels: list[int], other_rows: int, tile_rows: int) -> list[int]:
    """The nodes each tree of one verify pass keeps (its first ones: ``Proposal.truncated``), so that the pass
    fills no more ``tile_rows``-row tiles than if each tree were a chain of its depth: a pass costs by the tile
    (``specdec.engine.lean_linear``'s batch-invariant products), so trees take the rows the chains leave free in
    their last tile, shared evenly (a small tree's unused share goes to the others). ``sizes``: each tree's
    nodes; ``tree_levels``: its depth (``levels``); ``other_rows``: the pass's other rows (chains, prompts, each
    tree's new history). One tree alone keeps up to a whole tile. ``tile_rows`` <= 0: nothing is cut."""
    if tile_rows <= 0 or not sizes:
        return list(sizes)
    base = other_rows + sum(tree_levels)
    room = max(tile_rows, -(-base // tile_rows) * tile_rows) - other_rows  # rows for the trees' nodes
    if sum(sizes) <= room:
        return list(sizes)
    keep = [0] * len(sizes)
    waiting = sorted(range(len(sizes)), key=lambda i: (sizes[i], i))
    while waiting:
        share, extra = divmod(room, len(waiting))
        if sizes[waiting[0]] <= share:  # the smallest tree fits its share whole: the rest share what it leaves
            i = waiting.pop(0)
            keep[i], room = sizes[i], room - sizes[i]
            continue
        for rank, i in enumerate(sorted(waiting)):
            keep[i] = share + (1 if rank < extra else 0)
        break
    return keep


def merge(trees: list[tuple[list[int], list[int] | None, list[float]]], max_nodes: int
          ) -> tuple[list[int], list[int], list[float]]:
    """One tree of the nodes of several drafters' trees (a hybrid's suffix tree and its model's), at most
    ``max_nodes`` of them. Each tree is (tokens, parents (None: a chain), probs): ``probs[i]`` the drafter's
    estimate that the target takes node i's whole path, never above its parent's. Nodes on the same path of tokens
    become one node with the higher estimate; the ``max_nodes`` likeliest are kept, the likeliest first (a tie: the
    node met first, so a parent before its child: the first n nodes stay a tree). Returns (tokens, parents, probs)."""
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    at: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    for ids, pars, ps in trees:
        pars = list(range(-1, len(ids) - 1)) if pars is None else pars
        mapped: list[int] = []
        for token, parent, p in zip(ids, pars, ps):
            key = (mapped[parent] if parent >= 0 else -1, token)
            node = at.get(key)
            if node is None:
                node = at[key] = len(tokens)
                tokens.append(token)
                parents.append(key[0])
                probs.append(p)
            else:
                probs[node] = max(probs[node], p)
            mapped.append(node)
    # a node's estimate may have risen above its parent's (the parent came from the other tree): lift the parents
    for node in range(len(tokens) - 1, -1, -1):
        if parents[node] >= 0 and probs[parents[node]] < probs[node]:
            probs[parents[node]] = probs[node]
    keep = sorted(range(len(tokens)), key=lambda i: (-probs[i], i))[:max_nodes]
    index = {node: i for i, node in enumerate(keep)}
    return ([tokens[i] for i in keep], [index[parents[i]] if parents[i] >= 0 else -1 for i in keep],
            [probs[i] for i in keep])
