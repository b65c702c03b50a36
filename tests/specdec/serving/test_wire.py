"""specdec.serving.wire and specdec.sparse_probs: q (draft_probs) and sampling parameters over protobuf."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import InvalidRequestError
from specdec.sampling import SamplingParams
from specdec.serving.wire import probs_from_proto, probs_to_proto, sampling_from_proto, sampling_to_proto
from specdec.v1 import common_pb2

V = 1000


# --------------------------------------------------------------------------------------------------
# draft_probs


def _sparse_rows(k=3, nnz=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(k, V)
    for i in range(k):
        ids = torch.randperm(V, generator=g)[:nnz]
        out[i, ids] = torch.rand(nnz, generator=g)
        out[i] /= out[i].sum()
    return out


def test_sparse_rows_travel_sparsely_and_round_trip_exactly():
    probs = _sparse_rows()
    rows = probs_to_proto(probs)
    assert len(rows) == 3
    for row, ref in zip(rows, probs):
        assert len(row.token_ids) == len(row.probs) == 5
        assert sorted(row.token_ids) == ref.nonzero().squeeze(-1).tolist()
    back = probs_from_proto(rows, 3, V)
    assert back.dtype == torch.float32 and torch.equal(back, probs)


def test_dense_rows_travel_densely_and_round_trip_exactly():
    probs = torch.softmax(torch.randn(2, V, generator=torch.Generator().manual_seed(1)), -1)
    rows = probs_to_proto(probs)
    assert all(not r.token_ids and len(r.probs) == V for r in rows)
    assert torch.equal(probs_from_proto(rows, 2, V), probs)
    # the wire form survives protobuf serialization too
    wire = [common_pb2.TokenDistribution.FromString(r.SerializeToString()) for r in rows]
    assert torch.equal(probs_from_proto(wire, 2, V), probs)


def test_mixed_rows_and_the_sparsity_threshold():
    probs = torch.zeros(3, V)
    probs[0, :10] = 0.1                    # 10 nonzeros: sparse
    probs[1, : V // 2] = 2.0 / V            # exactly half: dense (sparse would not be smaller)
    probs[2, : V // 2 - 1] = 1.0 / (V // 2 - 1)  # just under half: sparse
    rows = probs_to_proto(probs)
    assert [bool(r.token_ids) for r in rows] == [True, False, True]
    assert torch.equal(probs_from_proto(rows, 3, V), probs)


def test_empty_cases():
    assert probs_to_proto(None) == []
    assert probs_from_proto([], 4, V) is None  # greedy drafts: no q
    zero = torch.zeros(1, V)  # an all-zero row comes back as zeros
    assert torch.equal(probs_from_proto(probs_to_proto(zero), 1, V), zero)


def test_short_dense_row_is_zero_padded():
    """A draft with a smaller (padded) vocabulary may send shorter dense rows."""
    row = common_pb2.TokenDistribution(probs=[0.25, 0.75])
    out = probs_from_proto([row], 1, V)
    assert out.shape == (1, V) and out[0, :2].tolist() == [0.25, 0.75] and out[0, 2:].abs().sum() == 0


@pytest.mark.parametrize(("rows", "k", "match"), [
    ([common_pb2.TokenDistribution(token_ids=[1], probs=[1.0])], 2, "1 rows for 2 draft tokens"),
    ([common_pb2.TokenDistribution(token_ids=[1, 2], probs=[1.0])], 1, "differ in length"),
    ([common_pb2.TokenDistribution(token_ids=[V], probs=[1.0])], 1, "outside the vocabulary"),
    ([common_pb2.TokenDistribution(probs=[0.0] * (V + 1))], 1, f"{V + 1} entries"),
])
def test_malformed_rows_are_invalid_requests_naming_draft_probs(rows, k, match):
    with pytest.raises(InvalidRequestError, match=match) as info:
        probs_from_proto(rows, k, V)
    assert info.value.param == "draft_probs"


# --------------------------------------------------------------------------------------------------
# sampling params


def test_sampling_params_round_trip():
    params = SamplingParams(temperature=0.5, top_p=0.9, top_k=40, seed=123)
    back = sampling_from_proto(sampling_to_proto(params))
    assert (back.temperature, back.top_k, back.seed) == (0.5, 40, 123)
    assert back.top_p == pytest.approx(0.9)
    no_seed = sampling_to_proto(SamplingParams(temperature=0))
    assert not no_seed.HasField("seed") and sampling_from_proto(no_seed).seed is None
    assert sampling_from_proto(no_seed).greedy


def test_sampling_from_proto_defaults_and_extras():
    msg = common_pb2.SamplingParams()  # all zero: greedy, top_p 0 read as 1, top_k disabled
    p = sampling_from_proto(msg, max_tokens=7, stop=["x"])
    assert p.greedy and p.top_p == 1.0 and p.top_k == 0 and p.max_tokens == 7 and p.stop == ["x"]
    msg.seed = 0
    assert sampling_from_proto(msg).seed == 0  # seed 0 is a seed, not "unset"


def test_sampling_from_proto_rejects_out_of_range_values():
    with pytest.raises(InvalidRequestError) as info:
        sampling_from_proto(common_pb2.SamplingParams(seed=2**63))
    assert info.value.param == "seed"
    assert sampling_from_proto(common_pb2.SamplingParams(seed=2**63 - 1)).seed == 2**63 - 1
    for field, value in [("temperature", -1.0), ("top_p", 1.5), ("top_k", -2)]:
        with pytest.raises(InvalidRequestError) as info:
            sampling_from_proto(common_pb2.SamplingParams(**{field: value}))
        assert info.value.param == field


def test_a_requests_priority_travels_with_its_sampling_params():
    """The gateway's --scheduling-policy priority reaches the services with every call (they prefill and preempt
    by it); 0 by default."""
    from specdec.sampling import SamplingParams
    from specdec.serving.wire import sampling_from_proto, sampling_to_proto

    assert sampling_from_proto(sampling_to_proto(SamplingParams(temperature=0, priority=-3))).priority == -3
    assert sampling_from_proto(sampling_to_proto(SamplingParams(temperature=0.7, seed=5))).priority == 0
