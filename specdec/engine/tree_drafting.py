"""Token trees from a draft model: EAGLE-2's dynamic trees, for any draft model that shares the target's vocabulary.

A chain drafts the draft's argmax at each step. A tree keeps the draft's ``top_k`` likeliest tokens at each
position it expands, and grows by confidence, level by level:

1. The root's children are the ``top_k`` likeliest tokens after the history. The pass that feeds the history
   gives their logits, so this costs no more than a chain's first step.
2. Each later level expands the ``top_k`` candidates of the level before that have the highest cumulative
   log-probability (the sum of the draft's log-probabilities along the path). It feeds them in one pass as tree
   nodes, each attending to the history and its own ancestors (``specdec.engine.attention``), and adds their
   ``top_k`` children.
3. After ``depth`` levels, the ``max_nodes`` candidates with the highest cumulative log-probability are
   proposed, the likeliest first (parents first: a target short of rows keeps a tree's first nodes,
   ``specdec.trees.fit_trees``); a static shape's nodes in the shape's order.

Along a path the cumulative log-probability never rises, so a kept node's ancestors are kept too. A tie goes to
the node made first.

The candidates are deterministic: top-k of the draft's logits, with the request's penalties applied along the
path. The target's walk (``specdec.trees``) is lossless whatever they are. The draft's cache is cut back to the
history afterwards, so no node's entry outlives the round, and the next round feeds the accepted path again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specdec.engine.kv_manager import CachedSequence
from specdec.engine.runner import ModelRunner
from specdec.proposal import Proposal
from specdec.sampling import apply_penalties, penalty_context
from specdec.config import TreeShape


@dataclass
class CandidateTree:
    """A tree's candidates as they are made (a draft model's here, an EAGLE-3 head's in ``eagle3_worker``)."""

    tokens: list[int] = field(default_factory=list)  # every candidate, in the order made
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # cumulative log-probabilities
    fed: list[int] = field(default_factory=list)  # the candidates fed to the draft, in feed order
    level: list[int] = field(default_factory=list)  # the last level's candidates
    ranks: list[tuple[int, ...]] = field(default_factory=list)  # each candidate's path of child ranks

    def add_children(self, parent: int, logprobs: torch.Tensor, ranks: list[int],
                     id_map: torch.Tensor | None = None) -> None:
        """The children of ``parent`` (-1: the root) at these ranks of the draft's distribution; ``id_map``: the
        token id of each of its entries (an EAGLE head's reduced vocabulary; None: the entries are the ids)."""
        values, ids = logprobs.topk(max(ranks) + 1)
        if id_map is not None:
            ids = id_map[ids]
        self.add_ranked(parent, values.tolist(), ids.tolist(), ranks)

    def add_ranked(self, parent: int, values: list[float], ids: list[int], ranks: list[int]) -> None:
        """``add_children`` from the distribution's top entries, ranked: their log-probabilities and token ids."""
        base = self.scores[parent] if parent >= 0 else 0.0
        self.level = []
        for r in ranks:
            self.level.append(len(self.tokens))
            self.tokens.append(ids[r])
            self.parents.append(parent)
            self.scores.append(base + values[r])
            self.ranks.append((self.ranks[parent] if parent >= 0 else ()) + (r,))

    def path(self, node: int) -> list[int]:
        out = []
        while node >= 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    def proposal(self, max_nodes: int, by_score: bool = True) -> Proposal:
        """The ``max_nodes`` likeliest candidates, the likeliest first (``by_score``: a target that must cut the
        tree keeps its first nodes, so the likeliest; a parent is never less likely than its child, and wins a
        tie as the one made first, so parents still come first), else in the order they were made."""
        keep = sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], i))[:max_nodes]
        if not by_score:
            keep.sort()
        index = {node: i for i, node in enumerate(keep)}
        return Proposal([self.tokens[i] for i in keep],
                        parents=[index[self.parents[i]] if self.parents[i] >= 0 else -1 for i in keep],
                        node_probs=[math.exp(self.scores[i]) for i in keep])


def grow_trees(runner: ModelRunner, calls: list, seqs: list[CachedSequence], first: list[torch.Tensor],
               shape: TreeShape, eos_token_ids, restrict=None) -> list[Proposal]:
    """Trees for sequences whose history the runner just fed (``first[i]``: its logits, the last row the root's).
    ``calls[i].num_speculative_tokens`` is the tree's depth (at most a static shape's). ``restrict``: a TLI
    draft's mask of the tokens outside the vocabularies' intersection (its candidates are intersection tokens; the
    request's penalties, over target ids, are the target's alone)."""
    trees = [CandidateTree() for _ in calls]
    roots = [s.length for s in seqs]
    static = shape.static
    top = list(range(shape.top_k))

    def ranks_under(tree: CandidateTree, node: int) -> list[int]:
        """The child ranks to add under ``node`` (-1: the root): the static shape's, else the top k."""
        if static is None:
            return top
        path = tree.ranks[node] if node >= 0 else ()
        return [p[-1] for p in static if len(p) == len(path) + 1 and p[:-1] == path]

    def to_expand(tree: CandidateTree) -> list[int]:
        """The last level's candidates to expand: the shape's that have children, else the top k by score."""
        if static is not None:
            return [n for n in tree.level if ranks_under(tree, n)]
        return sorted(tree.level, key=lambda i: (-tree.scores[i], i))[:shape.top_k]

    def logprobs(call, tree: CandidateTree, node: int, row: torch.Tensor) -> torch.Tensor:
        if restrict is not None:
            return torch.log_softmax(restrict(row).float(), dim=-1)
        if call.params.has_penalties:  # as the target will process that position (the path counts as generated)
            row = apply_penalties(row, call.params, penalty_context(call.params, call.token_ids, eos_token_ids,
                                                                    after=tree.path(node)))
        return torch.log_softmax(row.float(), dim=-1)

    for call, tree, lg in zip(calls, trees, first):
        tree.add_children(-1, logprobs(call, tree, -1, lg[-1]), ranks_under(tree, -1))
    for depth in range(1, max(c.num_speculative_tokens for c in calls)):
        expand = {j: to_expand(trees[j]) for j, c in enumerate(calls) if depth < c.num_speculative_tokens}
        # (a row the pool preempted, this pass or one of another row's, is no longer the runner's: it stops)
        rows = [j for j, nodes in expand.items() if nodes and runner.sequences.get(seqs[j].sequence_id) is seqs[j]
                and seqs[j].length + len(nodes) <= runner.max_model_len]
        if not rows:
            break
        feeds = []
        for j in rows:
            tree = trees[j]
            tree.fed += expand[j]
            order = {node: f for f, node in enumerate(tree.fed)}
            feeds.append([order[tree.parents[n]] if tree.parents[n] >= 0 else -1 for n in tree.fed])
        out = runner.forward_batch([seqs[j] for j in rows], [[trees[j].tokens[n] for n in expand[j]] for j in rows],
                                   [len(expand[j]) for j in rows], trees=feeds)
        for j, lg in zip(rows, out):
            tree = trees[j]
            tree.level = []
            if not isinstance(lg, torch.Tensor):  # preempted: propose what it has
                continue
            level = []
            for node, row in zip(expand[j], lg):
                tree.add_children(node, logprobs(calls[j], tree, node, row), ranks_under(tree, node))
                level += tree.level
            tree.level = level
    for seq, root in zip(seqs, roots):
        if seq.length > root:  # the fed nodes' entries go: the next round feeds the accepted path
            runner.cache.truncate(seq, root)
    return [tree.proposal(shape.max_nodes) if static is None else tree.proposal(len(tree.tokens), by_score=False)
            for tree in trees]
