"""DraftService over real gRPC: Propose semantics, errors, caps, release, expiry, health, reflection."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

import specdec.serving.backend
from draft_service.server import SERVICE_NAME
from specdec import LLM, SamplingParams
from specdec.v1 import common_pb2, draft_service_pb2 as pb, draft_service_pb2_grpc
from tests.services_conftest_helpers import (
    NOT_SERVING,
    PROMPTS,
    SERVING,
    health_status,
    propose_request,
    release,
    rpc_error,
    wait_until,
)

VOCAB = 49152
MAX_SEQUENCES = 3
TOP_N = 8


@pytest.fixture(scope="module")
def draft(servers, good_draft_dir):
    return servers.draft(good_draft_dir, max_sequences=MAX_SEQUENCES, draft_top_n=TOP_N)


@pytest.fixture(scope="module")
def channel(draft):
    with grpc.insecure_channel(f"127.0.0.1:{draft.port}") as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return draft_service_pb2_grpc.DraftServiceStub(channel)


@pytest.fixture
def clean(draft, stub):
    assert not draft.backend.runner.sequences
    yield
    for sid in list(draft.backend.runner.sequences):
        release(stub, sid)


@pytest.fixture(scope="module")
def ref(tokenizer, good_draft_dir):
    """(prompt ids, 12 greedy tokens of the DRAFT model alone)."""
    llm = LLM(str(good_draft_dir), dtype="float32")
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    return tokenizer(PROMPTS[1]).input_ids, list(out.token_ids)


def _propose(stub, *args, **kw) -> pb.ProposeResponse:
    return stub.Propose(propose_request(*args, **kw), timeout=30)


def _ok_request(stub, ref) -> None:
    ids, out = ref
    resp = _propose(stub, "still-ok", ids, k=3)
    assert list(resp.draft_token_ids) == out[:3]
    assert release(stub, "still-ok")


def test_health_and_reflection(channel):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    assert health_status(channel) == SERVING and health_status(channel, SERVICE_NAME) == SERVING
    assert SERVICE_NAME == "specdec.v1.DraftService"
    db = ProtoReflectionDescriptorDatabase(channel)
    assert {"specdec.v1.DraftService", "grpc.health.v1.Health"} <= set(db.get_services())
    fd = db.FindFileContainingSymbol("specdec.v1.DraftService")
    assert {m.name for m in fd.service[0].method} == {"Propose", "ReleaseSequence", "GetInfo"}


def test_get_info(stub, good_draft_dir):
    info = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10).info
    assert info.model_name == str(good_draft_dir) and info.vocab_size == VOCAB
    assert info.max_sequences == MAX_SEQUENCES and info.max_model_len == 256 and info.dtype == "float32"


def test_greedy_proposals_are_the_draft_models_greedy_continuation(stub, draft, ref, clean):
    ids, out = ref
    r = _propose(stub, "g", ids, k=4)
    assert list(r.draft_token_ids) == out[:4] and not r.draft_probs and r.sequence_length == len(ids)
    # the target accepted 2 drafts and added its own token: send only the new tokens
    wrong = (out[2] + 1) % VOCAB
    r = _propose(stub, "g", [out[0], out[1], wrong], start_position=len(ids), k=3)
    assert r.sequence_length == len(ids) + 3
    llm_ref = LLM(str(draft.backend.config.model), dtype="float32").generate(
        {"prompt_token_ids": ids + [out[0], out[1], wrong]},
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert list(r.draft_token_ids) == list(llm_ref.token_ids)
    # k = 0 proposes nothing
    assert list(_propose(stub, "g", [], start_position=len(ids) + 3, k=0).draft_token_ids) == []
    assert release(stub, "g") and not release(stub, "g")


def test_probabilistic_proposals_carry_sparse_q(stub, ref, clean):
    ids, _ = ref
    k = 4

    def run(sid, seed):
        return _propose(stub, sid, ids, k=k, method=pb.DRAFT_SAMPLE_METHOD_PROBABILISTIC, temperature=1.0, seed=seed)

    r = run("p1", 11)
    assert len(r.draft_token_ids) == len(r.draft_probs) == k
    for token, dist in zip(r.draft_token_ids, r.draft_probs):
        assert 0 < len(dist.token_ids) <= TOP_N, "q must travel sparsely (top-N)"
        assert len(dist.token_ids) == len(dist.probs)
        assert token in dist.token_ids and dist.probs[list(dist.token_ids).index(token)] > 0
        assert abs(sum(dist.probs) - 1.0) < 1e-4 and min(dist.probs) >= 0
    again = run("p2", 11)
    assert list(again.draft_token_ids) == list(r.draft_token_ids)
    assert [list(d.probs) for d in again.draft_probs] == [list(d.probs) for d in r.draft_probs]
    # greedy sampling params: probabilistic drafting degenerates to greedy (no q)
    g = _propose(stub, "p3", ids, k=k, method=pb.DRAFT_SAMPLE_METHOD_PROBABILISTIC)
    assert not g.draft_probs


def test_unknown_sequence_is_not_found_and_says_to_resend(stub, ref, clean):
    ids, _ = ref
    err = rpc_error(lambda: _propose(stub, "ghost", ids[-1:], start_position=len(ids) - 1))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert "draft" in err.details() and "resend" in err.details() and "start_position=0" in err.details()
    _ok_request(stub, ref)


@pytest.mark.parametrize(("kw", "code", "words"), [
    ({"k": 33}, grpc.StatusCode.INVALID_ARGUMENT, ["num_speculative_tokens=33", "32"]),
    ({"new_token_ids": [VOCAB]}, grpc.StatusCode.INVALID_ARGUMENT, ["vocabulary", str(VOCAB)]),
    ({"new_token_ids": []}, grpc.StatusCode.INVALID_ARGUMENT, ["empty"]),
    ({"sequence_id": ""}, grpc.StatusCode.INVALID_ARGUMENT, ["sequence_id"]),
    ({"temperature": 1.0, "seed": 2**63}, grpc.StatusCode.INVALID_ARGUMENT, ["seed"]),
    ({"temperature": -0.5}, grpc.StatusCode.INVALID_ARGUMENT, ["temperature"]),
])
def test_bad_propose_requests(stub, ref, clean, kw, code, words):
    ids, _ = ref
    args = {"sequence_id": "bad", "new_token_ids": ids, **kw}
    err = rpc_error(lambda: _propose(stub, args.pop("sequence_id"), args.pop("new_token_ids"), **args))
    assert err.code() == code, err.details()
    for w in words:
        assert w in err.details(), err.details()
    _ok_request(stub, ref)


def test_proposing_past_max_model_len_is_invalid_argument(stub, ref, clean):
    ids, _ = ref
    err = rpc_error(lambda: _propose(stub, "long", (ids * 256)[:254], k=5))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len" in err.details()
    _ok_request(stub, ref)


def test_max_sequences_is_resource_exhausted(stub, ref, clean):
    ids, _ = ref
    for i in range(MAX_SEQUENCES):
        _propose(stub, f"cap{i}", ids, k=1)
    err = rpc_error(lambda: _propose(stub, "over", ids, k=1))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_sequences" in err.details()
    assert release(stub, "cap0")
    assert len(_propose(stub, "over", ids, k=1).draft_token_ids) == 1


def test_idle_sequence_is_evicted_after_its_ttl(servers, good_draft_dir, ref):
    """As for the target: eviction at chosen instants, then the background loop."""
    import time

    handle = servers.draft(good_draft_dir, sequence_ttl_seconds=60)
    backend = handle.backend
    with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
        stub = draft_service_pb2_grpc.DraftServiceStub(ch)
        ids, out = ref
        _propose(stub, "idle", ids, k=2)
        assert backend.evict_idle(time.monotonic() + 59) == [] and "idle" in backend.runner.sequences
        assert backend.evict_idle(time.monotonic() + 61) == ["idle"] and not backend.runner.sequences
        err = rpc_error(lambda: _propose(stub, "idle", out[:2], start_position=len(ids)))
        assert err.code() == grpc.StatusCode.NOT_FOUND

    short = servers.draft(good_draft_dir, sequence_ttl_seconds=0.2)
    with grpc.insecure_channel(f"127.0.0.1:{short.port}") as ch:
        _propose(draft_service_pb2_grpc.DraftServiceStub(ch), "idle", ref[0], k=2)
    wait_until(lambda: short.backend.sequences_expired == 1, timeout=5, what="the expiry loop")
    assert not short.backend.runner.sequences


def test_async_load_reports_not_serving_then_serving(servers, good_draft_dir, ref, monkeypatch):
    """Health is NOT_SERVING until the model is loaded (deterministic: the load waits on a gate)."""
    gate = threading.Event()
    real_load = specdec.serving.backend.load_model
    monkeypatch.setattr(specdec.serving.backend, "load_model", lambda *a, **kw: gate.wait(30) and real_load(*a, **kw))
    handle = servers.draft(good_draft_dir, load_async=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
            assert health_status(ch) == NOT_SERVING and health_status(ch, SERVICE_NAME) == NOT_SERVING
            stub = draft_service_pb2_grpc.DraftServiceStub(ch)
            assert not handle.backend.ready.is_set()
            gate.set()
            wait_until(lambda: health_status(ch) == SERVING, timeout=30, what="SERVING")
            assert list(_propose(stub, "late", ref[0], k=2).draft_token_ids) == ref[1][:2]
    finally:
        gate.set()
        assert handle.backend.ready.wait(30)


def test_draft_logits_are_float32_cpu(draft):
    """The service loads exactly what it was configured with (dtype float32, CPU)."""
    lm = draft.backend.lm
    assert lm.dtype == torch.float32 and next(lm.model.parameters()).dtype == torch.float32
    assert str(lm.device) == "cpu"
