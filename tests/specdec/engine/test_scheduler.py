"""specdec.engine.scheduler: decode rows first, prompts in chunks under one token budget, chunks sized from
what passes measured; and the runner's passes under it (decode rows in every pass while a prompt prefills)."""

from __future__ import annotations

import pytest
import torch

from specdec.calls import UNFINISHED

from specdec.engine.runner import ModelRunner
from specdec.engine.scheduler import PREFILL_SHARE, PassScheduler, check_budget


def test_alone_a_prompt_takes_the_whole_budget():
    s = PassScheduler(512, 0, 1, block_size=16)
    assert s.plan([3000], [True], [1], decoding_elsewhere=False) == [512]
    assert s.plan([100, 200], [True, True], [1, 2], decoding_elsewhere=False) == [100, 200]  # short prompts whole


def test_decode_rows_first_then_one_chunk_of_the_oldest_prompt():
    s = PassScheduler(512, 48, 1, block_size=16)
    # verify rows (not chunkable) whole; the draft-style decode rows (chunkable, short) whole; one prompt's chunk
    assert s.plan([5, 3000, 2, 900], [False, True, True, True], [3, 1, 4, 2], decoding_elsewhere=False) == [5, 48, 2, 0]
    # another sequence is mid round trip: the prompt alone in the pass still gets only a chunk
    assert s.plan([3000], [True], [1], decoding_elsewhere=True) == [48]
    s2 = PassScheduler(512, 48, 2, block_size=16)
    assert s2.plan([1, 3000, 900], [False, True, True], [3, 2, 1], decoding_elsewhere=False) == [1, 48, 48]


def test_the_budget_is_never_exceeded_and_every_pass_progresses():
    s = PassScheduler(64, 48, 4, block_size=16)
    for feeds, chunkable in (([16] * 3 + [3000], [False] * 3 + [True]), ([10, 20, 30, 5000, 4000], [True] * 5),
                             ([1] * 60 + [900], [False] * 60 + [True])):
        take = s.plan(feeds, chunkable, list(range(len(feeds))), decoding_elsewhere=True)
        assert sum(take) <= 64 and all(0 <= t <= f for t, f in zip(take, feeds))
        assert all(t == f for t, f, c in zip(take, feeds, chunkable) if not c)  # decode rows never cut
    assert s.plan([70, 900], [False, True], [1, 2], decoding_elsewhere=True) == [70, 0]  # over budget: decode only
    assert s.plan([900], [True], [1], decoding_elsewhere=True) == [48]


def test_the_measured_chunk_costs_a_share_of_the_round_period():
    s = PassScheduler(512, 0, 1, block_size=16)
    assert s.prefill_chunk() == 64  # nothing measured: a small chunk
    s.note_pass(100, 0.25)  # 2.5 ms per token
    for _ in range(5):
        s.note_round(0.08)  # the decoding sequences' round period: 80 ms
    assert s.prefill_chunk() == int(PREFILL_SHARE * 0.08 / 0.0025) // 16 * 16 == 96
    s.note_round(5.0)  # an idle gap is no round period
    assert s.round_period() == pytest.approx(0.08)
    fast = PassScheduler(512, 0, 1, block_size=16)
    fast.note_pass(512, 0.01)
    fast.note_round(0.08)
    assert fast.prefill_chunk() == 512  # capped by the budget


@pytest.mark.parametrize("args", [(0, 0, 1), (512, -1, 1), (512, 0, 0)])
def test_bad_settings_name_the_flag(args):
    with pytest.raises(ValueError, match="--max-num|--long-prefill"):
        check_budget(*args)


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 500, (n,), generator=g).tolist()


def test_a_decoding_sequence_gets_a_row_in_every_pass_while_a_prompt_prefills(target_lm):
    """By count, not by time: every pass feeds the decoding sequence's token beside a chunk of the prompt, and
    the logits of both are the ones each gets alone."""
    runner = ModelRunner(target_lm, 512, role="target", long_prefill_token_threshold=32)
    plain = ModelRunner(target_lm, 512, role="target")
    short, long = _ids(10, 7), _ids(300, 8)
    s = runner.get_or_create("short", seed=0)
    runner.forward(s, runner.sync(s, short))
    p = plain.get_or_create("short", seed=0)
    plain.forward(p, plain.sync(p, short))
    l_seq = runner.get_or_create("long", seed=0)
    passes = 0
    while True:
        s = runner.get_or_create("short", seed=0)
        out = runner.forward_batch([s, l_seq], [runner.sync(s, short), runner.sync(l_seq, long)], [1, 1],
                                   chunkable=[True, True])
        passes += 1
        assert isinstance(out[0], torch.Tensor)  # the decoding row is answered every pass
        torch.testing.assert_close(out[0], plain.forward(p, plain.sync(p, short)), rtol=1e-4, atol=1e-4)
        short = short + [int(out[0][-1].argmax())]
        if out[1] is not UNFINISHED:
            break
        assert l_seq.prefilling and runner.cache.decoding() == 1  # the prompt is not counted as decoding
    # chunks of the threshold; batch-invariant (16-row tiles): grown to fill the pass's last tile (1 + 47 rows)
    chunk = 47 if runner.batch_invariant else 32
    assert passes == -(-300 // chunk)
    ref = plain.get_or_create("long", seed=0)
    torch.testing.assert_close(out[1], plain.forward(ref, plain.sync(ref, long)), rtol=1e-4, atol=1e-4)
    assert not l_seq.prefilling and runner.cache.decoding() == 2


def test_a_chunk_beside_decode_rows_fills_the_passs_last_tile():
    s = PassScheduler(512, 16, 1, block_size=16, row_multiple=16)
    assert s.plan([2, 3000], [False, True], [2, 1], decoding_elsewhere=False) == [2, 30]  # 32 rows: 2 tiles
    assert s.plan([16, 3000], [False, True], [2, 1], decoding_elsewhere=False) == [16, 16]
    assert s.plan([3000], [True], [1], decoding_elsewhere=False) == [512]  # alone: the budget
    tight = PassScheduler(20, 16, 1, block_size=16, row_multiple=16)
    assert tight.plan([2, 3000], [False, True], [2, 1], decoding_elsewhere=False) == [2, 16]  # never past the budget


def test_preemption_and_prefill_follow_priority_then_arrival(target_lm):
    """A pool of 6 blocks: the oldest sequence has the lowest priority (5); when a new one needs blocks, it is the
    one preempted, not the youngest. And of two prompts over the budget, the higher priority is fed first."""
    from tests.specdec.engine.test_runner import _budget

    small = ModelRunner(target_lm, 256, role="target", kv_cache_memory=_budget(target_lm, 6))
    low = small.get_or_create("low", seed=0, priority=5)
    small.forward(low, small.sync(low, _ids(40, 1)))  # 3 blocks
    high = small.get_or_create("high", seed=0)
    small.forward(high, small.sync(high, _ids(40, 2)))  # 3 blocks: the pool is full
    new = small.get_or_create("new", seed=0)
    small.forward(new, small.sync(new, _ids(20, 3)))
    assert "low" not in small.sequences and {"high", "new"} <= set(small.sequences)
    assert small.kv_stats().preemptions == 1
    runner = ModelRunner(target_lm, 512, role="target", long_prefill_token_threshold=16)
    a = runner.get_or_create("a", seed=0, priority=1)  # arrived first
    b = runner.get_or_create("b", seed=0, priority=0)
    out = runner.forward_batch([a, b], [runner.sync(a, _ids(400, 4)), runner.sync(b, _ids(400, 5))], [1, 1],
                               chunkable=[True, True])
    # 800 tokens over a budget of 512: b (priority 0) is fed whole, a (arrived first) gets what is left
    assert out[0] is UNFINISHED and isinstance(out[1], torch.Tensor) and (a.length, b.length) == (112, 400)
