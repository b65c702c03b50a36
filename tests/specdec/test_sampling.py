"""SamplingParams validation, process_logits (temperature, top-k, top-p), sample(), SpecDecodeStats."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.errors import InvalidRequestError
from specdec.sampling import SamplingParams, SpecDecodeStats, make_generator, process_logits, sample

# --------------------------------------------------------------------------------------------------
# SamplingParams


def test_defaults_and_normalisation():
    sp = SamplingParams()
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.max_tokens) == (1, 1.0, 1.0, 0, 16)
    assert sp.stop == [] and sp.stop_token_ids == []
    assert not sp.greedy
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(top_k=-1).top_k == -1


def test_clone_validates_and_keeps_original():
    sp = SamplingParams(temperature=0.7, seed=3)
    c = sp.clone(seed=4)
    assert (c.seed, c.temperature, sp.seed) == (4, 0.7, 3)
    with pytest.raises(InvalidRequestError):
        sp.clone(top_p=0)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -1}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "42"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": ["7"]}, "stop_token_ids"),
    ],
)
def test_invalid_sampling_params(kwargs, param):
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(**kwargs)
    assert exc.value.param == param
    assert param in str(exc.value)
    assert isinstance(exc.value, ValueError)  # callers may catch ValueError


@pytest.mark.parametrize(
    "kwargs, param",
    [({"temperature": "hot"}, "temperature"), ({"top_p": "0.5"}, "top_p"), ({"temperature": None}, "temperature")],
)
def test_wrongly_typed_sampling_params_raise_invalid_request(kwargs, param):
    """A JSON client sending a string must get a 400-class InvalidRequestError, not a TypeError (500)."""
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(**kwargs)
    assert exc.value.param == param


# --------------------------------------------------------------------------------------------------
# process_logits

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])


def test_greedy_is_one_hot_on_argmax():
    probs = process_logits(LOGITS, SamplingParams(temperature=0))
    assert probs.tolist() == [0, 0, 0, 0, 0, 1]
    batched = process_logits(torch.stack([LOGITS, -LOGITS]), SamplingParams(temperature=0))
    assert batched.argmax(-1).tolist() == [5, 4] and batched.sum(-1).tolist() == [1, 1]


@pytest.mark.parametrize("t", [0.25, 1.0, 2.0])
def test_temperature(t):
    probs = process_logits(LOGITS, SamplingParams(temperature=t))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.softmax(LOGITS / t, -1))


def test_bf16_logits_are_processed_in_float32():
    probs = process_logits(LOGITS.bfloat16(), SamplingParams(temperature=1.0))
    assert probs.dtype == torch.float32
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 3, 6, 100])
def test_top_k_keeps_exactly_the_k_largest(k):
    probs = process_logits(LOGITS, SamplingParams(top_k=k))
    kept = set(torch.nonzero(probs).flatten().tolist())
    assert kept == set(torch.topk(LOGITS, min(k, 6)).indices.tolist())
    expected = torch.full_like(LOGITS, float("-inf"))
    idx = list(kept)
    expected[idx] = LOGITS[idx]
    torch.testing.assert_close(probs, expected.softmax(-1))


@pytest.mark.parametrize("disabled", [0, -1])
def test_top_k_disabled(disabled):
    torch.testing.assert_close(process_logits(LOGITS, SamplingParams(top_k=disabled)), LOGITS.softmax(-1))


def _expected_top_p(logits, top_p):
    """Reference: the smallest set of most likely tokens whose mass reaches top_p."""
    probs = logits.softmax(-1)
    order = probs.argsort(descending=True).tolist()
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += float(probs[i])
        if mass >= top_p:
            break
    out = torch.zeros_like(probs)
    out[kept] = probs[kept] / probs[kept].sum()
    return out


@pytest.mark.parametrize("top_p", [1e-6, 0.3, 0.5, 0.8, 0.95, 0.999])
def test_top_p_keeps_smallest_nucleus(top_p):
    torch.testing.assert_close(process_logits(LOGITS, SamplingParams(top_p=top_p)), _expected_top_p(LOGITS, top_p))


def test_top_k_then_top_p_and_temperature_compose():
    params = SamplingParams(temperature=0.5, top_k=3, top_p=0.9)
    scaled = LOGITS / 0.5
    masked = torch.full_like(scaled, float("-inf"))
    top3 = torch.topk(scaled, 3).indices
    masked[top3] = scaled[top3]
    torch.testing.assert_close(process_logits(LOGITS, params), _expected_top_p(masked, 0.9))


def test_rows_are_processed_independently():
    rows = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)) * 3
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.7)
    batched = process_logits(rows, params)
    for i in range(5):
        torch.testing.assert_close(batched[i], process_logits(rows[i], params))
    torch.testing.assert_close(batched.sum(-1), torch.ones(5))


def test_minus_inf_logits_never_get_mass():
    logits = torch.tensor([1.0, float("-inf"), 0.5, float("-inf")])
    for params in (SamplingParams(), SamplingParams(top_k=3), SamplingParams(top_p=0.99)):
        probs = process_logits(logits, params)
        assert probs[1] == 0 and probs[3] == 0
        assert not torch.isnan(probs).any()


# --------------------------------------------------------------------------------------------------
# sample / generators


def test_sample_shapes_and_seed_reproducibility():
    probs = torch.softmax(torch.randn(3, 4, 20, generator=torch.Generator().manual_seed(1)), -1)
    a = sample(probs, make_generator(7))
    b = sample(probs, make_generator(7))
    assert a.shape == (3, 4) and a.dtype == torch.int64
    assert torch.equal(a, b)
    draws = {tuple(sample(probs, make_generator(s)).flatten().tolist()) for s in range(5)}
    assert len(draws) > 1


def test_sample_respects_one_hot():
    probs = process_logits(LOGITS, SamplingParams(temperature=0))
    assert int(sample(probs, None)) == 5


def test_unseeded_generators_differ():
    a = torch.rand(8, generator=make_generator(None))
    b = torch.rand(8, generator=make_generator(None))
    assert not torch.equal(a, b)


# --------------------------------------------------------------------------------------------------
# SpecDecodeStats


def test_spec_decode_stats_record_and_merge():
    s = SpecDecodeStats()
    assert s.acceptance_rate == 0.0 and s.mean_acceptance_length == 0.0
    s.record(4, 4)
    s.record(4, 1)
    s.record(0, 0)  # a target-only round (budget left no room to draft)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.num_target_passes) == (2, 8, 5, 3)
    assert s.accepted_per_position == [2, 1, 1, 1]
    assert s.acceptance_rate == pytest.approx(5 / 8)
    assert s.mean_acceptance_length == pytest.approx(1 + 5 / 2)
    t = SpecDecodeStats()
    t.record(6, 6)
    s.merge(t)
    assert s.accepted_per_position == [3, 2, 2, 2, 1, 1]
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.num_target_passes) == (3, 14, 11, 4)
    d = s.as_dict()
    assert d["acceptance_rate"] == pytest.approx(11 / 14)
    assert d["accepted_per_position"] == [3, 2, 2, 2, 1, 1]
