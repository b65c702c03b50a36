"""specdec/engine/runner.py over the KV block pool: prefix caching, a budget with preemption, no block leaks.

Every check compares against a runner that shares nothing (prefix caching off, a big budget): sharing and
preemption may change what is computed, never what comes out."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.kv_cache import KVPool
from specdec.engine.runner import ModelRunner
from specdec.engine.workers import TargetWorker
from specdec.errors import InvalidRequestError, SequencePreemptedError
from specdec.proposal import Proposal
from specdec.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("cached_model_loading")
BS = 16


def _ids(n, seed=0):
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _budget(lm, blocks: int) -> int:
    cfg = lm.model.config
    per_token = KVPool.bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                       cfg.hidden_size // cfg.num_attention_heads, lm.dtype)
    return per_token * BS * blocks


def _greedy(runner: ModelRunner, sid: str, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding by the runner alone, resending the history on preemption as the gateway does."""
    tokens = list(prompt)
    for _ in range(steps):
        while True:
            seq = runner.get_or_create(sid, seed=0)
            try:
                logits = runner.forward(seq, runner.sync(seq, tokens))
                break
            except SequencePreemptedError:
                continue
        tokens.append(int(logits[-1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("lean", [True, False])
def test_a_shared_prefix_is_computed_once_and_gives_the_same_output(target_lm, lean):
    system = _ids(40, 1)
    cached = ModelRunner(target_lm, 256, role="target", lean_forward=lean)
    plain = ModelRunner(target_lm, 256, role="target", lean_forward=lean, enable_prefix_caching=False)
    first = _greedy(cached, "a", system + _ids(5, 2), 6)
    cached.release("a")
    seq = cached.get_or_create("b", seed=0)
    question = system + _ids(7, 3)
    fed = cached.sync(seq, question)
    assert fed == question[32:]  # two full blocks of the system prompt came from the cache
    assert seq.blocks[:2] and cached.kv_stats().prefix_cache_hits == 32
    cached.release("b")
    for runner in (cached, plain):
        assert _greedy(runner, "c", question, 8) == _greedy(plain, f"ref-{id(runner)}", question, 8)
    assert first == _greedy(plain, "d", system + _ids(5, 2), 6)
    for runner in (cached, plain):
        for sid in list(runner.sequences):
            runner.release(sid)
        runner.kv.blocks.check()
        assert runner.kv.blocks.num_used == 0


def test_two_live_sequences_share_blocks_and_rollback_never_writes_a_shared_block(target_lm):
    runner = ModelRunner(target_lm, 256, role="target")
    plain = ModelRunner(target_lm, 256, role="target", enable_prefix_caching=False)
    prefix = _ids(48, 4)
    a = runner.get_or_create("a", seed=0)
    runner.forward(a, runner.sync(a, prefix + [5]))
    runner.sync(a, prefix + [5, 6])  # confirms a's blocks: they go into the prefix cache
    b = runner.get_or_create("b", seed=0)
    runner.sync(b, prefix + [9, 9])
    assert b.blocks[:3] == a.blocks[:3] and runner.kv.blocks.refs[a.blocks[0]] == 2
    # b's history changes inside a shared block: b gets its own copy; a reads what it read before
    fed = runner.sync(b, prefix[:40] + [1, 2, 3])
    assert fed == [*prefix[32:40], 1, 2, 3] and b.blocks[:2] == a.blocks[:2] and len(b.blocks) == 2
    got_b = runner.forward(b, fed)
    got_a = runner.forward(a, runner.sync(a, prefix + [5, 6]))
    ref = plain.get_or_create("x", seed=0)
    torch.testing.assert_close(got_b, plain.forward(ref, plain.sync(ref, prefix[:40] + [1, 2, 3])), rtol=1e-4, atol=1e-4)
    plain.release("x")
    ref = plain.get_or_create("y", seed=0)
    torch.testing.assert_close(got_a, plain.forward(ref, plain.sync(ref, prefix + [5, 6])), rtol=1e-4, atol=1e-4)
    runner.release("a")
    runner.release("b")
    runner.kv.blocks.check()
    assert runner.kv.blocks.num_used == 0


def test_a_full_pool_preempts_the_youngest_and_no_output_changes(target_lm):
    """A pool of 6 blocks (96 tokens) and three sequences growing to 40 tokens each: the youngest is
    preempted (its blocks freed), comes back with its history, and every output equals a big pool's."""
    small = ModelRunner(target_lm, 256, role="target", kv_cache_memory=_budget(target_lm, 6))
    big = ModelRunner(target_lm, 256, role="target")
    assert small.cache.capacity_tokens == 96
    prompts = [_ids(30, 10 + i) for i in range(3)]
    want = [_greedy(big, str(i), p, 10) for i, p in enumerate(prompts)]
    tokens = [list(p) for p in prompts]
    preempted = 0
    for _ in range(10):
        seqs = [small.get_or_create(str(i), seed=0) for i in range(3)]
        news = [small.sync(s, t) for s, t in zip(seqs, tokens)]
        out = small.forward_batch(seqs, news, [1, 1, 1])
        for i, o in enumerate(out):
            if isinstance(o, SequencePreemptedError):
                preempted += 1
                assert str(i) not in small.sequences
                continue
            tokens[i].append(int(o[-1].argmax()))
        small.kv.blocks.check()
    assert preempted and small.kv_stats().preemptions >= preempted
    # the oldest sequences were never preempted and finished; the rest finish after them
    for i in range(3):
        while len(tokens[i]) < 40:
            tokens[i] += _greedy(small, str(i), tokens[i], 1)
        assert tokens[i][30:] == want[i]
    for sid in list(small.sequences):
        small.release(sid)
    small.kv.blocks.check()
    assert small.kv.blocks.num_used == 0


def test_a_sequence_that_could_never_fit_is_refused(target_lm):
    runner = ModelRunner(target_lm, 256, role="target", kv_cache_memory=_budget(target_lm, 2))
    seq = runner.get_or_create("s", seed=0)
    with pytest.raises(InvalidRequestError, match="can never fit"):
        runner.forward(seq, runner.sync(seq, _ids(40)))
    assert runner.kv.blocks.num_used == 0


def test_verify_rows_the_pool_cannot_hold_are_preempted_and_the_rest_verified(target_lm):
    runner = ModelRunner(target_lm, 256, role="target", kv_cache_memory=_budget(target_lm, 3))
    worker = TargetWorker(runner)
    params = SamplingParams(temperature=0)
    old = worker.verify("old", _ids(30, 1), Proposal([1]), params)  # 31 tokens: 2 blocks
    from specdec.calls import VerifyCall

    results = worker.verify_batch([VerifyCall("old", _ids(30, 1) + [old.emitted([1])[-1]], Proposal([2, 3]), params),
                                   VerifyCall("new", _ids(20, 2), Proposal([4]), params)])
    assert not isinstance(results[0], BaseException)
    assert isinstance(results[1], SequencePreemptedError) and "new" not in runner.sequences
    runner.kv.blocks.check()


def test_prompt_logprobs_score_every_position_even_when_the_prefix_is_cached(target_lm):
    runner = ModelRunner(target_lm, 256, role="target")
    worker = TargetWorker(runner)
    prompt = _ids(40, 5)
    worker.verify("a", prompt, Proposal([]), SamplingParams(temperature=0))
    runner.release("a")
    res = worker.verify("b", prompt, Proposal([]), SamplingParams(temperature=0, prompt_logprobs=1))
    assert len(res.prompt_logprobs) == len(prompt) - 1


def test_a_long_prompt_is_prefilled_in_chunks_beside_short_rows_with_the_same_logits(target_lm):
    from specdec.calls import UNFINISHED

    runner = ModelRunner(target_lm, 256, role="target", max_num_batched_tokens=40)
    plain = ModelRunner(target_lm, 256, role="target")
    short, long = _ids(10, 7), _ids(100, 8)
    s = runner.get_or_create("short", seed=0)
    runner.forward(s, runner.sync(s, short))
    short = short + [3]
    l_seq = runner.get_or_create("long", seed=0)
    passes = 0
    while True:
        out = runner.forward_batch([s, l_seq], [runner.sync(s, short), runner.sync(l_seq, long)], [1, 1],
                                   chunkable=[True, True])
        passes += 1
        assert isinstance(out[0], torch.Tensor)  # the short row is answered every pass
        short = short + [int(out[0][-1].argmax())]
        if out[1] is not UNFINISHED:
            break
        assert l_seq.length < len(long)
    assert passes == 3 and l_seq.length == len(long)  # 39 + 39 + 22 tokens beside one each for the short row
    ref = plain.get_or_create("long", seed=0)
    torch.testing.assert_close(out[1], plain.forward(ref, plain.sync(ref, long)), rtol=1e-4, atol=1e-4)
