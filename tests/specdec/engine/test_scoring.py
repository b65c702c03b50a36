"""specdec/engine/scoring.py: prompt logprobs read a chunk of rows at a time, the same numbers, and what cannot
be bounded refused with a 400 instead of running out of memory."""

from __future__ import annotations

import pytest
import torch

from specdec import sampling
from specdec.engine import scoring
from specdec.engine.runner import ModelRunner
from specdec.engine.workers import TargetWorker
from specdec.errors import InvalidRequestError
from specdec.proposal import Proposal
from specdec.sampling import SamplingParams, token_logprobs

pytestmark = pytest.mark.usefixtures("cached_model_loading")
VOCAB = 49152


def _ids(n, seed=0):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _scored(lm, prompt, draft, **runner_kwargs):
    worker = TargetWorker(ModelRunner(lm, 256, role="target", **runner_kwargs))
    return worker.verify("s", prompt, Proposal(draft), SamplingParams(temperature=0, logprobs=2, prompt_logprobs=3))


def test_chunked_prompt_logprobs_are_bit_identical_to_one_projection_of_every_row(target_lm, monkeypatch):
    prompt, draft = _ids(50, 1), _ids(3, 2)
    # today's computation: every position's logits from one pass, then logprobs over them
    runner = ModelRunner(target_lm, 256, role="target")
    assert runner.batch_invariant  # the CPU target's default: a row's numbers do not depend on the pass
    seq = runner.get_or_create("ref", seed=None)
    full = runner.forward(seq, prompt + draft, num_logits=len(prompt) + len(draft))  # [53, vocab] at once
    monkeypatch.setattr(sampling, "LOGPROBS_CHUNK_BYTES", 1 << 40)
    reference = token_logprobs(full[: len(prompt) - 1], prompt[1:], 3)

    whole = _scored(target_lm, prompt, draft)
    monkeypatch.setattr(sampling, "LOGPROBS_CHUNK_BYTES", 3 * 4 * VOCAB)  # 3 rows per chunk
    chunked = _scored(target_lm, prompt, draft)
    assert chunked.prompt_logprobs == whole.prompt_logprobs == reference  # exact floats, ids, top-3
    assert (chunked.num_accepted_tokens, chunked.logprobs) == (whole.num_accepted_tokens, whole.logprobs)
    assert len(chunked.prompt_logprobs) == len(prompt) - 1


def test_a_scored_prompt_reaches_the_lm_head_one_chunk_of_rows_at_a_time(target_lm, monkeypatch):
    monkeypatch.setattr(sampling, "LOGPROBS_CHUNK_BYTES", 4 * 4 * VOCAB)  # 4 rows per chunk
    runner = ModelRunner(target_lm, 256, role="target")
    rows_per_call = []
    project = runner.net.logits
    monkeypatch.setattr(runner.net, "logits", lambda h: rows_per_call.append(h.shape[0]) or project(h))
    prompt = _ids(40, 3)
    res = TargetWorker(runner).verify("s", prompt, Proposal(_ids(2, 4)), SamplingParams(temperature=0, prompt_logprobs=1))
    assert len(res.prompt_logprobs) == 39
    # 39 prompt rows in 10 chunks, plus the k + 1 = 3 rows the acceptance reads: never [prompt, vocab] at once
    assert max(rows_per_call) <= 4
    assert sum(rows_per_call) == 39 + 3


def test_a_scoring_pass_that_cannot_be_bounded_is_refused_as_invalid_argument(target_lm, monkeypatch):
    monkeypatch.setattr(scoring, "SCORING_PASS_MAX_BYTES", 64 << 20)
    prompt = _ids(200, 5)  # transformers' forward returns 200 x 49,152 fp32 logits (+ a copy): 75 MiB
    with pytest.raises(InvalidRequestError) as err:
        _scored(target_lm, prompt, [], lean_forward=False)
    assert err.value.param == "prompt_logprobs" and "200 tokens" in str(err.value)
    assert (err.value.grpc_code, err.value.http_status) == ("INVALID_ARGUMENT", 400)
    # the non-invariant CPU lean forward builds [group * 200, 200] SDPA masks: small, so it is served
    assert len(_scored(target_lm, prompt, [], batch_invariant=False).prompt_logprobs) == 199
    # the lean forward's logits are read in chunks: the same prompt is served
    assert len(_scored(target_lm, prompt, []).prompt_logprobs) == 199
    monkeypatch.setattr(scoring, "SCORING_PASS_MAX_BYTES", 256 << 10)  # masks of 2 x 200 x 200 x 5 B > 256 KiB
    with pytest.raises(InvalidRequestError):
        _scored(target_lm, prompt, [], batch_invariant=False)
