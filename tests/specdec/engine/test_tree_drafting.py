"""Token trees from a draft model (specdec.engine.tree_drafting): the tree is the draft's top-k candidates grown by
cumulative log-probability, its cache is cut back to the history after each round, and the pair's output is the
target alone's, greedy and seeded, alone and in the suffix hybrid; a tree verifies more tokens per pass than the
draft's chain on the same requests."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.engine.runner import ModelRunner
from specdec.engine.models import load_model
from specdec.engine.workers import DraftWorker
from specdec.config import TreeShape
from specdec.trees import depths

pytestmark = pytest.mark.usefixtures("cached_model_loading")

PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    return", "Once upon a time"]


def test_the_tree_is_the_drafts_top_k_grown_by_confidence(good_draft_dir):
    lm = load_model(str(good_draft_dir), dtype="float32")
    runner = ModelRunner(lm, 256, role="draft", enable_prefix_caching=False, quantization="none")
    worker = DraftWorker(runner, tree=TreeShape(top_k=3, max_nodes=7))
    history = [1, 504, 2830, 6354, 17, 4, 280]
    params = SamplingParams(temperature=0)
    proposal = worker.propose("s", history, 3, params)
    assert proposal.parents is not None and len(proposal.draft_token_ids) == 7
    assert runner.sequences["s"].length == len(history)  # the fed nodes' entries are gone
    with torch.inference_mode():
        logits = lm.model(torch.tensor([history])).logits[0, -1]
    top = torch.log_softmax(logits, -1).topk(3)
    roots = [t for t, p in zip(proposal.draft_token_ids, proposal.parents) if p == -1]
    assert roots == top.indices.tolist()  # the root's children: the top 3, the likeliest first
    assert max(depths(proposal.parents)) <= 2
    # each child of the likeliest root child is among the draft's top 3 after it
    first = proposal.draft_token_ids[0]
    kids = [t for t, p in zip(proposal.draft_token_ids, proposal.parents) if p == 0]
    with torch.inference_mode():
        after = lm.model(torch.tensor([history + [first]])).logits[0, -1]
    assert kids and set(kids) <= set(after.topk(3).indices.tolist())
    # a chain worker on the same runner drafts the argmax path: the tree's first branch
    chain = DraftWorker(runner).propose("c", history, 3, params)
    assert chain.draft_token_ids[0] == first


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                    SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_model_trees_are_lossless_and_verify_more_per_pass(target_dir, good_draft_dir, params):
    alone = LLM(str(target_dir), dtype="float32").generate(PROMPTS, params)
    chain_cfg = {"model": str(good_draft_dir), "num_speculative_tokens": 3}
    chains = LLM(str(target_dir), dtype="float32", speculative_config=chain_cfg).generate(PROMPTS, params)
    trees = LLM(str(target_dir), dtype="float32",
                speculative_config={**chain_cfg, "speculative_token_tree": "dynamic", "speculative_eagle_topk": 3,
                                    "speculative_num_draft_tokens": 12}).generate(PROMPTS, params)
    for a, c, t in zip(alone, chains, trees):
        assert c.outputs[0].token_ids == a.outputs[0].token_ids == t.outputs[0].token_ids
    per_pass = [sum(len(o.outputs[0].token_ids) for o in outs) / sum(o.spec_decode_stats.num_target_passes for o in outs)
                for outs in (chains, trees)]
    assert per_pass[1] >= per_pass[0], per_pass


def test_hybrid_with_trees_is_lossless(target_dir, good_draft_dir):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = LLM(str(target_dir), dtype="float32").generate(PROMPTS, params)
    llm = LLM(str(target_dir), dtype="float32",
              speculative_config={"method": "suffix", "model": str(good_draft_dir), "num_speculative_tokens": 8,
                                  "draft_model_num_speculative_tokens": 1, "speculative_token_tree": "dynamic"})
    for a, t in zip(alone, llm.generate(PROMPTS, params)):
        assert t.outputs[0].token_ids == a.outputs[0].token_ids


def test_tree_keys_are_checked(target_dir, good_draft_dir):
    from specdec.errors import ConfigError

    base = {"model": str(good_draft_dir), "speculative_token_tree": "dynamic"}
    with pytest.raises(ConfigError, match="speculative_eagle_topk must be an integer"):
        LLM(str(target_dir), speculative_config={**base, "speculative_eagle_topk": 0})
    with pytest.raises(ConfigError, match="speculative_num_draft_tokens must be an integer"):
        LLM(str(target_dir), speculative_config={**base, "speculative_num_draft_tokens": 40})
    with pytest.raises(ConfigError, match="tli_proposals \"intersection\""):  # text proposals: chains only
        LLM(str(target_dir), speculative_config={**base, "use_heterogeneous_vocab": True})


STATIC = "[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"


def test_a_static_shape_is_the_drafts_ranks(good_draft_dir):
    """vLLM's static speculative_token_tree: node (0, 1) is the draft's second likeliest token after its likeliest."""
    from specdec.config import parse_token_tree

    lm = load_model(str(good_draft_dir), dtype="float32")
    runner = ModelRunner(lm, 256, role="draft", enable_prefix_caching=False, quantization="none")
    worker = DraftWorker(runner, tree=TreeShape(static=parse_token_tree(STATIC)))
    history = [1, 504, 2830, 6354, 17, 4, 280]
    proposal = worker.propose("s", history, 3, SamplingParams(temperature=0))
    assert proposal.parents == [-1, -1, 0, 0, 1, 2]  # (0,) (1,) (0,0) (0,1) (1,0) (0,0,0)
    assert runner.sequences["s"].length == len(history)

    def top(tokens, r):
        with torch.inference_mode():
            return int(lm.model(torch.tensor([tokens])).logits[0, -1].topk(r + 1).indices[r])

    t = proposal.draft_token_ids
    assert t[0] == top(history, 0) and t[1] == top(history, 1)
    assert t[2] == top(history + [t[0]], 0) and t[3] == top(history + [t[0]], 1)
    assert t[4] == top(history + [t[1]], 0) and t[5] == top(history + [t[0], t[2]], 0)
    # a round of depth 2 (num_speculative_tokens 2) stops at the shape's second level
    assert len(worker.propose("u", history, 2, SamplingParams(temperature=0)).draft_token_ids) == 5


def test_a_static_shape_is_lossless(target_dir, good_draft_dir):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = LLM(str(target_dir), dtype="float32").generate(PROMPTS, params)
    llm = LLM(str(target_dir), dtype="float32", speculative_config={
        "model": str(good_draft_dir), "num_speculative_tokens": 3, "speculative_token_tree": STATIC})
    for a, t in zip(alone, llm.generate(PROMPTS, params)):
        assert t.outputs[0].token_ids == a.outputs[0].token_ids


def test_trees_with_overlap_and_without_the_lean_forward(target_dir, good_draft_dir):
    """Overlapped drafting never bets on a tree (a lookahead that drafted one is dropped); a draft on transformers'
    forward drafts chains (tree passes need the lean forward), and says so."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # the suffix hybrid: a suffix round's chain starts a lookahead, which the model may answer with a tree
    llm = LLM(str(target_dir), dtype="float32",
              speculative_config={"method": "suffix", "model": str(good_draft_dir), "num_speculative_tokens": 6,
                                  "draft_model_num_speculative_tokens": 1, "overlap": True,
                                  "speculative_token_tree": "dynamic"})
    repeating = ["x. a b c d. x. a b c d. x. a b c d. x. a b"] + PROMPTS
    alone = LLM(str(target_dir), dtype="float32").generate(repeating, params)
    outs = llm.generate(repeating, params) + llm.generate(repeating, params)
    for a, t in zip(alone + alone, outs):
        assert t.outputs[0].token_ids == a.outputs[0].token_ids
    assert sum(o.spec_decode_stats.num_lookaheads for o in outs) > 0  # lookaheads ran (and trees were dropped)
    lm = load_model(str(good_draft_dir), dtype="float32")
    worker = DraftWorker(ModelRunner(lm, 256, role="draft", lean_forward=False), tree=TreeShape())
    assert worker.tree is None
    assert worker.propose("s", [1, 504, 2830], 2, SamplingParams(temperature=0)).parents is None
