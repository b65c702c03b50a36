"""Token trees through the target worker (specdec.trees, ModelRunner trees, TargetWorker): one pass over a tree,
the accepted path moved into place, lossless in every mode.

Greedy and coupled-seeded output with random trees is the target's own output, round after round (so the moved
KV is right: a wrong key would change a later round); in batch-invariant mode each node's logits are the same
bits as its path verified as a chain; a tree the target cannot verify as one (transformers' forward) is verified
as its first branch; unseeded sampling down a tree is distributed as p (chi-square), and a rule that favours the
first branch is caught."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from specdec.engine.runner import ModelRunner
from specdec.engine.workers import TargetWorker as _TargetWorker
from specdec.calls import VerifyCall
from specdec.proposal import Proposal
from specdec.sampling_params import SamplingParams
from specdec.trees import path_to

# the trees here are verified whole (the cut to a pass's tiles is tested on its own, at the end)
TargetWorker = functools.partial(_TargetWorker, tree_tile_rows=-1)

PROMPT = [1, 504, 2830, 6354, 17, 4, 280, 9023, 14, 618, 41, 88]


def _runner(lm, **kw):
    return ModelRunner(lm, 256, role="target", enable_prefix_caching=False, **kw)


def _alone(worker, params, n, sid="alone"):
    tokens = list(PROMPT)
    while len(tokens) < len(PROMPT) + n:
        tokens.append(worker.verify(sid, tokens, Proposal([]), params).next_token_id)
    worker.release(sid)
    return tokens[len(PROMPT):]


def _random_tree(rng: random.Random, truth: list[int], size: int, vocab: int = 49152):
    """A random tree of ``size`` nodes in topological order; with probability 1/2 it holds a prefix of ``truth``
    (the target's continuation) on some branch, so paths of every length get accepted."""
    parents, tokens = [], []
    hold = rng.randint(0, min(len(truth), size)) if rng.random() < 0.5 else 0
    chain_at = -1
    for i in range(size):
        if i < hold:
            parent = chain_at
            # scatter the true branch: a decoy sibling first, sometimes
            if rng.random() < 0.4 and len(parents) < size - 1 - (hold - i):
                parents.append(parent)
                tokens.append(rng.randrange(vocab))
            parents.append(parent)
            tokens.append(truth[i])
            chain_at = len(parents) - 1
        if len(parents) >= size:
            break
    while len(parents) < size:
        parents.append(rng.randint(-1, len(parents) - 1))
        tokens.append(rng.randrange(vocab))
    return parents[:size], tokens[:size]


def _with_trees(worker, params, n, seed, size=9, truth=None, sid="tree", later_branches=None):
    rng = random.Random(seed)
    tokens = list(PROMPT)
    while len(tokens) < len(PROMPT) + n:
        ahead = (truth or [])[len(tokens) - len(PROMPT):]
        parents, drafts = _random_tree(rng, ahead, rng.randint(1, size))
        result = worker.verify(sid, tokens, Proposal(drafts, parents=parents), params)
        if result.accepted_path is not None:
            for a, b in zip(result.accepted_path, result.accepted_path[1:]):
                assert parents[b] == a  # a path, from the root down
            if result.accepted_path and later_branches is not None:
                later_branches.append(result.accepted_path[0] != parents.index(-1))
        tokens += result.emitted(drafts)
    worker.release(sid)
    return tokens[len(PROMPT):][:n]


@pytest.mark.parametrize("invariant", [True, False], ids=["c-kernel", "sdpa"])
def test_greedy_with_random_trees_is_the_target_alone(target_lm, invariant):
    worker = TargetWorker(_runner(target_lm, batch_invariant=invariant))
    params = SamplingParams(temperature=0.0, max_tokens=64)
    truth = _alone(worker, params, 40)
    later: list[bool] = []
    for seed in range(3):
        assert _with_trees(worker, params, 40, seed, truth=truth, later_branches=later) == truth
    assert any(later) and not all(later)  # paths down the first root child and down later ones were accepted


def test_coupled_seeded_with_random_trees_is_the_target_alone(target_lm):
    worker = TargetWorker(_runner(target_lm, batch_invariant=True))
    params = SamplingParams(temperature=0.8, seed=1234, max_tokens=64)
    truth = _alone(worker, params, 30)
    for seed in range(2):
        assert _with_trees(worker, params, 30, seed, truth=truth) == truth


def test_a_nodes_logits_are_its_chains_bits(target_lm):
    runner = _runner(target_lm, batch_invariant=True)
    parents = [-1, 0, 0, 1, 2, 2, -1, 6]
    drafts = [11, 22, 33, 44, 55, 66, 77, 88]
    tree_seq = runner.get_or_create("tree", None)
    new = runner.sync(tree_seq, PROMPT)
    (tree_logits,) = runner.forward_batch([tree_seq], [new + drafts], [len(drafts) + 1], trees=[parents])
    for node in range(len(drafts)):
        path = path_to(parents, node)
        chain = runner.get_or_create(f"chain{node}", None)
        new = runner.sync(chain, PROMPT)
        (chain_logits,) = runner.forward_batch([chain], [new + [drafts[i] for i in path]], [len(path) + 1])
        assert torch.equal(tree_logits[1 + node], chain_logits[-1]), node
        assert torch.equal(tree_logits[0], chain_logits[0])
        runner.release(f"chain{node}")


def test_moved_path_is_the_chains_cache(target_lm):
    """After a tree round the accepted path's keys sit where a chain's would: the next pass gives the same bits."""
    runner = _runner(target_lm, batch_invariant=True)
    worker = TargetWorker(runner)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    truth = _alone(worker, params, 6)
    parents = [-1, -1, 1, 1, 3, 4]  # truth[0] as the second root child, truth[1] as its second child, ...
    drafts = [truth[0] + 1, truth[0], truth[1] + 1, truth[1], truth[2], truth[3]]
    result = worker.verify("t", list(PROMPT), Proposal(drafts, parents=parents), params)
    assert result.accepted_path == [1, 3, 4, 5] and result.next_token_id == truth[4]
    seq = runner.sequences["t"]
    assert seq.tokens == PROMPT + truth[:4]
    (after_tree,) = runner.forward_batch([seq], [[truth[4]]], [1])
    fresh = runner.get_or_create("fresh", None)
    new = runner.sync(fresh, PROMPT + truth[:5])
    (after_chain,) = runner.forward_batch([fresh], [new], [1])
    assert torch.equal(after_tree, after_chain)


def test_without_the_lean_forward_a_tree_is_verified_as_its_first_branch(target_lm):
    worker = TargetWorker(_runner(target_lm, lean_forward=False))
    params = SamplingParams(temperature=0.0, max_tokens=64)
    truth = _alone(worker, params, 3)
    parents, drafts = [-1, -1, 0, 2], [truth[0], 5, truth[1], truth[2]]
    result = worker.verify("t", list(PROMPT), Proposal(drafts, parents=parents), params)
    assert result.accepted_path == [0, 2, 3] and result.emitted(drafts) == truth[:3] + [result.next_token_id]
    # the second root child holds the truth: the first branch cannot reach it
    parents, drafts = [-1, -1], [truth[0] + 1, truth[0]]
    result = worker.verify("u", list(PROMPT), Proposal(drafts, parents=parents), params)
    assert result.accepted_path == [] and result.next_token_id == truth[0]
    # with logprobs: read from the chain's rows, one per emitted token (the path maps back to the tree's nodes)
    parents, drafts = [-1, -1, 0, 1, 2], [truth[0], 7, truth[1], 8, truth[2]]
    result = worker.verify("v", list(PROMPT), Proposal(drafts, parents=parents), params.clone(logprobs=2))
    assert result.accepted_path == [0, 2, 4] and len(result.logprobs) == 4
    assert [lp.token_id for lp in result.logprobs] == result.emitted(drafts) == truth[:3] + [result.next_token_id]


def test_bad_trees_are_refused(target_lm):
    from specdec.errors import InvalidRequestError

    worker = TargetWorker(_runner(target_lm))
    params = SamplingParams(temperature=0.0, max_tokens=8)
    for parents in ([0], [-1, 1], [-1, -2], [-1]):
        with pytest.raises(InvalidRequestError, match="parent"):
            worker.verify("t", list(PROMPT), Proposal([5, 6], parents=parents), params)
    with pytest.raises(InvalidRequestError, match="draft_probs"):
        worker.verify("t", list(PROMPT), Proposal([5, 6], torch.full((2, 49152), 1 / 49152), parents=[-1, -1]),
                      params)


def _first_two(worker, params, parents, drafts, n):
    """The first two emitted tokens of n one-round verifications of the tree (unseeded)."""
    out = []
    for i in range(n):
        r = worker.verify(f"s{i}", list(PROMPT), Proposal(drafts, parents=parents), params)
        emitted = r.emitted(drafts)
        if len(emitted) < 2:  # the second token: a round of its own after the first
            emitted.append(worker.verify(f"s{i}", list(PROMPT) + emitted, Proposal([]), params).next_token_id)
        out.append(tuple(emitted[:2]))
        worker.release(f"s{i}")
    return out


@pytest.mark.heavy
def test_unseeded_sampling_down_a_tree_is_distributed_as_the_target(target_lm, chi2_pvalue):
    worker = TargetWorker(_runner(target_lm, batch_invariant=True))
    params = SamplingParams(temperature=1.0, top_k=6, max_tokens=8)
    with torch.inference_mode():
        logits = target_lm.model(torch.tensor([PROMPT])).logits[0, -1]
    p1 = torch.softmax(torch.topk(logits, 6).values, -1)
    top = torch.topk(logits, 6).indices.tolist()
    # root children: the three likeliest tokens (and one unlikely), each with a child
    parents = [-1, -1, -1, -1, 0, 1, 2]
    drafts = [top[0], top[1], top[2], 7, top[0], top[1], top[2]]
    n = 1200
    firsts = [a for a, _ in _first_two(worker, params, parents, drafts, n)]
    observed = [firsts.count(t) for t in top]
    assert sum(observed) == n
    assert chi2_pvalue(observed, p1.tolist()) > 1e-3

    # negative control: a walk that favours the first branch (it takes the first root child where the target
    # chose the second) must fail
    import specdec.trees as trees

    real = trees.walk

    def biased(parents_, tokens_, choose):
        path, token = real(parents_, tokens_, choose)
        if path and path[0] == 1:
            return [0], choose(1)
        return path, token

    from specdec.engine import workers as workers_module

    workers_module.walk = biased
    try:
        firsts = [a for a, _ in _first_two(worker, params, parents, drafts, n)]
    finally:
        workers_module.walk = real
    observed = [firsts.count(t) for t in top]
    assert chi2_pvalue(observed, p1.tolist()) < 1e-3


def test_a_tree_behind_a_prompt_prefilled_in_chunks(target_lm):
    """A first call whose prompt is fed in chunks: the chunks feed no tree; the last pass verifies it."""
    worker = TargetWorker(_runner(target_lm, batch_invariant=True, max_num_batched_tokens=16))
    params = SamplingParams(temperature=0.0, max_tokens=64)
    long = PROMPT * 4
    alone = TargetWorker(_runner(target_lm, batch_invariant=True))
    tokens = list(long)
    want = []
    while len(want) < 4:
        want.append(alone.verify("x", tokens + want, Proposal([]), params).next_token_id)
    parents, drafts = [-1, -1, 1, 2], [want[0] + 1, want[0], want[1], want[2]]
    passes = []
    real = worker.runner.forward_batch
    worker.runner.forward_batch = lambda *a, **kw: passes.append(kw.get("trees")) or real(*a, **kw)
    result = worker.verify("chunked", tokens, Proposal(drafts, parents=parents), params)
    assert result.accepted_path == [1, 2, 3] and result.next_token_id == want[3]
    assert len(passes) >= 3  # 48 prompt tokens at most 16 a pass: the prompt did go in chunks


def test_trees_under_prefix_sharing_and_preemption(target_lm):
    """Two sequences with one prompt (its full blocks shared through the prefix cache) decode with random trees in
    turns, in a pool too small for both: preempted rounds are resent, and both outputs stay the target's."""
    from specdec.errors import SequencePreemptedError

    probe = ModelRunner(target_lm, 256, role="target")
    per_token = probe.kv.key_data[:, :, 0].numel() * probe.kv.key_data.element_size() * 2
    runner = ModelRunner(target_lm, 256, role="target", batch_invariant=True, enable_prefix_caching=True,
                         block_size=16, kv_cache_memory=per_token * 16 * 9)  # 9 blocks: 144 tokens
    worker = TargetWorker(runner)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    prompt = PROMPT * 4  # 48 tokens: 3 full blocks, shared
    reference = TargetWorker(_runner(target_lm))
    truth: list[int] = []
    while len(truth) < 40:
        truth.append(reference.verify("t", prompt + truth, Proposal([]), params).next_token_id)
    rng = random.Random(5)
    outs = {"a": [], "b": []}
    preempted = 0
    while any(len(o) < 40 for o in outs.values()):
        for sid, out in outs.items():
            if len(out) >= 40:
                continue
            parents, drafts = _random_tree(rng, truth[len(out):], rng.randint(1, 9))
            try:
                result = worker.verify(sid, prompt + out, Proposal(drafts, parents=parents), params)
            except SequencePreemptedError:
                preempted += 1
                continue
            out += result.emitted(drafts)
    assert outs["a"][:40] == truth[:40] and outs["b"][:40] == truth[:40]
    assert preempted > 0 or runner.kv.preemptions > 0, "the pool never ran short: the test did not test preemption"


def test_a_batch_of_trees_is_cut_to_the_rows_one_tree_has_alone(target_lm):
    """Two sequences' trees of 15 nodes (2 x 16 rows: two tiles) share one 16-row tile: each keeps its first 7
    nodes, the output stays the target's, and the pass holds 16 rows. A tree alone keeps all 15."""
    worker = _TargetWorker(_runner(target_lm, batch_invariant=True))
    assert worker.tree_tile_rows == 16  # a CPU's batch-invariant tile
    params = SamplingParams(temperature=0.0, max_tokens=64)
    truth = _alone(worker, params, 8)
    for sid in ("a", "b", "solo"):  # the prompts in the caches: the next pass feeds one history token each
        worker.verify(sid, list(PROMPT), Proposal([]), params)
    history = list(PROMPT) + truth[:1]
    parents = [-1, 0, 1, 2] + [-1] * 11  # the likeliest first: a chain of truth[1:5], then 11 other roots
    drafts = truth[1:5] + [truth[1] + 1 + i for i in range(11)]
    rows = []
    original = worker.runner.forward_batch

    def counting(seqs, feeds, *args, **kw):
        rows.append(sum(len(f) for f in feeds))
        return original(seqs, feeds, *args, **kw)

    worker.runner.forward_batch = counting
    calls = [VerifyCall(sid, history, Proposal(drafts, parents=parents), params) for sid in ("a", "b")]
    results = worker.verify_batch(calls)
    assert rows == [16]  # 2 history rows + 7 nodes each
    for r in results:
        assert r.accepted_path == [0, 1, 2, 3] and r.next_token_id == truth[5]
    alone = worker.verify("solo", history, Proposal(drafts, parents=parents), params)
    assert rows[-1] == 16 and alone.accepted_path == [0, 1, 2, 3]  # 1 + 15: the whole tree
    whole = _TargetWorker(_runner(target_lm, batch_invariant=True), tree_tile_rows=-1)
    for sid in ("a", "b"):
        whole.verify(sid, list(PROMPT), Proposal([]), params)
    whole.runner.forward_batch = counting
    whole.verify_batch(calls)
    assert rows[-1] == 32  # never cut: two tiles
