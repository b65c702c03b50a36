"""Greedy speculative decoding is token-identical to the target alone by construction, not by rounding luck.

The target here is built to have near-ties everywhere: its LM head's rows come in pairs a few ulps apart, so at
every position the top token has a twin whose logit differs by about the rounding error of a pass. With the
default passes (each product's kernel picked by its row count) a verify window of k + 1 tokens and a
one-token decode round the two logits differently, and speculative decoding picks the other twin of the pair
some of the time; with batch-invariant passes (``batch_invariant=True``, the default) every run matches the
target alone: solo and batched, k = 1 and 3."""

from __future__ import annotations

import copy

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.calls import ProposeCall, VerifyCall
from specdec.proposal import Proposal

pytestmark = pytest.mark.usefixtures("cached_model_loading")

PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    return", "Once upon a time", "1, 2, 3, 5, 8,",
           "The capital of France is", "import numpy as np\n"]
MAX_TOKENS = 48
TWIN_GAP = 2e-7  # the odd rows of the LM head: the even row + this much noise, relative to the head's scale


@pytest.fixture(scope="module")
def near_tie_dir(target_model, tokenizer, tmp_path_factory):
    from tests.conftest import _save

    model = copy.deepcopy(target_model)
    with torch.no_grad():
        w = model.lm_head.weight  # [vocab, hidden]
        noise = torch.randn(w[1::2].shape, generator=torch.Generator().manual_seed(5))
        w[1::2] = w[0::2] + TWIN_GAP * w.std() * noise
    return _save(model, tokenizer, tmp_path_factory.mktemp("near-tie"))


def _batched(llm: LLM, k: int) -> list[list[int]]:
    """Every prompt decoded at once, as the services batch them: each round one ``propose_batch`` and one
    ``verify_batch`` over every unfinished sequence, so each target pass holds all of them."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = {f"s{i}": llm._prompt_ids(p)[1] for i, p in enumerate(PROMPTS)}
    out: dict[str, list[int]] = {sid: [] for sid in prompts}
    while live := [sid for sid in prompts if len(out[sid]) < MAX_TOKENS]:
        history = {sid: prompts[sid] + out[sid] for sid in live}
        proposals = (llm._draft_worker.propose_batch([ProposeCall(sid, history[sid], k, params) for sid in live])
                     if k else [Proposal([]) for _ in live])
        ready = [(sid, p) for sid, p in zip(live, proposals) if isinstance(p, Proposal)]
        results = llm._target_worker.verify_batch([VerifyCall(sid, history[sid], p, params) for sid, p in ready])
        for (sid, p), r in zip(ready, results):
            if hasattr(r, "emitted"):  # else a prompt still being prefilled in chunks: again next round
                out[sid] += r.emitted(p.draft_token_ids)
    return [out[sid][:MAX_TOKENS] for sid in prompts]


def _runs(target: str, spec, invariant: bool) -> list[bool]:
    """For k = 1 and 3, solo and batched: whether each run's greedy tokens equal the target alone's."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in LLM(target, dtype="float32", batch_invariant=invariant).generate(
        PROMPTS, params)]  # one prompt after another, one token a pass
    same = []
    for k in (1, 3):
        llm = LLM(target, speculative_config=spec(target, k), dtype="float32", batch_invariant=invariant)
        solo = [llm.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]
        same += [a == b for a, b in zip(solo, alone)] + [a == b for a, b in zip(_batched(llm, k), alone)]
    return same


def test_the_target_has_near_ties(near_tie_dir):
    llm = LLM(str(near_tie_dir), dtype="float32")
    runner = llm._target_worker.runner
    seq = runner.get_or_create("probe", None)
    ids = llm.get_tokenizer().encode(" ".join(PROMPTS))
    logits = runner.forward(seq, ids, num_logits=len(ids))  # every position's
    top2 = logits.topk(2).values
    gaps = top2[:, 0] - top2[:, 1]
    assert float(gaps.max()) < 1e-4 * float(logits.abs().max())  # the top token's twin is always right behind


@pytest.mark.heavy
def test_speculative_greedy_equals_the_target_alone_with_batch_invariant_passes(near_tie_dir, spec):
    same = _runs(str(near_tie_dir), spec, invariant=True)
    assert all(same), f"{same.count(False)} of {len(same)} runs differ from the target alone"


@pytest.mark.heavy
def test_without_them_near_ties_flip_so_the_test_can_fail(near_tie_dir, spec):
    """The negative control: the default passes of earlier releases lose some runs on this target."""
    same = _runs(str(near_tie_dir), spec, invariant=False)
    assert not all(same)
