"""The offline ``LLM`` honours ``speculative_config["disable_by_batch_size"]`` as vLLM does: no speculation while
the requests enqueued and not finished number at least the threshold; it comes back as they finish. ``generate``
enqueues every sequence of its call (prompts x n) and runs them one after another, so with B and N sequences the
first N - B + 1 run as the target alone and the last B - 1 speculate. Greedy output is the target's either way."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    return", "Once upon a time", "import numpy as np\n"]
N = 12


@pytest.fixture(scope="module")
def alone(target_dir):
    llm = LLM(str(target_dir), dtype="float32")
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=N))]


def _drafted(target_dir, draft_dir, spec, **extra) -> tuple[list[int], list[list[int]]]:
    llm = LLM(str(target_dir), dtype="float32", speculative_config=spec(draft_dir, 3, **extra))
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=N))
    return ([o.outputs[0].spec_decode_stats.num_draft_tokens for o in outs], [o.outputs[0].token_ids for o in outs])


@pytest.mark.parametrize("threshold, speculating", [
    (None, [True, True, True, True]),  # the negative control: without the key every request drafts
    (2, [False, False, False, True]),  # 4, 3, 2 unfinished >= 2: off; the last one alone: on
    (3, [False, False, True, True]),
    (1, [False, False, False, False]),  # one request is already the threshold
    (5, [True, True, True, True]),  # never 5 unfinished
])
def test_speculation_is_off_while_the_unfinished_requests_reach_the_threshold(target_dir, good_draft_dir, spec,
                                                                             alone, threshold, speculating):
    extra = {} if threshold is None else {"disable_by_batch_size": threshold}
    drafted, token_ids = _drafted(target_dir, good_draft_dir, spec, **extra)
    assert [d > 0 for d in drafted] == speculating, drafted
    assert token_ids == alone  # lossless whether or not it drafts


def test_n_counts_each_sequence(target_dir, good_draft_dir, spec):
    """n > 1 enqueues n sequences per prompt: 1 prompt x n=3 with threshold 2 drafts only in the last sample."""
    llm = LLM(str(target_dir), dtype="float32", speculative_config=spec(good_draft_dir, 3, disable_by_batch_size=2))
    (out,) = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=N, n=3))
    assert [o.spec_decode_stats.num_draft_tokens > 0 for o in out.outputs] == [False, False, True]
