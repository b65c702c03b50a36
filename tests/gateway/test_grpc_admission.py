"""gRPC and HTTP share one admission: past --max-concurrent-requests + --max-queue-len, a gRPC Generate is
RESOURCE_EXHAUSTED and an HTTP request 429, from the same counters, the same gauges and the same refused
counter (a gRPC call never waits unseen in the server's worker pool)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from specdec.serving.metrics import exposition
from specdec.v1 import generation_service_pb2_grpc
from tests.gateway.openai.http_helpers import httpx
from tests.metrics_helpers import delta, parse, total
from tests.services_conftest_helpers import PROMPTS, collect, generate, generate_request, wait_released, wait_until

RUNNING, QUEUED = 2, 2


@pytest.fixture(scope="module")
def limited(servers, target_dir, good_draft_dir):
    target, draft = servers.target(target_dir), servers.draft(good_draft_dir)
    gw = servers.gateway(target, draft, http_port=0, max_concurrent_requests=RUNNING, max_queue_len=QUEUED)
    channel = grpc.insecure_channel(f"127.0.0.1:{gw.port}")
    client = httpx.Client(base_url=f"http://127.0.0.1:{gw.http_port}", timeout=120)
    yield target, draft, gw, generation_service_pb2_grpc.GenerationServiceStub(channel), client
    client.close()
    channel.close()


class Gate:
    """Holds every Verify call the gateway makes until ``open()``: the admitted streams stay running."""

    def __init__(self, monkeypatch, client):
        self._open = threading.Event()
        verify = client.verify

        def held(*args, **kwargs):
            assert self._open.wait(120), "the test never opened the gate"
            return verify(*args, **kwargs)

        monkeypatch.setattr(client, "verify", held)

    def open(self) -> None:
        self._open.set()


def _series(model: str) -> dict:
    samples = parse(exposition().decode())
    labels = {"service": "gateway", "model_name": model}
    return {"samples": samples, "running": total(samples, "specdec_num_requests_running", **labels),
            "waiting": total(samples, "specdec_num_requests_waiting", **labels)}


def _grpc(stub, request):
    try:
        return collect(stub.Generate(request, timeout=120))
    except grpc.RpcError as err:
        return err.code()


def test_ten_grpc_calls_past_two_plus_two_some_refused_the_rest_served(limited, monkeypatch):
    target, draft, gw, stub, _ = limited
    request = generate_request(PROMPTS[0], max_tokens=8)
    reference = generate(stub, request)
    model = gw.backend.served_model_name
    before = _series(model)["samples"]
    gate = Gate(monkeypatch, gw.backend.target)
    pool = ThreadPoolExecutor(10)
    try:
        calls = [pool.submit(_grpc, stub, request) for _ in range(10)]
        # the admission sees all ten: two run, two wait, six are refused while the gate is still shut
        wait_until(lambda: sum(c.done() for c in calls) == 10 - RUNNING - QUEUED, timeout=60,
                   what="six of the ten calls to be refused")
        admission = gw.backend.admission
        wait_until(lambda: (admission.running, admission.waiting) == (RUNNING, QUEUED), timeout=30,
                   what="two calls running and two queued")
        now = _series(model)
        assert (now["running"], now["waiting"]) == (RUNNING, QUEUED)
        refused = [c.result() for c in calls if c.done()]
        assert refused == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 6, refused
    finally:
        gate.open()
        results = [c.result(timeout=120) for c in calls]
        pool.shutdown()
    served = [r for r in results if not isinstance(r, grpc.StatusCode)]
    assert len(served) == RUNNING + QUEUED
    assert all((r.text, r.token_ids) == (reference.text, reference.token_ids) for r in served)
    wait_released(target, draft)
    after = _series(model)
    assert (after["running"], after["waiting"]) == (0, 0)
    assert (gw.backend.admission.running, gw.backend.admission.waiting) == (0, 0)
    labels = {"service": "gateway", "model_name": model}
    assert delta(after["samples"], before, "specdec_requests_refused_total", **labels, reason="queue_full") == 6
    assert delta(after["samples"], before, "specdec_request_errors_total", **labels, protocol="grpc",
                 code="RESOURCE_EXHAUSTED") == 6


def test_http_and_grpc_count_together(limited, monkeypatch, target_dir):
    target, draft, gw, stub, client = limited
    body = {"model": str(target_dir), "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    request = generate_request(PROMPTS[1], max_tokens=6)
    reference = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    model = gw.backend.served_model_name
    before = _series(model)["samples"]
    admission = gw.backend.admission
    gate = Gate(monkeypatch, gw.backend.target)
    pool = ThreadPoolExecutor(4)
    try:
        # two HTTP requests take both running slots, two gRPC calls the whole queue ...
        http_calls = [pool.submit(client.post, "/v1/completions", json=body) for _ in range(RUNNING)]
        wait_until(lambda: admission.running == RUNNING, timeout=30, what="the HTTP requests to run")
        grpc_calls = [pool.submit(_grpc, stub, request) for _ in range(QUEUED)]
        wait_until(lambda: admission.waiting == QUEUED, timeout=30, what="the gRPC calls to queue")
        # ... so one more of either protocol is refused at once, by the same admission
        refused_http = client.post("/v1/completions", json=body)
        assert refused_http.status_code == 429, refused_http.text
        assert _grpc(stub, request) == grpc.StatusCode.RESOURCE_EXHAUSTED
        now = _series(model)
        assert (now["running"], now["waiting"]) == (RUNNING, QUEUED)
    finally:
        gate.open()
        http_results = [c.result(timeout=120) for c in http_calls]
        grpc_results = [c.result(timeout=120) for c in grpc_calls]
        pool.shutdown()
    assert [r.status_code for r in http_results] == [200] * RUNNING
    assert all(r.json()["choices"][0]["text"] == reference for r in http_results)
    assert all(not isinstance(r, grpc.StatusCode) and r.text == reference for r in grpc_results), grpc_results
    wait_released(target, draft)
    after = _series(model)
    assert (after["running"], after["waiting"]) == (0, 0)
    assert delta(after["samples"], before, "specdec_requests_refused_total", service="gateway", model_name=model,
                 reason="queue_full") == 2
