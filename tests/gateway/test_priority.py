"""--scheduling-policy priority (vLLM's): waiting requests start lowest priority first, then by arrival; under
fcfs (the default) they start in arrival order, and a request that sets a priority is a clear 400 /
INVALID_ARGUMENT."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from gateway.resilience import Admission
from specdec.sampling import SamplingParams
from specdec.v1 import generation_service_pb2_grpc
from tests.gateway.openai.http_helpers import assert_error_body, httpx
from tests.services_conftest_helpers import PROMPTS, generate_request, rpc_error


def _start_order(priorities: list[int]) -> list[int]:
    """With one slot taken, sequences with these priorities queue (in this order); the order they start in."""
    admission = Admission(max_running=1, max_waiting=16, max_queue_time=30)
    admission.reserve(1)
    admission.start()
    started: list[int] = []
    threads = []
    for i, p in enumerate(priorities):
        admission.reserve(1)

        def run(i=i, p=p):
            admission.start(priority=p)
            started.append(i)
            admission.finish()

        threads.append(threading.Thread(target=run))
        threads[-1].start()
        while len(admission._queue) < i + 1:  # queued in this order
            time.sleep(0.001)
    admission.finish()
    for t in threads:
        t.join(10)
    return started


def test_waiting_sequences_start_by_priority_then_arrival():
    assert _start_order([5, 1, 3, 1, 0]) == [4, 1, 3, 2, 0]


def test_fcfs_starts_waiting_sequences_in_arrival_order():
    assert _start_order([0] * 6) == list(range(6))


@pytest.fixture(scope="module")
def fcfs(servers, target_dir):
    gw = servers.gateway(servers.target(target_dir), http_port=0)
    with grpc.insecure_channel(f"127.0.0.1:{gw.port}") as channel, \
            httpx.Client(base_url=f"http://127.0.0.1:{gw.http_port}", timeout=60) as client:
        yield generation_service_pb2_grpc.GenerationServiceStub(channel), client


def test_a_priority_under_fcfs_is_refused_saying_what_to_do(fcfs):
    stub, client = fcfs
    err = rpc_error(lambda: stub.Generate(generate_request(PROMPTS[0], max_tokens=2, priority=1), timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "--scheduling-policy priority" in err.details()
    r = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2, "priority": -1})
    assert "--scheduling-policy priority" in assert_error_body(r, 400, param="priority")["message"]
    ok = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2, "priority": 0})
    assert ok.status_code == 200  # the default is accepted, and the gateway serves on


def test_served_requests_start_by_priority(servers, target_dir):
    """One slot: a long request holds it while three wait with priorities 3, 1, 2 (sent in that order); they
    get their first tokens in the order 1, 2, 3."""
    gw = servers.gateway(servers.target(target_dir), scheduling_policy="priority", max_concurrent_requests=1)
    firsts: list[int] = []
    with grpc.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
        stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
        holder = stub.Generate(generate_request(PROMPTS[0], max_tokens=40), timeout=60)
        next(holder)  # it runs

        def run(p: int) -> None:
            for _ in stub.Generate(generate_request(PROMPTS[1], max_tokens=2, priority=p), timeout=60):
                firsts.append(p)
                return

        waiting = []
        for p in (3, 1, 2):
            waiting.append(threading.Thread(target=run, args=(p,)))
            waiting[-1].start()
            give_up = time.monotonic() + 10
            while gw.backend.admission.waiting < len(waiting) and time.monotonic() < give_up:
                time.sleep(0.005)
        assert gw.backend.admission.waiting == 3
        list(holder)  # the long request finishes: the slot goes to the waiting ones, one at a time
        for t in waiting:
            t.join(60)
    assert firsts == [1, 2, 3]
    seq = gw.backend.new_sequence([5, 6, 7], SamplingParams(temperature=0), priority=2)
    assert seq.params.priority == 2  # every call of the sequence carries it to the services (they schedule by it)
