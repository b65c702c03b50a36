"""``specdec serve``: --speculative-config resolution and the in-process stack (draft, target, gateway)."""

from __future__ import annotations

import json
import threading
import warnings

import grpc
import pytest

from specdec.config import SpeculativeConfig, default_speculative_config
from specdec.errors import ConfigError
from specdec.entrypoints.serve import ServeConfig, resolve_speculative_config, start_stack
from specdec.v1 import common_pb2, generation_service_pb2_grpc
from tests.services_conftest_helpers import (
    PROMPTS,
    generate,
    generate_request,
    offline_greedy,
    rpc_error,
    wait_until,
)


def _resolve(**kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the new form must not warn
        return resolve_speculative_config(ServeConfig(**kw))


# --------------------------------------------------------------------------------------------------
# resolve_speculative_config


def test_speculative_config_json():
    cfg = _resolve(model="t", speculative_config=json.dumps(
        {"method": "draft_model", "model": "d", "num_speculative_tokens": 3, "draft_sample_method": "probabilistic",
         "max_model_len": 128}))
    assert cfg == SpeculativeConfig(model="d", num_speculative_tokens=3, draft_sample_method="probabilistic",
                                    max_model_len=128)


def test_no_speculative_config_serves_the_target_alone_and_says_so(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="specdec.entrypoints.serve"):
        assert _resolve(model="t") is None
    assert "serving t alone, speculation is off" in caplog.text


def test_no_target_uses_the_embedded_default_pair():
    assert _resolve() == SpeculativeConfig.from_any(default_speculative_config())


@pytest.mark.parametrize(("value", "match"), [
    ("{not json", "not valid JSON"),
    ('["d"]', "must be a dict or JSON object"),
    ('{"model": "d", "num_spec_tokens": 3}', "unknown speculative_config key"),
    ('{"num_speculative_tokens": 3}', "needs 'model'"),
    ('{"model": "d", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"model": "d", "num_speculative_tokens": 33}', "num_speculative_tokens"),
    ('{"model": "d", "method": "eagle"}', "not supported"),
    ('{"model": "d", "draft_sample_method": "beam"}', "draft_sample_method"),
    ('{"model": "d", "use_heterogeneous_vocab": "yes"}', "use_heterogeneous_vocab"),
    ('{"model": "d", "max_model_len": 1}', "max_model_len"),
])
def test_bad_speculative_config_is_a_config_error(value, match):
    with pytest.raises(ConfigError, match=match):
        _resolve(model="t", speculative_config=value)


def test_deprecated_flags_still_work_with_a_warning():
    with pytest.warns(DeprecationWarning, match="--speculative-config"):
        cfg = resolve_speculative_config(ServeConfig(model="t", speculative_model="d", num_speculative_tokens=2))
    assert cfg == SpeculativeConfig(model="d", num_speculative_tokens=2)
    with pytest.warns(DeprecationWarning):
        cfg = resolve_speculative_config(ServeConfig(model="t", speculative_model="d"))
    assert cfg == SpeculativeConfig(model="d")  # default k


def test_deprecated_flags_errors():
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="not both"):
        resolve_speculative_config(ServeConfig(model="t", speculative_model="d", speculative_config='{"model": "d"}'))
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="needs --speculative-model"):
        resolve_speculative_config(ServeConfig(model="t", num_speculative_tokens=3))
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="num_speculative_tokens"):
        resolve_speculative_config(ServeConfig(model="t", speculative_model="d", num_speculative_tokens=99))


# --------------------------------------------------------------------------------------------------
# start_stack


def _service_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate()
            if t.name in ("draft-batcher", "target-batcher", "draft-evict", "target-evict", "specdec-compute")}


def _started_since(before: set[threading.Thread]) -> list[str]:
    """The service threads alive now that were not before (an earlier test's may still be ending: not ours)."""
    return sorted(t.name for t in _service_threads() - before)


def _serve_config(target_dir, draft_dir, spec, k=3, **kw):
    return ServeConfig(model=str(target_dir), speculative_config=json.dumps(spec(draft_dir, k)), grpc_port=0,
                       host="127.0.0.1", port=-1, max_sequences=8, **kw)


def test_start_stack_serves_a_stream_end_to_end(target_dir, good_draft_dir, spec, tokenizer):
    from specdec import LLM

    before = _service_threads()
    stack = start_stack(_serve_config(target_dir, good_draft_dir, spec, k=3, max_model_len=128))
    try:
        assert stack.draft is not None and stack.gateway.port not in (stack.target.port, stack.draft.port)
        # one process, one compute thread: the two models take turns on it (see specdec.serving.batching)
        assert stack.draft.backend.batcher.compute is stack.target.backend.batcher.compute
        assert "specdec-compute" in _started_since(before)
        with grpc.insecure_channel(f"127.0.0.1:{stack.gateway.port}") as channel:
            stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
            info = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
            assert info.num_speculative_tokens == 3 and info.draft.model_name == str(good_draft_dir)
            assert info.target.model_name == str(target_dir)
            assert info.target.max_model_len == info.draft.max_model_len == 128  # --max-model-len reached both
            assert info.target.max_sequences == 8
            out = generate(stub, generate_request(PROMPTS[0], max_tokens=20))
            ref = offline_greedy(LLM(str(target_dir), dtype="float32"), PROMPTS[0], 20)
            assert (out.text, out.token_ids) == ref
            assert out.last.stats.num_accepted_tokens > 0 and out.last.stats.num_draft_tokens > out.last.stats.num_drafts
            wait_until(lambda: not stack.target.backend.runner.sequences and not stack.draft.backend.runner.sequences,
                       what="caches released")
    finally:
        stack.stop(grace=0)
    # everything it started is gone: the ports refuse calls, the worker threads ended
    with grpc.insecure_channel(f"127.0.0.1:{stack.gateway.port}") as channel:
        stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
        err = rpc_error(lambda: stub.GetInfo(common_pb2.GetInfoRequest(), timeout=2))
        assert err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    wait_until(lambda: not _started_since(before), timeout=10, what="the stack's service threads to end")


def test_start_stack_target_alone(target_dir):
    stack = start_stack(ServeConfig(model=str(target_dir), grpc_port=0, host="127.0.0.1", port=-1))
    try:
        assert stack.draft is None
        with grpc.insecure_channel(f"127.0.0.1:{stack.gateway.port}") as channel:
            stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
            out = generate(stub, generate_request(PROMPTS[1], max_tokens=6))
            assert len(out.token_ids) == 6 and out.last.stats.num_draft_tokens == 0
    finally:
        stack.stop(grace=0)


def test_start_stack_with_an_incompatible_draft_fails_and_stops_what_it_started(target_dir, other_vocab_dir, spec):
    before = _service_threads()
    with pytest.raises(ConfigError, match="use_heterogeneous_vocab"):
        start_stack(_serve_config(target_dir, other_vocab_dir, spec, k=2))
    wait_until(lambda: not _started_since(before), timeout=10, what="the stack's service threads to end")
