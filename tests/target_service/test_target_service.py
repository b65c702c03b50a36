"""TargetService over real gRPC: Verify semantics, errors, caps, release, expiry, health, reflection."""

from __future__ import annotations

import math
import threading

import grpc
import pytest

import specdec.serving.backend
from specdec.v1 import common_pb2, target_service_pb2, target_service_pb2_grpc
from target_service.server import SERVICE_NAME
from tests.services_conftest_helpers import (
    NOT_SERVING,
    PROMPTS,
    SERVING,
    health_status,
    offline_greedy,
    release,
    rpc_error,
    run_in_thread,
    verify_request,
    wait_until,
)

VOCAB = 49152
MAX_SEQUENCES = 3


@pytest.fixture(scope="module")
def target(servers, target_dir):
    return servers.target(target_dir, max_sequences=MAX_SEQUENCES)


@pytest.fixture(scope="module")
def channel(target):
    with grpc.insecure_channel(f"127.0.0.1:{target.port}") as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return target_service_pb2_grpc.TargetServiceStub(channel)


@pytest.fixture
def clean(target, stub):
    """Every test starts and ends with an empty cache table."""
    assert not target.backend.runner.sequences
    yield
    for sid in list(target.backend.runner.sequences):
        release(stub, sid)


@pytest.fixture(scope="module")
def ref(tokenizer, target_llm):
    ids = tokenizer(PROMPTS[0]).input_ids
    return ids, offline_greedy(target_llm, PROMPTS[0], 10)[1]


def _verify(stub, *args, **kw) -> target_service_pb2.VerifyResponse:
    return stub.Verify(verify_request(*args, **kw), timeout=30)


def _next_token(resp) -> tuple[str, int]:
    which = resp.WhichOneof("next_token")
    return which, getattr(resp, which)


def _ok_request(stub, ref) -> None:
    """A normal request still succeeds (and is released)."""
    ids, out = ref
    resp = _verify(stub, "still-ok", ids, draft_token_ids=out[:2])
    assert resp.num_accepted_tokens == 2 and _next_token(resp) == ("bonus_token_id", out[2])
    assert release(stub, "still-ok")


# --------------------------------------------------------------------------------------------------
# health, reflection, info


def test_health_is_serving_after_synchronous_start(target, channel):
    assert health_status(channel) == SERVING
    assert health_status(channel, SERVICE_NAME) == SERVING == health_status(channel, "specdec.v1.TargetService")


def test_the_weights_held_are_exported_at_start_up_once_each(target, target_dir):
    from specdec.engine.models import load_model
    from specdec.serving.metrics import exposition
    from tests.metrics_helpers import parse, total

    backend = target.backend
    held = backend.runner.weight_bytes()
    assert total(parse(exposition().decode()), "specdec_model_weight_bytes", service="target",
                 model_name=backend.config.model) == held
    # the service's own model: each weight held once (packed for the lean forward), not the float one beside it
    params = sum(p.numel() * p.element_size() for p in load_model(str(target_dir), dtype="float32").model.parameters())
    assert 0.8 * params < held < 1.05 * params


def test_reflection_lists_the_services(channel):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    db = ProtoReflectionDescriptorDatabase(channel)
    services = set(db.get_services())
    assert {"specdec.v1.TargetService", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
    fd = db.FindFileContainingSymbol("specdec.v1.TargetService")
    assert fd.package == "specdec.v1" and "TargetService" in [s.name for s in fd.service]
    assert {"Verify", "ReleaseSequence", "GetInfo"} == {m.name for m in fd.service[0].method}


def test_get_info(stub, target_dir, tokenizer):
    info = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10).info
    assert info.model_name == str(target_dir) and info.model_source == str(target_dir)
    assert info.vocab_size == VOCAB and info.dtype == "float32" and info.device == "cpu"
    assert info.max_model_len == 256 and info.max_sequences == MAX_SEQUENCES
    assert tokenizer.eos_token_id in info.eos_token_ids
    assert info.max_num_speculative_tokens == 32 and len(info.tokenizer_fingerprint) == 32


def test_get_info_reports_the_kv_pool(stub, target):
    from specdec.engine.kv_cache import DEFAULT_BLOCK_SIZE

    info = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10).info
    kv = target.backend.runner.kv_stats()
    assert info.kv_cache_capacity_tokens == kv.capacity_tokens == kv.num_blocks * kv.block_size > 0
    assert info.block_size == DEFAULT_BLOCK_SIZE and info.enable_prefix_caching is True


def test_the_kv_pool_settings_reach_the_runner(servers, target_dir, monkeypatch):
    """--kv-cache-memory, --block-size, --no-enable-prefix-caching, --gpu-memory-utilization: the runner is built
    with them, and GetInfo reports the pool they made."""
    made = []
    runner_class = specdec.serving.backend.ModelRunner

    def spy(*args, **kwargs):
        made.append(kwargs)
        return runner_class(*args, **kwargs)

    monkeypatch.setattr(specdec.serving.backend, "ModelRunner", spy)
    small = servers.target(target_dir, kv_cache_memory=3 * 2**20, block_size=32, enable_prefix_caching=False,
                           gpu_memory_utilization=0.5)
    try:
        assert {k: made[0][k] for k in ("kv_cache_memory", "block_size", "enable_prefix_caching",
                                        "gpu_memory_utilization")} == {
            "kv_cache_memory": 3 * 2**20, "block_size": 32, "enable_prefix_caching": False,
            "gpu_memory_utilization": 0.5}
        with grpc.insecure_channel(f"127.0.0.1:{small.port}") as ch:
            info = target_service_pb2_grpc.TargetServiceStub(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=10).info
        assert info.block_size == 32 and info.enable_prefix_caching is False
        # 3 MiB of a 3-layer, 2x16-dim-kv-head float32 model: 768 bytes a token, at most 4096 tokens
        assert 0 < info.kv_cache_capacity_tokens <= 3 * 2**20 // 768 and info.kv_cache_capacity_tokens % 32 == 0
    finally:
        servers.stop(small)


# --------------------------------------------------------------------------------------------------
# Verify semantics


def test_verify_accepts_and_rejects_like_the_target_alone(stub, target, ref, clean):
    ids, out = ref
    n = len(ids)
    # no drafts: plain decoding of one token
    r = _verify(stub, "s", ids)
    assert (r.num_accepted_tokens, _next_token(r), r.sequence_length) == (0, ("bonus_token_id", out[0]), n)
    # the target's own continuation as drafts: all accepted + the bonus token
    r = _verify(stub, "s", [out[0]], start_position=n, draft_token_ids=out[1:4])
    assert (r.num_accepted_tokens, _next_token(r), r.sequence_length) == (3, ("bonus_token_id", out[4]), n + 4)
    # one right draft, then a wrong one: rejection there and the target's token instead
    wrong = (out[6] + 1) % VOCAB
    r = _verify(stub, "s", out[1:5], start_position=n + 1, draft_token_ids=[out[5], wrong, out[7]])
    assert (r.num_accepted_tokens, _next_token(r), r.sequence_length) == (1, ("recovered_token_id", out[6]), n + 6)
    # the service holds the committed history (rejected drafts were rolled back)
    assert target.backend.runner.sequences["s"].tokens == ids + out[:6]
    assert release(stub, "s") and not release(stub, "s")


def test_verify_seeded_sampling_is_reproducible(stub, ref, clean):
    ids, out = ref

    def run(sid):
        r = _verify(stub, sid, ids, draft_token_ids=out[:4], temperature=1.0, seed=7)
        return r.num_accepted_tokens, _next_token(r)

    assert run("a") == run("b")
    assert release(stub, "a") and release(stub, "b")


def test_seeded_sampling_setting_reaches_the_worker_and_a_bad_one_is_refused(servers, target_dir, monkeypatch):
    """--seeded-sampling / SPECDEC_TARGET_SEEDED_SAMPLING: coupled by default, rejection when asked; a bad
    value stops start-up before the model loads, naming the flag."""
    from specdec.errors import ConfigError
    from specdec.serving.settings import from_env
    from target_service.config import ENV_PREFIX, TargetServiceConfig
    from target_service.server import create_server

    monkeypatch.setenv("SPECDEC_TARGET_SEEDED_SAMPLING", "rejection")
    assert from_env(TargetServiceConfig, ENV_PREFIX).seeded_sampling == "rejection"
    rejection = servers.target(target_dir, seeded_sampling="rejection")
    try:
        assert rejection.backend.worker.seeded_sampling == "rejection"
    finally:
        servers.stop(rejection)
    with pytest.raises(ConfigError, match=r"--seeded-sampling must be one of \['coupled', 'rejection'\]"):
        create_server(TargetServiceConfig(model=str(target_dir), port=0, seeded_sampling="gumbel"))


def test_coupled_verify_emits_the_target_alone_race_whatever_is_proposed(stub, target, ref, clean):
    """A seeded sampled Verify under the default rule: the emitted tokens are the target's race at each
    position, so any proposal (none, random ids, the race's own tokens) emits the same tokens."""
    ids, out = ref
    assert target.backend.worker.seeded_sampling == "coupled"
    n = len(ids)
    alone = []
    for i in range(4):  # the target alone, one token per Verify
        r = _verify(stub, "alone", ids + alone if i == 0 else alone[-1:], start_position=0 if i == 0 else n + i - 1,
                    temperature=1.0, seed=7)
        alone.append(_next_token(r)[1])
    wrong = [(t + 1) % VOCAB for t in alone]
    for sid, drafts in (("right", alone[:3]), ("wrong", wrong[:3]), ("half", alone[:1] + wrong[1:3])):
        r = _verify(stub, sid, ids, draft_token_ids=drafts, temperature=1.0, seed=7)
        emitted = drafts[:r.num_accepted_tokens] + [_next_token(r)[1]]
        assert emitted == alone[:len(emitted)], sid
        assert r.num_accepted_tokens == {"right": 3, "wrong": 0, "half": 1}[sid]
        assert release(stub, sid)
    assert release(stub, "alone")


# --------------------------------------------------------------------------------------------------
# errors


def test_unknown_sequence_is_not_found_and_says_to_resend(stub, ref, clean):
    ids, _ = ref
    err = rpc_error(lambda: _verify(stub, "never-seen", ids[-1:], start_position=len(ids) - 1))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert "resend" in err.details() and "start_position=0" in err.details() and "never-seen" in err.details()
    # resending the whole history works
    r = _verify(stub, "never-seen", ids)
    assert r.sequence_length == len(ids)
    _ok_request(stub, ref)


def test_start_position_beyond_what_is_held_is_not_found(stub, ref, clean):
    ids, _ = ref
    _verify(stub, "short", ids[:2])
    err = rpc_error(lambda: _verify(stub, "short", ids[3:], start_position=3))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "holds 2 tokens" in err.details()


def test_too_many_draft_tokens_is_invalid_argument(stub, ref, clean):
    ids, out = ref
    err = rpc_error(lambda: _verify(stub, "k", ids, draft_token_ids=[out[0]] * 33))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "33" in err.details() and "num_speculative_tokens" in err.details()
    _ok_request(stub, ref)


def _dist(token_ids=(), probs=()):
    return common_pb2.TokenDistribution(token_ids=list(token_ids), probs=list(probs))


MALFORMED_PROBS = {
    "fewer rows than drafts": lambda t: [_dist([t[0]], [1.0])],
    "ids and probs differ in length": lambda t: [_dist([t[0], 5], [1.0]), _dist([t[1]], [1.0])],
    "token outside the vocabulary": lambda t: [_dist([t[0], VOCAB + 1], [0.5, 0.5]), _dist([t[1]], [1.0])],
    "dense row longer than the vocabulary": lambda t: [_dist(probs=[1.0 / (VOCAB + 1)] * (VOCAB + 1)),
                                                        _dist([t[1]], [1.0])],
}


@pytest.mark.parametrize("case", MALFORMED_PROBS)
def test_malformed_draft_probs_is_invalid_argument(stub, ref, clean, case):
    ids, out = ref
    drafts = out[:2]
    err = rpc_error(lambda: _verify(stub, "p", ids, draft_token_ids=drafts, draft_probs=MALFORMED_PROBS[case](drafts),
                                    temperature=1.0, seed=1))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "draft_probs" in err.details()
    _ok_request(stub, ref)


@pytest.mark.parametrize("value", [math.nan, math.inf, -0.5])
def test_non_finite_or_negative_draft_probs_is_invalid_argument(stub, ref, clean, value):
    """q must be a probability distribution. BUG: NaN/inf reach torch.multinomial (INTERNAL), a
    negative q(x) is silently accepted."""
    ids, out = ref
    probs = [_dist([out[0], 7], [value, 0.5])]
    err = rpc_error(lambda: _verify(stub, "nan", ids, draft_token_ids=out[:1], draft_probs=probs,
                                    temperature=1.0, seed=3))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    assert "draft_probs" in err.details()
    _ok_request(stub, ref)


@pytest.mark.parametrize(("field", "value", "word"), [
    ("new_token_ids", [VOCAB + 3], "vocabulary"),
    ("draft_token_ids", [VOCAB + 3], "vocabulary"),
    ("sequence_id", "", "sequence_id"),
])
def test_invalid_ids_are_invalid_argument(stub, ref, clean, field, value, word):
    ids, out = ref
    kw = {"sequence_id": "ids", "new_token_ids": ids, "draft_token_ids": out[:1]}
    kw[field] = value
    err = rpc_error(lambda: _verify(stub, **kw))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and word in err.details()
    _ok_request(stub, ref)


def test_empty_history_is_invalid_argument(stub, ref, clean):
    err = rpc_error(lambda: _verify(stub, "empty", []))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty" in err.details()
    _ok_request(stub, ref)


def test_sequence_longer_than_max_model_len_is_invalid_argument(stub, ref, clean):
    ids, out = ref
    err = rpc_error(lambda: _verify(stub, "long", (ids * 256)[:254], draft_token_ids=out[:4]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len=256" in err.details()
    _ok_request(stub, ref)


def test_max_sequences_is_resource_exhausted_until_one_is_released(stub, target, ref, clean):
    ids, _ = ref
    for i in range(MAX_SEQUENCES):
        _verify(stub, f"cap{i}", ids)
    err = rpc_error(lambda: _verify(stub, "one-too-many", ids))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(MAX_SEQUENCES) in err.details() and "max_sequences" in err.details()
    # held sequences keep working at the cap
    assert _verify(stub, "cap0", [], start_position=len(ids)).sequence_length == len(ids)
    assert release(stub, "cap1")
    assert _verify(stub, "one-too-many", ids).sequence_length == len(ids)


# --------------------------------------------------------------------------------------------------
# batching isolation and cancellation (library bugs are documented in the assertion messages)


class BatcherGate:
    """Holds the backend's batcher inside a batch until ``open()`` so that the next calls queue up
    and run together as ONE batch (deterministic batching)."""

    def __init__(self, backend):
        self.batcher = backend.batcher
        self.real = self.batcher._run_batch
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.batcher._run_batch = self._run

    def _run(self, items):
        self.entered.set()
        assert self.gate.wait(30)
        return self.real(items)

    def wait_queued(self, n: int) -> None:
        wait_until(lambda: self.batcher._queue.qsize() >= n, what=f"{n} queued calls")

    def open(self) -> None:
        self.gate.set()

    def close(self) -> None:
        self.gate.set()
        self.batcher._run_batch = self.real


@pytest.fixture
def batcher_gate(target):
    gate = BatcherGate(target.backend)
    yield gate
    gate.close()


def _in_thread(stub, request, timeout=30):
    return run_in_thread(lambda: stub.Verify(request, timeout=timeout))


def test_a_bad_call_does_not_fail_its_batch_neighbours(stub, target, ref, clean, batcher_gate):
    """BUG: an exception that is not a SpecDecError inside TargetWorker.verify_batch (here NaN q
    reaching torch.multinomial) fails every call of the batch, not only the bad one."""
    ids, out = ref
    blocker, _ = _in_thread(stub, verify_request("blocker", ids))
    assert batcher_gate.entered.wait(10)
    bad_thread, bad = _in_thread(stub, verify_request("bad", ids, draft_token_ids=out[:1],
                                                      draft_probs=[_dist([out[0]], [math.nan])],
                                                      temperature=1.0, seed=1))
    good_thread, good = _in_thread(stub, verify_request("good", ids, draft_token_ids=out[:3]))
    batcher_gate.wait_queued(2)
    batcher_gate.open()
    for t in (blocker, bad_thread, good_thread):
        t.join(30)
    assert "error" in bad
    assert "error" not in good, f"a neighbour's bad draft_probs failed this call: {good['error'].details()}"
    assert good["result"].num_accepted_tokens == 3
    assert max(target.backend.batch_sizes[-2:]) == 2  # the two really shared a batch


def test_call_that_timed_out_in_the_queue_does_not_recreate_a_released_sequence(stub, target, ref, clean,
                                                                                  batcher_gate):
    """BUG: a Verify whose deadline passed while it waited in the batcher's queue still runs later,
    re-creating the sequence after the client released it (held until sequence_ttl_seconds)."""
    ids, _ = ref
    blocker, _ = _in_thread(stub, verify_request("blocker", ids))
    assert batcher_gate.entered.wait(10)
    err = rpc_error(lambda: stub.Verify(verify_request("late", ids), timeout=0.3))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert release(stub, "late") is False  # what the gateway does after a deadline: nothing held yet
    batcher_gate.open()
    blocker.join(30)
    release(stub, "blocker")
    # A call queued after "late" has been answered: the batches are FIFO and a batch answers its calls
    # only when it has run, so whatever became of "late" (run or dropped) has happened by now.
    _verify(stub, "after-late", ids)
    release(stub, "after-late")
    held = list(target.backend.runner.sequences)
    assert "late" not in held, "a call abandoned by its caller re-created the released sequence 'late'"


def test_denormal_temperature_is_not_an_internal_error(stub, ref, clean):
    """BUG: temperature=1e-40 (a valid float32) makes logits/temperature overflow to inf, softmax NaN,
    and torch.multinomial raises: INTERNAL instead of greedy decoding or INVALID_ARGUMENT."""
    ids, out = ref
    try:
        r = _verify(stub, "tiny-t", ids, draft_token_ids=out[:2], temperature=1e-40, seed=1)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.details(), (
            err.code(), err.details())
    else:  # read as (near-)greedy: the target's argmax continuation
        assert r.num_accepted_tokens == 2 and _next_token(r)[1] == out[2]


# --------------------------------------------------------------------------------------------------
# idle expiry, asynchronous load


def test_idle_sequence_is_evicted_after_its_ttl(servers, target_dir, ref):
    """The expiry releases exactly the sequences idle for longer than the TTL (checked at chosen
    instants, not by racing a short TTL), and the background loop runs it."""
    import time

    handle = servers.target(target_dir, sequence_ttl_seconds=60)
    backend = handle.backend
    with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
        stub = target_service_pb2_grpc.TargetServiceStub(ch)
        ids, _ = ref
        _verify(stub, "idle", ids)
        assert backend.evict_idle(time.monotonic() + 59) == [] and "idle" in backend.runner.sequences
        assert backend.evict_idle(time.monotonic() + 61) == ["idle"] and "idle" not in backend.runner.sequences
        err = rpc_error(lambda: _verify(stub, "idle", [], start_position=len(ids)))
        assert err.code() == grpc.StatusCode.NOT_FOUND and "resend" in err.details()
        assert _verify(stub, "idle", ids).sequence_length == len(ids)  # resent: served again

    short = servers.target(target_dir, sequence_ttl_seconds=0.2)
    with grpc.insecure_channel(f"127.0.0.1:{short.port}") as ch:
        _verify(target_service_pb2_grpc.TargetServiceStub(ch), "idle", ref[0])
    wait_until(lambda: short.backend.sequences_expired == 1, timeout=5, what="the expiry loop")
    assert not short.backend.runner.sequences


def test_async_load_is_not_serving_and_unavailable_until_loaded(servers, target_dir, ref, monkeypatch):
    """BUG: before the model is loaded, GetInfo/Verify answer INTERNAL ("internal error: Exception")
    instead of UNAVAILABLE: require_ready's context.abort() raises inside map_errors, which re-aborts."""
    gate = threading.Event()
    real_load = specdec.serving.backend.load_model
    monkeypatch.setattr(specdec.serving.backend, "load_model", lambda *a, **kw: gate.wait(30) and real_load(*a, **kw))
    handle = servers.target(target_dir, load_async=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
            assert health_status(ch) == NOT_SERVING and health_status(ch, SERVICE_NAME) == NOT_SERVING
            stub = target_service_pb2_grpc.TargetServiceStub(ch)
            codes = {}
            for name, call in [("GetInfo", lambda: stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)),
                               ("Verify", lambda: _verify(stub, "early", ref[0]))]:
                err = rpc_error(call)
                codes[name] = (err.code(), err.details())
            gate.set()
            wait_until(lambda: health_status(ch) == SERVING, timeout=30, what="SERVING")
            assert stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10).info.vocab_size == VOCAB
    finally:
        gate.set()
        assert handle.backend.ready.wait(30)
    for name, (code, details) in codes.items():
        assert code == grpc.StatusCode.UNAVAILABLE and "loading" in details, (name, code, details)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize(("setting", "flag"), [({"block_size": 0}, "--block-size"),
                                               ({"gpu_memory_utilization": 1.5}, "--gpu-memory-utilization"),
                                               ({"kv_cache_memory": 0}, "--kv-cache-memory")])
def test_bad_kv_pool_settings_fail_before_the_model_loads(tmp_path, monkeypatch, setting, flag):
    from specdec.errors import ConfigError
    from target_service.server import create_server
    from tests.services_conftest_helpers import target_config

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(specdec.serving.backend, "load_model", never)
    with pytest.raises(ConfigError, match=flag):
        create_server(target_config(tmp_path / "any-model", **setting))


def test_unloadable_model(servers, tmp_path):
    from specdec.errors import ModelNotFoundError
    from target_service.server import create_server
    from tests.services_conftest_helpers import target_config

    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError) as info:
        create_server(target_config(missing))
    assert str(missing) in str(info.value)
    # asynchronously: the server stays up and NOT_SERVING
    handle = servers.target(missing, load_async=True)
    loader = [t for t in threading.enumerate() if t.name == "model-load"]
    for t in loader:
        t.join(30)
    with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
        assert health_status(ch) == NOT_SERVING
        # calls say why, for good (not "still loading; retry"): the operator must fix the model
        err = rpc_error(lambda: target_service_pb2_grpc.TargetServiceStub(ch).GetInfo(
            common_pb2.GetInfoRequest(), timeout=10))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "failed to load" in err.details() and str(missing) in err.details()


def test_stopping_a_service_while_its_model_loads_leaves_no_worker_threads(servers, target_dir, monkeypatch):
    """BUG: Backend.close() before an asynchronous load finishes does not stop the load: when it
    completes it starts the batcher thread of a stopped service (never closed) and flips its health
    to SERVING."""
    gate = threading.Event()
    real_load = specdec.serving.backend.load_model
    monkeypatch.setattr(specdec.serving.backend, "load_model", lambda *a, **kw: gate.wait(30) and real_load(*a, **kw))

    def batchers():
        return sum(t.name == "target-batcher" and t.is_alive() for t in threading.enumerate())

    before = batchers()
    handle = servers.target(target_dir, load_async=True)
    loaders = [t for t in threading.enumerate() if t.name == "model-load"]
    servers.stop(handle, 0)
    gate.set()
    for t in loaders:
        t.join(30)
    leaked = batchers() - before
    ready = handle.backend.ready.is_set()
    if ready:  # clean up what the bug left behind
        handle.backend.batcher.close()
    assert leaked == 0, "a stopped service started a batcher thread"
    assert not ready, "a stopped service finished loading and reports ready"
