"""Scale-out: one gateway over 2 target and 2 draft replicas, each a real process on loopback.

Sequences spread over the replicas and stay on theirs; outputs equal the target alone; a target replica
killed mid-stream hands its sequence to the other (the stream completes identically); a replica that
gets SIGTERM while 8 streams run drains without failing any of them.
"""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from gateway.config import GatewayConfig
from gateway.replicas import is_replica_spec, resolve
from specdec.v1 import generation_service_pb2_grpc
from tests.metrics_helpers import scrape, total
from tests.service_processes import ServiceProcess, free_port
from tests.services_conftest_helpers import (
    PROMPTS,
    collect,
    generate,
    generate_request,
    hooked,
    offline_greedy,
    run_in_thread,
)

MAX_TOKENS = 24


def test_replica_specs():
    assert not is_replica_spec("localhost:50052")
    assert is_replica_spec("a:1,b:2") and is_replica_spec("dns:///target-headless:50052")
    assert resolve(" a:1, b:2 ") == ["a:1", "b:2"]
    assert "127.0.0.1:50052" in resolve("dns:///localhost:50052")


class Replica(ServiceProcess):
    def __init__(self, module, model, logs):
        self.metrics_port = free_port()
        super().__init__(module, ["--model", str(model), "--metrics-port", str(self.metrics_port)], logs)

    def forward_passes(self) -> float:
        _, samples = scrape(f"http://127.0.0.1:{self.metrics_port}/metrics")
        return total(samples, "specdec_forward_pass_seconds_count")


@pytest.fixture(scope="module")
def replicas(target_dir, good_draft_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("replica-logs")
    targets = [Replica("target_service", target_dir, logs).start() for _ in range(2)]
    drafts = [Replica("draft_service", good_draft_dir, logs).start() for _ in range(2)]
    yield targets, drafts
    for proc in targets + drafts:
        proc.kill()


@pytest.fixture(scope="module")
def gateway(replicas, servers):
    from gateway.server import create_server

    targets, drafts = replicas
    handle = servers.add(create_server(GatewayConfig(
        target_addr=",".join(t.address for t in targets), draft_addr=",".join(d.address for d in drafts),
        host="127.0.0.1", port=0, num_speculative_tokens=3, startup_timeout_seconds=60.0)))
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    yield handle.backend, generation_service_pb2_grpc.GenerationServiceStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def references(target_llm):
    return {p: offline_greedy(target_llm, p, MAX_TOKENS) for p in PROMPTS}


def _ensure_running(replicas):
    for proc in replicas[0] + replicas[1]:
        if proc.proc.poll() is not None:
            proc.start()


@pytest.mark.heavy
def test_sequences_spread_over_replicas_with_identical_output(replicas, gateway, references):
    targets, drafts = replicas
    gw, stub = gateway
    before = [r.forward_passes() for r in targets + drafts]
    prompts = [PROMPTS[i % 2] for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: generate(stub, generate_request(p, max_tokens=MAX_TOKENS)), prompts))
    for prompt, out in zip(prompts, outs):
        assert (out.text, out.token_ids) == references[prompt]
    after = [r.forward_passes() for r in targets + drafts]
    assert all(a > b for a, b in zip(after, before)), f"a replica served nothing: {before} -> {after}"
    assert not gw.target._home and not gw.draft.remote._home  # every sequence released


@pytest.mark.heavy
def test_target_replica_killed_mid_stream_hands_the_sequence_on(replicas, gateway, references):
    targets, _ = replicas
    gw, stub = gateway
    try:
        with hooked(gw.target, "verify") as hook:
            hook.pause_at(3)
            thread, box = run_in_thread(lambda: collect(stub.Generate(
                generate_request(PROMPTS[0], max_tokens=MAX_TOKENS), timeout=120)))
            hook.wait_paused(60)
            (home,) = set(gw.target._home.values())
            victim = next(t for t in targets if t.address == home)
            victim.kill()  # SIGKILL: its caches are gone
            hook.resume()
            thread.join(120)
        assert not thread.is_alive() and "error" not in box, box.get("error")
        assert (box["result"].text, box["result"].token_ids) == references[PROMPTS[0]]
    finally:
        _ensure_running(replicas)


@pytest.mark.heavy
def test_draining_replica_fails_no_stream(replicas, gateway, references):
    targets, _ = replicas
    gw, stub = gateway
    started = threading.Event()
    results: list = [None] * 8

    def run(i: int) -> None:
        prompt = PROMPTS[i % 2]
        try:
            responses = stub.Generate(generate_request(prompt, max_tokens=MAX_TOKENS * 2), timeout=180)
            items = []
            for r in responses:
                items.append(r)
                started.set()
            results[i] = (prompt, collect(items))
        except grpc.RpcError as err:
            results[i] = err

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        assert started.wait(60)
        victim = targets[0]
        assert victim.kill(signal.SIGTERM) == 0  # a clean drain: it exits by itself
        for t in threads:
            t.join(180)
        for item in results:
            assert not isinstance(item, grpc.RpcError), f"a stream failed during the drain: {item}"
            prompt, out = item
            assert len(out.token_ids) == MAX_TOKENS * 2
            assert out.token_ids[:MAX_TOKENS] == references[prompt][1]
    finally:
        _ensure_running(replicas)


# -- membership and health checks, over fake replicas (no processes) --------------------------------------


class FakeReplica:
    """A replica client: answers verify with its address; its health check can wait at a barrier."""

    role, phase, retry_seconds = "target", "verify", 60.0

    def __init__(self, address, gate=None, counter=None):
        self.address, self.gate, self.counter = address, gate, counter
        self.released, self.closed = [], False

    def is_serving(self, timeout=2.0):
        if self.counter is not None:
            with self.counter["lock"]:
                self.counter["now"] += 1
                self.counter["most"] = max(self.counter["most"], self.counter["now"])
        try:
            if self.gate is not None:
                self.gate.wait()  # a dead address: the check waits (here: until the others arrive)
            return self.gate is None
        finally:
            if self.counter is not None:
                with self.counter["lock"]:
                    self.counter["now"] -= 1

    def verify(self, sequence_id, *args):
        return self.address

    def set_deadline(self, sequence_id, deadline):
        pass

    def forget(self, sequence_id):
        pass

    def release(self, sequence_id):
        self.released.append(sequence_id)

    def close(self):
        self.closed = True


def _replica_set(monkeypatch, answer, make=FakeReplica):
    import gateway.replicas as replicas

    monkeypatch.setattr(replicas, "resolve", lambda spec: list(answer))
    made = {}

    def factory(addr):
        made[addr] = make(addr)
        return made[addr]

    # the monitor never ticks here: the test runs refreshes and health checks itself
    return replicas.ReplicaSet("dns:///target:50052", factory, health_interval=3600), made


def test_an_address_that_leaves_dns_is_dropped_once_its_sequences_end(monkeypatch):
    answer = ["10.0.0.1:50052", "10.0.0.2:50052"]
    rs, made = _replica_set(monkeypatch, answer)
    try:
        home = rs.verify("s", [1, 2], None, None)  # the sequence lives on one replica
        other = next(a for a in answer if a != home)
        answer[:] = ["10.0.0.3:50052"]  # a rolling update: both old addresses leave the name
        rs._refresh()
        assert set(rs.replicas) == {home, "10.0.0.3:50052"}  # the idle one is dropped, its client closed
        assert made[other].closed and not made[home].closed
        assert rs.verify("s", [1, 2, 3], None, None) == home  # the live sequence is not moved or broken
        assert rs.verify("new", [1], None, None) == "10.0.0.3:50052"  # nothing new goes to a leaving address
        rs.check_health(timeout=1.0)
        assert not rs.healthy[home]  # it still answers SERVING, but it has left the name
        rs.release("s")
        assert made[home].released == ["s"]
        rs._prune()  # the watch loop's next tick
        assert set(rs.replicas) == {"10.0.0.3:50052"} and made[home].closed
        answer[:] = []  # DNS says nothing: keep what we have
        rs._refresh()
        assert set(rs.replicas) == {"10.0.0.3:50052"}
    finally:
        rs.close()


def test_dead_addresses_are_health_checked_in_parallel_with_a_bound(monkeypatch):
    from gateway.replicas import HEALTH_CHECK_CONCURRENCY

    n = 2 * HEALTH_CHECK_CONCURRENCY
    # each check blocks until HEALTH_CHECK_CONCURRENCY of them are under way at once (checked one after another,
    # the first would wait forever: the barrier breaks after 10 s and the check raises)
    gate = threading.Barrier(HEALTH_CHECK_CONCURRENCY, timeout=10)
    counter = {"lock": threading.Lock(), "now": 0, "most": 0}
    answer = [f"10.0.1.{i}:50052" for i in range(n)]
    rs, _ = _replica_set(monkeypatch, answer, make=lambda addr: FakeReplica(addr, gate, counter))
    try:
        rs.check_health(timeout=1.0)
        assert counter["most"] == HEALTH_CHECK_CONCURRENCY  # in parallel, never more than the bound
        assert not any(rs.healthy.values())
    finally:
        rs.close()
