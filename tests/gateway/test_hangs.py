"""Hung backends and graceful drains, with the services as real processes and real signals.

- The target stops answering mid-stream (SIGSTOP): every stream in flight ends with a clean
  UNAVAILABLE naming the target within seconds (each backend call has a deadline of its own), new
  requests are refused at once, and after SIGCONT the service answers again, identical to the target
  alone.
- SIGTERM drains (--drain-grace-seconds): readiness turns false at once (health NOT_SERVING, HTTP /ready
  503), new work is refused with UNAVAILABLE / 503, the stream in flight completes intact, and the process
  exits 0 within the window. Checked for the target service and for the gateway process (which serves
  with no torch library mapped: it runs no model).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from gateway.config import GatewayConfig
from specdec.v1 import generation_service_pb2_grpc, target_service_pb2_grpc
from tests.service_processes import HOST, ROOT, free_port, service_pair
from tests.services_conftest_helpers import (
    PROMPTS,
    collect,
    generate,
    generate_request,
    health_status,
    hooked,
    offline_greedy,
    rpc_error,
    run_in_thread,
    verify_request,
    wait_until,
)

MAX_TOKENS = 32
NUM_STREAMS = 3
CALL_FLOOR_S = 3.0  # --backend-call-timeout-floor-seconds: a tiny model's call takes milliseconds


@pytest.fixture(scope="module")
def processes(target_dir, good_draft_dir, tmp_path_factory):
    yield from service_pair(target_dir, good_draft_dir, tmp_path_factory.mktemp("hang-logs"))


def _gateway(servers, target, draft, **kw):
    from gateway.server import create_server

    config = GatewayConfig(target_addr=target.address, draft_addr=draft.address, host=HOST, port=0,
                           num_speculative_tokens=3, startup_timeout_seconds=60.0, **kw)
    handle = servers.add(create_server(config))
    channel = grpc.insecure_channel(f"{HOST}:{handle.port}")
    return handle.backend, generation_service_pb2_grpc.GenerationServiceStub(channel), channel


@pytest.mark.heavy
def test_a_stopped_target_is_a_clean_unavailable_in_seconds_then_service_resumes(processes, servers, target_llm):
    target, draft = processes
    gw, stub, channel = _gateway(servers, target, draft, backend_call_timeout_floor_seconds=CALL_FLOOR_S)
    reference = offline_greedy(target_llm, PROMPTS[0], MAX_TOKENS)
    stopped = False
    try:
        assert (generate(stub, generate_request(PROMPTS[0], max_tokens=MAX_TOKENS)).token_ids == reference[1])
        with hooked(gw.target, "verify") as hook:
            hook.pause_at(NUM_STREAMS + 1)  # every stream is in flight, one round done at least
            streams = [run_in_thread(lambda p=PROMPTS[i % 2]: collect(stub.Generate(
                generate_request(p, max_tokens=MAX_TOKENS), timeout=300))) for i in range(NUM_STREAMS)]
            hook.wait_paused(60)
            target.proc.send_signal(signal.SIGSTOP)  # hung: the process is there, its port open, no answers
            stopped = True
            began = time.monotonic()
            hook.resume()
            for thread, _box in streams:
                thread.join(60)  # the old code: still waiting after 400 s
            waited = time.monotonic() - began
        assert not any(thread.is_alive() for thread, _ in streams)
        for _thread, box in streams:
            err = box.get("error")
            assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.UNAVAILABLE, box
            assert f"target service at {target.address} did not answer" in err.details()
        assert waited < 8 * CALL_FLOOR_S, f"the streams outlived their backend deadline: {waited:.1f} s"

        # while it is hung: refused at once, by name
        began = time.monotonic()
        err = rpc_error(lambda: generate(stub, generate_request(PROMPTS[1], max_tokens=8), timeout=30))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - began < 2.0
        assert target.address in err.details()

        target.proc.send_signal(signal.SIGCONT)
        stopped = False
        wait_until(lambda: not gw.target_health.down, timeout=30, what="the gateway to see the target back")
        out = generate(stub, generate_request(PROMPTS[0], max_tokens=MAX_TOKENS))
        assert (out.text, out.token_ids) == reference  # what was in flight on it corrupted nothing
    finally:
        if stopped:
            target.proc.send_signal(signal.SIGCONT)
        channel.close()


@pytest.mark.heavy
def test_sigterm_drains_the_target_stream_in_flight_completes(processes, servers, target_llm):
    target, draft = processes
    gw, stub, channel = _gateway(servers, target, draft)
    reference = offline_greedy(target_llm, PROMPTS[1], MAX_TOKENS)
    target_channel = grpc.insecure_channel(target.address)
    try:
        with hooked(gw.target, "verify") as hook:
            hook.pause_at(3)
            thread, box = run_in_thread(lambda: collect(stub.Generate(
                generate_request(PROMPTS[1], max_tokens=MAX_TOKENS), timeout=120)))
            hook.wait_paused(60)
            target.proc.send_signal(signal.SIGTERM)
            # readiness false first; a sequence the target does not hold is refused (another replica takes it)
            wait_until(lambda: health_status(target_channel) == health_pb2.HealthCheckResponse.NOT_SERVING,
                       timeout=5, what="the target's health to say NOT_SERVING")
            err = rpc_error(lambda: target_service_pb2_grpc.TargetServiceStub(target_channel).Verify(
                verify_request("a-new-one", [1, 2, 3]), timeout=10))
            assert err.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.details()
            assert target.proc.poll() is None
            hook.resume()
            thread.join(60)
        assert "error" not in box, box.get("error")
        assert (box["result"].text, box["result"].token_ids) == reference  # the stream in flight completed
        assert target.proc.wait(30) == 0  # then it exits, cleanly, within the window
    finally:
        target_channel.close()
        channel.close()
        if target.proc.poll() is not None:
            target.start()


def _http(port: int, path: str, body: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{HOST}:{port}{path}", data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.heavy
def test_sigterm_drains_the_gateway_process(processes, target_llm, tmp_path):
    target, draft = processes
    port, http_port = free_port(), free_port()
    log = tmp_path / "gateway.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECDEC_GATEWAY_DRAIN_GRACE_SECONDS": "30"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "--target-addr", target.address, "--draft-addr",
                                 draft.address, "--host", HOST, "--port", str(port), "--http-port", str(http_port),
                                 "--num-speculative-tokens", "3", "--backend-call-timeout-floor-seconds", "60"],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    channel = grpc.insecure_channel(f"{HOST}:{port}")
    stopped = False
    try:
        def ready() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return _http(http_port, "/ready")[0] == 200
            except (OSError, ValueError):
                return False
        wait_until(ready, timeout=120, interval=0.2, what="the gateway process to be ready")
        # it runs no model: a seeded sampled request served maps no torch library (tests/test_layout.py: the imports)
        status, body = _http(http_port, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0.8,
                                                            "seed": 7})
        assert status == 200 and body["choices"][0]["text"], body
        assert "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text()
        stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
        reference = offline_greedy(target_llm, PROMPTS[0], MAX_TOKENS)
        # the target holds still while the stream is in flight, so SIGTERM surely finds it there
        target.proc.send_signal(signal.SIGSTOP)
        stopped = True
        thread, box = run_in_thread(lambda: collect(stub.Generate(
            generate_request(PROMPTS[0], max_tokens=MAX_TOKENS), timeout=120)))
        time.sleep(0.5)
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: _http(http_port, "/ready")[0] == 503, timeout=5, what="/ready to answer 503")
        assert health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        status, body = _http(http_port, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 4})
        assert status == 503 and "shutting down" in body["error"]["message"]
        err = rpc_error(lambda: generate(stub, generate_request(PROMPTS[1], max_tokens=4), timeout=10))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.details()
        assert proc.poll() is None and thread.is_alive()  # the stream in flight holds the drain open
        target.proc.send_signal(signal.SIGCONT)
        stopped = False
        thread.join(60)
        assert "error" not in box, box.get("error")
        assert (box["result"].text, box["result"].token_ids) == reference
        assert proc.wait(30) == 0, log.read_text()
        assert time.monotonic() - began < 30
    finally:
        if stopped:
            target.proc.send_signal(signal.SIGCONT)
        channel.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
