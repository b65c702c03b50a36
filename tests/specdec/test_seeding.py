"""specdec.seeding: the coupled rule's race noise is a function of (seed, position) only, the same for any
vocabulary size on the ids two sizes share, Exp(1)-distributed, and independent across positions and seeds."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.seeding import (NOISE_BLOCK, SEEDED_SAMPLING, check_seeded_sampling, coupling_key, race_noise,
                             stream_key)


def test_noise_is_a_function_of_seed_and_position():
    a = race_noise(7, [10, 11, 12], 5000)
    assert a.shape == (3, 5000) and a.dtype == torch.float32
    assert torch.equal(a, race_noise(7, [10, 11, 12], 5000))
    assert torch.equal(a[1:2], race_noise(7, [11], 5000))  # a row does not depend on the rows beside it
    assert torch.equal(a[2], race_noise(7, [12, 3], 5000)[0])
    assert not torch.equal(a[0], a[1]), "two positions share noise"
    assert not torch.equal(a[0], race_noise(8, [10], 5000)[0]), "two seeds share noise"


@pytest.mark.parametrize("narrow, wide", [(1, 4096), (100, 49152), (4096, 4097), (49152, 262144), (5000, 8191)])
def test_rows_of_different_sizes_agree_on_shared_ids(narrow, wide):
    """A draft whose logit row is another size gets the same noise for the ids it shares with the target."""
    small = race_noise(3, [40, 41], narrow)
    big = race_noise(3, [40, 41], wide)
    assert torch.equal(small, big[:, :narrow])


def test_blocks_are_independent_streams():
    e = race_noise(11, [0], 3 * NOISE_BLOCK)[0].view(3, NOISE_BLOCK)
    assert not torch.equal(e[0], e[1]) and not torch.equal(e[1], e[2])


def test_noise_is_exp1():
    e = race_noise(5, list(range(8)), 20_000).flatten().double()
    assert bool((e > 0).all())
    n = e.numel()
    assert abs(float(e.mean()) - 1.0) < 5 / math.sqrt(n)
    assert abs(float(e.var()) - 1.0) < 20 / math.sqrt(n)
    # Kolmogorov-Smirnov against 1 - exp(-x)
    x = e.sort().values
    cdf = 1 - torch.exp(-x)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    d = float(torch.maximum(i / n - cdf, cdf - (i - 1) / n).max())
    assert d < 1.95 / math.sqrt(n), d  # alpha = 0.001


def test_noise_does_not_depend_on_the_role_streams():
    """One key for draft and target, and none of the rejection streams' keys."""
    key = coupling_key(9)
    assert key not in (stream_key(9, "draft"), stream_key(9, "target"))
    assert torch.equal(race_noise(9, [5], 10), race_noise(9, [5], 10))


@pytest.mark.cuda
def test_noise_and_race_are_the_same_on_cuda():
    """Drawn on the CPU, then moved: a CUDA target races with the numbers a CPU draft races with."""
    cpu = race_noise(1, [2, 3], 49152)
    assert torch.equal(race_noise(1, [2, 3], 49152, device="cuda").cpu(), cpu)
    p = torch.softmax(torch.randn(2, 49152, generator=torch.Generator().manual_seed(0)), -1)
    assert torch.equal((p.cuda() / cpu.cuda()).argmax(-1).cpu(), (p / cpu).argmax(-1))


@pytest.mark.parametrize("bad", [{"vocab": 0}, {"positions": [-1]}])
def test_bad_arguments_are_refused(bad):
    kw = {"seed": 1, "positions": [0], "vocab": 10, **bad}
    with pytest.raises(ValueError):
        race_noise(**kw)


def test_check_seeded_sampling():
    for value in SEEDED_SAMPLING:
        assert check_seeded_sampling(value) == value
    with pytest.raises(ValueError, match="seeded_sampling must be one of"):
        check_seeded_sampling("gumbel")
