"""The EAGLE-3 draft worker: what it feeds, what it drafts, what it keeps, and what it says it lacks."""

from __future__ import annotations

import pytest
import torch

from specdec.calls import ProposeCall
from specdec.engine.eagle3_worker import Eagle3Worker, HeadStore
from specdec.errors import InvalidRequestError
from specdec.features import FeatureChunk
from specdec.sampling_params import SamplingParams
from tests.specdec.engine.test_eagle3 import _random_head

GREEDY = SamplingParams(temperature=0)


def _chunk(feats: torch.Tensor, start: int, end: int) -> FeatureChunk:
    return FeatureChunk(start, end - start, feats.shape[1], "float32", feats[start:end])


def _wire(chunk: FeatureChunk) -> FeatureChunk:
    data = chunk.data.to(torch.bfloat16)
    return FeatureChunk(chunk.start, chunk.rows, chunk.width, "bfloat16", data.view(torch.int16).numpy().tobytes())


@pytest.fixture
def setup():
    head = _random_head()
    torch.manual_seed(1)
    return Eagle3Worker(HeadStore(head, max_model_len=64)), torch.randint(0, 300, (40,)).tolist(), torch.randn(40, 96)


def _propose(worker, ids, chunks, k=3, sid="s"):
    (result,) = worker.propose_batch([ProposeCall(sid, ids, k, GREEDY, features=chunks)])
    if isinstance(result, BaseException):
        raise result
    return result


def test_drafts_need_the_features_up_to_the_last_position(setup):
    worker, ids, feats = setup
    first = _propose(worker, ids[:10], [])
    assert first.draft_token_ids == [] and first.features_from == 0  # the prompt's features come from the target
    partial = _propose(worker, ids[:10], [_chunk(feats, 0, 6)])
    assert partial.draft_token_ids == [] and partial.features_from == 6  # took what came, asks for the rest
    full = _propose(worker, ids[:10], [_chunk(feats, 6, 9)])
    assert len(full.draft_token_ids) == 3 and full.features_from == 9
    assert all(t % 3 == 0 for t in full.draft_token_ids)  # target ids of the draft vocabulary (d2t)


def test_drafted_entries_never_outlive_the_round(setup):
    """The same history proposes the same drafts again; the cache holds only target-feature positions; a round
    fed all at once drafts what one fed in pieces does."""
    worker, ids, feats = setup
    a = _propose(worker, ids[:20], [_chunk(feats, 0, 19)])
    assert worker.runner.sequences["s"].cache.length == 19
    assert _propose(worker, ids[:20], []).draft_token_ids == a.draft_token_ids
    _propose(worker, ids[:8], [_chunk(feats, 0, 7)], sid="t")
    b = _propose(worker, ids[:20], [_chunk(feats, 7, 19)], sid="t")
    assert b.draft_token_ids == a.draft_token_ids
    # wire form (bf16 bytes) and tensors draft alike on this head (bf16 rounding of the features only)
    c = _propose(worker, ids[:20], [_wire(_chunk(feats, 0, 19))], sid="u")
    assert c.features_from == 19 and len(c.draft_token_ids) == 3


def test_a_changed_history_drops_what_it_changed(setup):
    worker, ids, feats = setup
    _propose(worker, ids[:20], [_chunk(feats, 0, 19)])
    other = ids[:12] + [(t + 1) % 300 for t in ids[12:20]]
    # position p used token p + 1: positions up to 10 stay, the rest needs features again
    result = _propose(worker, other, [])
    assert result.draft_token_ids == [] and result.features_from == 11


def test_a_restarted_draft_asks_from_zero(setup):
    """A draft that lost the sequence (restart, eviction) is sent only the newest features: it asks from 0."""
    worker, ids, feats = setup
    result = _propose(worker, ids[:30], [_chunk(feats, 20, 29)])
    assert result.draft_token_ids == [] and result.features_from == 0


def test_bad_features_are_refused(setup):
    worker, ids, feats = setup
    with pytest.raises(InvalidRequestError, match="width"):
        _propose(worker, ids[:10], [FeatureChunk(0, 9, 50, "float32", torch.zeros(9, 50))])
    with pytest.raises(InvalidRequestError, match="bytes"):
        _propose(worker, ids[:10], [FeatureChunk(0, 9, 96, "bfloat16", b"\0" * 10)])
    with pytest.raises(InvalidRequestError, match="dtype"):
        _propose(worker, ids[:10], [FeatureChunk(0, 9, 96, "int8", b"\0" * 864)])
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        _propose(worker, list(range(63)), [], k=4)


def _path_logits(worker, sid: str, ids: list[int], path: list[int]) -> torch.Tensor:
    """The head's target logits after ``ids`` then ``path``, fed one token at a time as a chain drafts them."""
    head, seq = worker.head, worker.runner.sequences[sid]
    logits, prenorm = seq.last
    with torch.inference_mode():  # (as the worker drafts: the cache holds inference tensors)
        for i, token in enumerate(path):
            out, hidden = head.step(torch.tensor([token]), prenorm[None], torch.tensor([len(ids) - 1 + i]), seq.cache)
            logits, prenorm = out[0], hidden[0]
        seq.cache.truncate(seq.consumed)
        return head.to_target_logits(logits)


def test_a_heads_tree_is_its_top_k_grown_by_confidence(setup):
    """Every node of the head's tree is among the top-k tokens the head gives after its path fed as a chain (the
    tree pass's mask, positions and parent features are the chain's); a tree of one child per node is the chain;
    the likeliest node comes first and its entries go after the round."""
    from specdec.config import TreeShape
    from specdec.trees import path_to

    worker, ids, feats = setup
    chain = _propose(worker, ids[:20], [_chunk(feats, 0, 19)], k=4)
    tree_worker = Eagle3Worker(worker.runner, tree=TreeShape(top_k=3, max_nodes=12))
    tree = _propose(tree_worker, ids[:20], [], k=4)
    assert tree.is_tree and len(tree.draft_token_ids) == 12 and tree.features_from == 19
    assert worker.runner.sequences["s"].cache.length == 19
    assert tree.parents[0] == -1 and tree.draft_token_ids[0] == chain.draft_token_ids[0]
    for node, token in enumerate(tree.draft_token_ids):
        parent = tree.parents[node]
        before = [tree.draft_token_ids[i] for i in path_to(tree.parents, parent)] if parent >= 0 else []
        top = _path_logits(worker, "s", ids[:20], before).topk(3).indices.tolist()
        assert token in top, (node, before)
    one = Eagle3Worker(worker.runner, tree=TreeShape(top_k=1, max_nodes=4))
    assert _propose(one, ids[:20], [], k=4).draft_token_ids == chain.draft_token_ids


def test_a_wrong_tree_mask_would_show(setup):
    """Negative control for the test above: a node fed attending to its sibling (the chain's causal mask over the
    level) gives other logits than its path fed as a chain."""
    worker, ids, feats = setup
    _propose(worker, ids[:20], [_chunk(feats, 0, 19)], k=1)
    head, seq = worker.head, worker.runner.sequences["s"]
    logits, prenorm = seq.last
    roots = head.to_target_logits(logits).topk(2).indices.tolist()
    with torch.inference_mode():
        wrong, _ = head.step(torch.tensor(roots), torch.stack([prenorm, prenorm]), torch.tensor([19, 19]), seq.cache)
        seq.cache.truncate(seq.consumed)
    right = _path_logits(worker, "s", ids[:20], [roots[1]])
    assert not torch.allclose(head.to_target_logits(wrong[1]), right, atol=1e-4)  # causal: saw its sibling


def test_absorbed_features_wait_for_the_next_draft_and_follow_a_changed_history(setup):
    """A hybrid's suffix rounds hand the head their features without drafting: they are held (the head says it
    has them) and fed in one pass when the head next drafts, which then drafts what a head fed every round does.
    A rollback drops the held features of the positions it changed."""
    worker, ids, feats = setup
    _propose(worker, ids[:8], [_chunk(feats, 0, 7)])
    (held,) = worker.absorb([ProposeCall("s", ids[:12], 3, GREEDY, features=[_chunk(feats, 7, 11)])])
    (held2,) = worker.absorb([ProposeCall("s", ids[:16], 3, GREEDY, features=[_chunk(feats, 11, 15)])])
    seq = worker.runner.sequences["s"]
    assert (held, held2) == (11, 15) and seq.consumed == 7 and seq.held_rows == 8  # held, not fed
    late = _propose(worker, ids[:20], [_chunk(feats, 15, 19)])
    assert seq.consumed == 19 and seq.held == [] and late.features_from == 19
    assert late.draft_token_ids == _propose(worker, ids[:20], [_chunk(feats, 0, 19)], sid="t").draft_token_ids
    # held features from a changed token on are dropped: positions 7-11 stay (position p's feature read tokens up to p)
    _propose(worker, ids[:8], [_chunk(feats, 0, 7)], sid="u")
    worker.absorb([ProposeCall("u", ids[:16], 3, GREEDY, features=[_chunk(feats, 7, 15)])])
    other = ids[:12] + [(t + 1) % 300 for t in ids[12:20]]
    (back,) = worker.absorb([ProposeCall("u", other, 3, GREEDY, features=[])])
    assert back == 12 and worker.runner.sequences["u"].consumed == 7
