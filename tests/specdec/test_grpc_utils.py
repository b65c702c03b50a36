"""specdec.grpc_utils: q (draft_probs) conversions, sampling conversions, error-code mapping, servers."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
import torch

from specdec import grpc_utils
from specdec.errors import (
    BackendUnavailableError,
    ConfigError,
    InvalidRequestError,
    ModelNotFoundError,
    ResourceExhaustedError,
    SequenceNotFoundError,
)
from specdec.grpc_utils import (
    map_errors,
    map_stream_errors,
    probs_from_proto,
    probs_to_proto,
    require_ready,
    sampling_from_proto,
    sampling_to_proto,
    start_server,
    status_code_for,
    time_remaining,
)
from specdec.sampling import SamplingParams
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


# --------------------------------------------------------------------------------------------------
# error codes


@pytest.mark.parametrize(("exc", "code"), [
    (InvalidRequestError("x", param="p"), grpc.StatusCode.INVALID_ARGUMENT),
    (SequenceNotFoundError("x"), grpc.StatusCode.NOT_FOUND),
    (ResourceExhaustedError("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (BackendUnavailableError("x"), grpc.StatusCode.UNAVAILABLE),
    (ModelNotFoundError("x"), grpc.StatusCode.FAILED_PRECONDITION),
    (ConfigError("x"), grpc.StatusCode.FAILED_PRECONDITION),
    (TimeoutError("x"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (futures.TimeoutError(), grpc.StatusCode.DEADLINE_EXCEEDED),
    (ValueError("x"), grpc.StatusCode.INTERNAL),       # a plain ValueError is a bug, not the caller's
    (KeyError("x"), grpc.StatusCode.INTERNAL),
    (RuntimeError("x"), grpc.StatusCode.INTERNAL),
])
def test_status_code_for(exc, code):
    assert status_code_for(exc) == code


def test_sequence_not_found_message_is_not_quoted():
    assert str(SequenceNotFoundError("target: sequence 'a' lost")) == "target: sequence 'a' lost"


# --------------------------------------------------------------------------------------------------
# the decorators and server helpers over a real loopback server


class _Servicer:
    def __init__(self):
        self.ready = threading.Event()

    @map_errors
    def Unary(self, request: bytes, context):
        what = request.decode()
        if what == "ok":
            return b"fine"
        if what == "deadline":
            left = time_remaining(context)
            return b"none" if left is None else f"{left:.3f}".encode()
        if what == "not-ready":
            require_ready(self)
            return b"ready"
        raise {
            "invalid": InvalidRequestError("max_tokens must be >= 1", param="max_tokens"),
            "notfound": SequenceNotFoundError("resend the history"),
            "exhausted": ResourceExhaustedError("cap 3 reached"),
            "timeout": TimeoutError("too slow"),
            "bug": RuntimeError("boom"),
        }[what]

    @map_stream_errors
    def Stream(self, request: bytes, context):
        yield b"one"
        yield b"two"
        if request == b"fail":
            raise InvalidRequestError("bad in the middle", param="x")
        if request == b"bug":
            raise RuntimeError("kaboom")


@pytest.fixture(scope="module")
def loopback():
    servicer = _Servicer()

    def register(server):
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Svc", {
            "Unary": grpc.unary_unary_rpc_method_handler(servicer.Unary),
            "Stream": grpc.unary_stream_rpc_method_handler(servicer.Stream),
        })])

    handle = start_server(register, ["test.Svc"], "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    yield handle, channel, servicer
    channel.close()
    handle.stop(0)


def _unary(channel, what: str, timeout=10):
    return channel.unary_unary("/test.Svc/Unary")(what.encode(), timeout=timeout)


@pytest.mark.parametrize(("what", "code", "details"), [
    ("invalid", grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be >= 1"),
    ("notfound", grpc.StatusCode.NOT_FOUND, "resend the history"),
    ("exhausted", grpc.StatusCode.RESOURCE_EXHAUSTED, "cap 3 reached"),
    ("timeout", grpc.StatusCode.DEADLINE_EXCEEDED, "too slow"),
    ("bug", grpc.StatusCode.INTERNAL, "internal error: RuntimeError: boom"),
])
def test_map_errors_over_grpc(loopback, what, code, details):
    _, channel, _ = loopback
    with pytest.raises(grpc.RpcError) as info:
        _unary(channel, what)
    assert info.value.code() == code and info.value.details() == details
    assert _unary(channel, "ok") == b"fine"


def test_require_ready_inside_map_errors_is_unavailable(loopback):
    """BUG: context.abort() raises a plain Exception, which map_errors catches and re-aborts as
    INTERNAL ("internal error: Exception: "); require_ready's UNAVAILABLE never reaches the client."""
    _, channel, servicer = loopback
    servicer.ready.clear()
    with pytest.raises(grpc.RpcError) as info:
        _unary(channel, "not-ready")
    servicer.ready.set()
    assert _unary(channel, "not-ready") == b"ready"
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")


def test_map_stream_errors_over_grpc(loopback):
    _, channel, _ = loopback
    call = channel.unary_stream("/test.Svc/Stream")
    assert list(call(b"ok", timeout=10)) == [b"one", b"two"]
    got = []
    with pytest.raises(grpc.RpcError) as info:
        for msg in call(b"fail", timeout=10):
            got.append(msg)
    assert got == [b"one", b"two"]  # what was streamed before the error arrives first
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details() == "bad in the middle"
    with pytest.raises(grpc.RpcError) as info:
        list(call(b"bug", timeout=10))
    assert info.value.code() == grpc.StatusCode.INTERNAL and "kaboom" in info.value.details()


def test_time_remaining_reports_the_client_deadline(loopback):
    _, channel, _ = loopback
    left = float(_unary(channel, "deadline", timeout=5))
    assert 0 < left <= 5.1  # grpc rounds deadlines a little
    assert _unary(channel, "deadline", timeout=None) == b"none"


def test_health_follows_set_serving_and_reflection_lists_services(loopback):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    handle, channel, _ = loopback
    health = health_pb2_grpc.HealthStub(channel)

    def status(service=""):
        return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    assert status() == status("test.Svc") == health_pb2.HealthCheckResponse.NOT_SERVING  # start_server default
    handle.set_serving(True)
    assert status() == status("test.Svc") == health_pb2.HealthCheckResponse.SERVING
    handle.set_serving(False)
    assert status("test.Svc") == health_pb2.HealthCheckResponse.NOT_SERVING
    services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"test.Svc", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services


def test_stop_runs_on_stop_callbacks_and_frees_the_port():
    calls = []
    handle = start_server(lambda s: None, ["x.Y"], "127.0.0.1", 0)
    handle.on_stop.append(lambda: calls.append("closed"))
    port = handle.port
    with pytest.raises((OSError, RuntimeError), match=str(port)):  # the port is taken while it runs
        start_server(lambda s: None, ["x.Y"], "127.0.0.1", port)
    handle.stop(0)
    assert calls == ["closed"]
    again = start_server(lambda s: None, ["x.Y"], "127.0.0.1", port)  # same port, right after
    assert again.port == port
    again.stop(0)


def test_error_table_has_specific_classes_before_general_ones():
    """The first matching class wins: no entry may be shadowed by an earlier, broader one."""
    table = grpc_utils.ERROR_CODES
    for i, (cls, _) in enumerate(table):
        for earlier, _ in table[:i]:
            if cls is not earlier:  # (futures.TimeoutError is TimeoutError on Python >= 3.11)
                assert not issubclass(cls, earlier), f"{cls.__name__} is shadowed by {earlier.__name__}"
