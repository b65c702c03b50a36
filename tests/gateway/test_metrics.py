"""Prometheus metrics of a running stack: the speculation counters equal the API's usage.spec_decode
for the same requests (greedy, sampled, streamed, n > 1, over HTTP and gRPC), the request histograms
count every finished sequence, errors are counted by status, the services' own /metrics ports serve
their series, and promtool finds every exposition clean."""

from __future__ import annotations

import grpc
import pytest

from specdec.serving import metrics as M
from specdec.serving.auth import bearer_metadata
from specdec.v1 import generation_service_pb2_grpc
from tests.gateway.openai.http_helpers import K, KEY, PROMPTS, base_url, openai_client, raw_client, serve, stream_texts
from tests.metrics_helpers import delta, promtool_problems, scrape, total
from tests.services_conftest_helpers import collect, generate_request

N = 12


@pytest.fixture(scope="module")
def stack(target_dir, good_draft_dir):
    s = serve(target_dir, good_draft_dir)
    try:
        yield s
    finally:
        s.stop(0)


@pytest.fixture(scope="module")
def model(target_dir) -> str:
    return str(target_dir)


def _metrics(stack):
    return scrape(f"{base_url(stack)}/metrics")


def _add(acc: dict, sd: dict) -> None:
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        acc[key] = acc.get(key, 0) + sd[key]
    per_pos = acc.setdefault("per_pos", [])
    for i, c in enumerate(sd["num_accepted_tokens_per_pos"]):
        per_pos += [0] * (i + 1 - len(per_pos))
        per_pos[i] += c


def test_counters_agree_with_usage(stack, model):
    client = openai_client(stack)
    _, before = _metrics(stack)
    acc: dict = {}
    prompt_tokens = completion_tokens = sequences = 0

    def record(usage, n_seqs):
        nonlocal prompt_tokens, completion_tokens, sequences
        _add(acc, usage.model_extra["spec_decode"])
        prompt_tokens += usage.prompt_tokens
        completion_tokens += usage.completion_tokens
        sequences += n_seqs

    greedy = client.completions.create(model=model, prompt=PROMPTS, max_tokens=N, temperature=0)
    record(greedy.usage, 2)
    sampled = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=N, temperature=1.0, seed=5, n=3)
    record(sampled.usage, 3)
    chunks = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=N, temperature=0.8, seed=1,
                                       stream=True, stream_options={"include_usage": True})
    record(stream_texts(chunks)[2], 1)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=N,
                                          temperature=0, stream=True, stream_options={"include_usage": True}, n=2)
    record(stream_texts(chat, chat=True)[2], 2)
    # and one over gRPC: its last response carries the same statistics
    with grpc.insecure_channel(f"127.0.0.1:{stack.gateway.port}") as channel:
        out = collect(generation_service_pb2_grpc.GenerationServiceStub(channel).Generate(
            generate_request(PROMPTS[0], max_tokens=N, k=2), metadata=bearer_metadata(KEY), timeout=60))
    s = out.last.stats
    acc["num_drafts"] += s.num_drafts
    acc["num_draft_tokens"] += s.num_draft_tokens
    acc["num_accepted_tokens"] += s.num_accepted_tokens
    prompt_tokens += out.last.prompt_tokens
    completion_tokens += out.last.completion_tokens
    sequences += 1
    client.close()

    text, after = _metrics(stack)
    labels = {"service": "gateway", "model_name": model}
    assert acc["num_draft_tokens"] > acc["num_accepted_tokens"] > 0, acc  # accepts and rejects both happened
    assert delta(after, before, "specdec_spec_decode_num_drafts_total", **labels) == acc["num_drafts"]
    assert delta(after, before, "specdec_spec_decode_num_draft_tokens_total", **labels) == acc["num_draft_tokens"]
    accepted = delta(after, before, "specdec_spec_decode_num_accepted_tokens_total", **labels)
    assert accepted == acc["num_accepted_tokens"]
    per_pos = delta(after, before, "specdec_spec_decode_num_accepted_tokens_per_pos_total", **labels)
    assert per_pos == accepted  # the positions add up to the accepted total
    for pos, count in enumerate(acc["per_pos"]):  # position by position, for the HTTP requests
        got = delta(after, before, "specdec_spec_decode_num_accepted_tokens_per_pos_total", **labels,
                    position=str(pos))
        assert got >= count, (pos, got, count)
    assert delta(after, before, "specdec_prompt_tokens_total", **labels) == prompt_tokens
    assert delta(after, before, "specdec_generation_tokens_total", **labels) == completion_tokens
    assert delta(after, before, "specdec_request_success_total", **labels, finished_reason="length") == sequences
    for hist in ("specdec_e2e_request_latency_seconds", "specdec_time_to_first_token_seconds",
                 "specdec_request_queue_time_seconds"):
        assert delta(after, before, f"{hist}_count", **labels) == sequences, hist
    # inter-token latencies: one per round after the first, of every sequence
    assert delta(after, before, "specdec_inter_token_latency_seconds_count", **labels) >= sequences
    assert total(after, "specdec_num_requests_running", **labels) == 0
    assert total(after, "specdec_num_requests_waiting", **labels) == 0
    # where a round's time goes: every round called Verify once
    verify_calls = delta(after, before, "specdec_backend_call_duration_seconds_count", **labels, phase="verify")
    assert verify_calls >= sequences
    assert delta(after, before, "specdec_batch_size_count", service="target") >= 1
    assert delta(after, before, "specdec_forward_pass_seconds_count", service="draft") >= 1
    assert total(after, "specdec_build_info", service="gateway", model_name=model, method="draft_model",
                 num_speculative_tokens=str(K)) == 1
    assert "specdec_sequences_cached" in text and "process_cpu_seconds_total" in text
    assert promtool_problems(text) == ""


def test_errors_are_counted_by_status(stack, model):
    _, before = _metrics(stack)
    with raw_client(stack) as raw:
        assert raw.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 0}).status_code == 400
        assert raw.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
    with raw_client(stack, api_key="wrong") as raw:
        assert raw.get("/v1/models").status_code == 401
    with grpc.insecure_channel(f"127.0.0.1:{stack.gateway.port}") as channel:
        stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(generate_request(PROMPTS[0], max_tokens=N, k=99), metadata=bearer_metadata(KEY),
                               timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    _, after = _metrics(stack)
    labels = {"service": "gateway", "model_name": model}
    for protocol, code in (("http", "400"), ("http", "404"), ("http", "401"), ("grpc", "INVALID_ARGUMENT")):
        assert delta(after, before, "specdec_request_errors_total", **labels, protocol=protocol, code=code) == 1


def test_metrics_need_no_api_key(stack):
    with raw_client(stack, api_key=None) as raw:
        response = raw.get("/metrics")
    assert response.status_code == 200 and "specdec_spec_decode_num_drafts_total" in response.text
    with raw_client(stack, api_key=None) as raw:  # while /v1/ still wants the key
        assert raw.get("/v1/models").status_code == 401


def test_services_alone_serve_their_own_metrics(servers, target_dir, good_draft_dir):
    target = servers.target(target_dir, metrics_port=0)
    draft = servers.draft(good_draft_dir, metrics_port=0)
    gateway = servers.gateway(target, draft, metrics_port=0)  # gRPC only: --metrics-port
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        collect(generation_service_pb2_grpc.GenerationServiceStub(channel).Generate(
            generate_request(PROMPTS[1], max_tokens=8), timeout=60))
    for handle, service in ((target, "target"), (draft, "draft"), (gateway, "gateway")):
        assert handle.metrics_port
        text, samples = scrape(f"http://127.0.0.1:{handle.metrics_port}/metrics")
        assert promtool_problems(text) == "", service
        if service == "gateway":
            assert total(samples, "specdec_spec_decode_num_drafts_total", service="gateway") >= 1
        else:
            model = str(target_dir if service == "target" else good_draft_dir)
            assert total(samples, "specdec_batch_size_count", service=service, model_name=model) >= 2  # warm-up + 1
            assert total(samples, "specdec_build_info", service=service, model_name=model, dtype="float32") == 1
            # the KV pool, read from the runner at the scrape
            kv = handle.backend.runner.kv_stats()
            labels = {"service": service, "model_name": model}
            assert total(samples, "specdec_kv_cache_free_blocks", **labels) == kv.free_blocks > 0
            assert 0 <= total(samples, "specdec_kv_cache_usage_ratio", **labels) <= 1
            for name in ("specdec_prefix_cache_queries_total", "specdec_prefix_cache_hits_total",
                         "specdec_num_preemptions_total"):
                assert any(n == name and set(labels.items()) <= ls for n, ls in samples), name
    # in-process, all three services share the one registry that /metrics exposes
    assert all(f'service="{name}"' in M.exposition().decode() for name in ("target", "draft", "gateway"))


def test_one_log_line_per_finished_sequence_without_the_prompt(stack, model, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="specdec.requests")
    client = openai_client(stack)
    client.completions.create(model=model, prompt="a secret prompt", max_tokens=6, temperature=0, n=2)
    client.close()
    records = [r for r in caplog.records if r.name == "specdec.requests"]
    assert len(records) == 2
    for r in records:
        assert r.generated_tokens == 6 and r.finish_reason == "length" and r.prompt_tokens > 0
        assert 0.0 <= r.acceptance_rate <= 1.0 and 0 < r.ttft_seconds <= r.e2e_seconds
        assert "secret" not in r.getMessage() and not hasattr(r, "prompt")


def test_log_requests_adds_the_prompt(servers, target_dir, good_draft_dir, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="specdec.requests")
    target, draft = servers.target(target_dir), servers.draft(good_draft_dir)
    gateway = servers.gateway(target, draft, log_requests=True)
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        collect(generation_service_pb2_grpc.GenerationServiceStub(channel).Generate(
            generate_request("The quick brown fox", max_tokens=4), timeout=60))
    (record,) = [r for r in caplog.records if r.name == "specdec.requests"]
    assert "quick brown fox" in record.prompt
