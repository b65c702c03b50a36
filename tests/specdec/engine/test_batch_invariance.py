"""Batch-invariant passes (``ModelRunner(batch_invariant=True)``): a position's logits are bitwise the same
whatever the pass holds: 1, 2, 5 or 8 new tokens, alone or batched with 2 or 7 other sequences of other
context lengths, at any place in the batch, the prompt whole or in chunks. The same checks on the default
passes find differing bits (the negative control), so the equality is the setting's doing."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.models import load_model
from specdec.engine.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("cached_model_loading")
VOCAB = 49152


def _ids(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPT, CONT = _ids(37, 1), _ids(24, 2)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def lm(request, target_dir):
    return load_model(str(target_dir), dtype=request.param)


def _runner(lm, invariant, quantization="none", **kw):
    return ModelRunner(lm, 512, role="target", batch_invariant=invariant, enable_prefix_caching=False,
                       quantization=quantization, **kw)


def _alone(lm, invariant, quantization="none"):
    """The logits of each position of CONT by target-alone decoding: the prompt, then one token a pass."""
    r = _runner(lm, invariant, quantization)
    seq = r.get_or_create("a", None)
    out = [r.forward(seq, PROMPT)[-1]]
    out += [r.forward(seq, [t])[-1] for t in CONT[:-1]]
    return torch.stack(out)


def _in_company(lm, invariant, n, batch, place=0, chunk=None, quantization="none"):
    """The same positions scored n tokens a pass, the sequence at ``place`` in a batch of ``batch`` whose
    other sequences have other context lengths and feed 1-3 tokens each pass; ``chunk``: the prompt is
    prefilled in chunks of at most that many tokens (max_num_batched_tokens)."""
    kw = {"max_num_batched_tokens": chunk} if chunk else {}
    r = _runner(lm, invariant, quantization, **kw)
    others = [r.get_or_create(f"o{i}", None) for i in range(batch - 1)]
    for i, o in enumerate(others):
        r.forward(o, _ids(5 + 23 * i, 10 + i))
    seq = r.get_or_create("a", None)
    while True:  # chunked prefill: a row comes back unfinished until the prompt is in
        (first,) = r.forward_batch([seq], [PROMPT[seq.length:]], [1], chunkable=[True])
        if isinstance(first, torch.Tensor):
            break
    out = [first[-1]]
    feed = CONT[:-1]
    for pos in range(0, len(feed), n):
        new = feed[pos: pos + n]
        seqs, news = list(others), [_ids(1 + (i + pos) % 3, 100 + pos + i) for i in range(batch - 1)]
        seqs.insert(place, seq)
        news.insert(place, new)
        logits = r.forward_batch(seqs, news, [len(x) for x in news])
        out += list(logits[place])
    return torch.stack(out)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
@pytest.mark.parametrize("batch, place", [(1, 0), (3, 1), (8, 7)])
def test_logits_are_the_same_bits_in_any_pass(lm, n, batch, place):
    assert torch.equal(_in_company(lm, True, n, batch, place), _alone(lm, True))


@pytest.mark.parametrize("n, batch, place", [(1, 1, 0), (5, 3, 1), (8, 8, 7)])
def test_int8_passes_are_the_same_bits_in_any_pass(lm, n, batch, place):
    """int8 products need no fixed tiles: their integer sums are exact (specdec.engine.quant)."""
    assert torch.equal(_in_company(lm, True, n, batch, place, quantization="int8"), _alone(lm, True, "int8"))


def test_a_chunked_prompt_gives_the_same_bits(lm):
    assert torch.equal(_in_company(lm, True, 4, 3, 1, chunk=16), _alone(lm, True))


def test_the_default_passes_differ_so_the_tests_can_fail(lm):
    """Without the setting some pass shape changes some position's bits (the products' kernels are picked
    by row count): the tests above compare exactly."""
    alone = _alone(lm, False)
    assert any(not torch.equal(_in_company(lm, False, n, batch, batch - 1), alone)
               for n in (2, 5, 8) for batch in (1, 8))


def test_unavailable_without_the_lean_forward(target_dir, caplog):
    runner = ModelRunner(load_model(str(target_dir), dtype="float32"), 64, role="target", lean_forward=False,
                         batch_invariant=True)
    assert not runner.batch_invariant
    assert "batch-invariant passes are unavailable (the lean forward is off)" in caplog.text


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_cuda_through_the_triton_kernels(target_dir, dtype):
    """On a GPU the same property comes from kernels/batch_invariant.py (products, norms) and the paged Triton
    attention (scripts/gpu-check.sh runs this)."""
    lm = load_model(str(target_dir), dtype=dtype, device="cuda")
    alone = _alone(lm, True)
    for n, batch, place in [(1, 1, 0), (5, 3, 1), (8, 8, 7)]:
        assert torch.equal(_in_company(lm, True, n, batch, place), alone), (n, batch)


def test_a_missing_c_compiler_is_a_warning_by_default(target_dir, caplog, monkeypatch):
    """A CPU target is batch-invariant by default; where the C kernel cannot be built, it serves all the same and
    warns (its greedy output is then exact only up to near-ties: docs/exactness.md)."""
    import logging

    import kernels.cpu_attention

    monkeypatch.setattr(kernels.cpu_attention, "available", lambda: (False, "no C compiler found (set CC)"))
    with caplog.at_level(logging.WARNING, logger="specdec.engine.network"):
        runner = ModelRunner(load_model(str(target_dir), dtype="float32"), 64, role="target")
    assert not runner.batch_invariant
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "unavailable" in r.getMessage()]
    assert warned and "no C compiler found" in warned[0].getMessage()
