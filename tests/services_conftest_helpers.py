"""Helpers and fixtures for the gRPC service tests (draft_service, target_service, gateway, serve).

Every server runs on loopback (127.0.0.1, port 0) with the tiny random-weight models that
``tests/conftest.py`` builds. Fixtures here are module-scoped: a test module starts its servers once
and its finalizer stops every one of them (including servers a test restarted on the same port).

The fixtures are re-exported by ``tests/{draft_service,target_service,gateway}/conftest.py``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.v1 import (
    common_pb2,
    draft_service_pb2,
    generation_service_pb2 as gen_pb2,
    generation_service_pb2_grpc,
    target_service_pb2,
)

HOST = "127.0.0.1"
PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    return"]  # = conftest.PROMPTS
RPC_TIMEOUT = 60.0  # generous per-call deadline for stubs (never hit by a passing test)


# --------------------------------------------------------------------------------------------------
# polling


def wait_until(predicate: Callable[[], Any], timeout: float = 5.0, interval: float = 0.02, what: str = "condition"):
    """Poll ``predicate`` until it is truthy; fail the test after ``timeout`` seconds."""
    give_up = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > give_up:
            pytest.fail(f"timed out after {timeout:.1f} s waiting for {what}")
        time.sleep(interval)


def sequences_of(handle) -> dict:
    """The KV-cache table of a draft/target service (engine-side)."""
    return handle.backend.runner.sequences


def wait_released(*handles, timeout: float = 5.0) -> None:
    for h in handles:
        wait_until(lambda h=h: not sequences_of(h), timeout, what=f"{h.backend.role} caches to be released "
                   f"(held: {list(sequences_of(h))})")


# --------------------------------------------------------------------------------------------------
# servers


def target_config(model, **kw):
    from target_service.config import TargetServiceConfig

    return TargetServiceConfig(model=str(model), dtype="float32", host=HOST, port=kw.pop("port", 0), **kw)


def draft_config(model, **kw):
    from draft_service.config import DraftServiceConfig

    return DraftServiceConfig(model=str(model), dtype="float32", host=HOST, port=kw.pop("port", 0), **kw)


def gateway_config(target_handle, draft_handle=None, **kw):
    from gateway.config import GatewayConfig

    kw.setdefault("backend_timeout_seconds", 20.0)
    kw.setdefault("startup_timeout_seconds", 20.0)
    return GatewayConfig(
        target_addr=f"{HOST}:{target_handle.port}",
        draft_addr=f"{HOST}:{draft_handle.port}" if draft_handle is not None else None,
        host=HOST,
        port=kw.pop("port", 0),
        **kw,
    )


class Servers:
    """Starts servers and remembers them so one finalizer stops them all."""

    def __init__(self):
        self.handles: list = []

    def add(self, handle):
        self.handles.append(handle)
        return handle

    def target(self, model, load_async: bool = False, **kw):
        from target_service.server import create_server

        return self.add(create_server(target_config(model, **kw), load_async=load_async))

    def draft(self, model, load_async: bool = False, **kw):
        from draft_service.server import create_server

        return self.add(create_server(draft_config(model, **kw), load_async=load_async))

    def gateway(self, target_handle, draft_handle=None, **kw):
        from gateway.server import create_server

        return self.add(create_server(gateway_config(target_handle, draft_handle, **kw)))

    def stop(self, handle, grace: float | None = 0) -> None:
        handle.stop(grace)
        if handle in self.handles:
            self.handles.remove(handle)

    def restart(self, handle, make: Callable[[int], Any]):
        """Stop ``handle`` and start a replacement on the SAME port (``make(port)`` builds it)."""
        port = handle.port
        self.stop(handle, 0)
        give_up = time.monotonic() + 10
        while True:  # the port is normally free at once; tolerate a slow socket close
            try:
                new = make(port)
                break
            except (OSError, RuntimeError):  # grpcio raises RuntimeError("Failed to bind ...")
                if time.monotonic() > give_up:
                    raise
                time.sleep(0.05)
        assert new.port == port
        return self.add(new)

    def stop_all(self) -> None:
        # gateways first: they release sequences on the backends while stopping
        for h in sorted(self.handles, key=lambda h: not hasattr(h.backend, "target_info")):
            with contextlib.suppress(Exception):
                h.stop(0)
        self.handles.clear()


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    s = Servers()
    try:
        yield s
    finally:
        s.stop_all()


@dataclass
class Stack:
    target: Any
    draft: Any
    gateway: Any
    channels: list = field(default_factory=list)

    def channel(self, handle) -> grpc.Channel:
        ch = grpc.insecure_channel(f"{HOST}:{handle.port}")
        self.channels.append(ch)
        return ch


@pytest.fixture(scope="module")
def stack(servers, target_dir, good_draft_dir) -> Iterator[Stack]:
    """Target (tiny Llama) + draft (target + 5 % noise) + gateway (greedy drafting, default k)."""
    target = servers.target(target_dir)
    draft = servers.draft(good_draft_dir)
    gw = servers.gateway(target, draft)
    st = Stack(target, draft, gw)
    try:
        yield st
    finally:
        for ch in st.channels:
            ch.close()


@pytest.fixture(scope="module")
def gen_stub(stack):
    return generation_service_pb2_grpc.GenerationServiceStub(stack.channel(stack.gateway))


@pytest.fixture(scope="module")
def target_llm(target_dir):
    """The offline target-only reference (``specdec.LLM``)."""
    from specdec import LLM

    return LLM(str(target_dir), dtype="float32")


# --------------------------------------------------------------------------------------------------
# requests


def sampling(temperature: float = 0.0, seed: int | None = None, top_p: float = 0.0, top_k: int = 0):
    msg = common_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    if seed is not None:
        msg.seed = seed
    return msg


def generate_request(prompt: str | None = None, prompt_token_ids=None, max_tokens: int | None = 24,
                     temperature: float = 0.0, seed: int | None = None, k: int | None = None,
                     ignore_eos: bool = True, top_k: int = 0, **kw) -> gen_pb2.GenerateRequest:
    req = gen_pb2.GenerateRequest(sampling_params=sampling(temperature, seed, top_k=top_k), ignore_eos=ignore_eos,
                                  **kw)
    if prompt is not None:
        req.prompt = prompt
    if prompt_token_ids is not None:
        req.prompt_token_ids.extend(prompt_token_ids)
    if max_tokens is not None:
        req.max_tokens = max_tokens
    if k is not None:
        req.num_speculative_tokens = k
    return req


@dataclass
class Generated:
    text: str
    token_ids: list[int]
    responses: list

    @property
    def last(self):
        return self.responses[-1]


def collect(responses) -> Generated:
    """Concatenate a Generate stream's text and token ids."""
    items = list(responses)
    return Generated("".join(r.text for r in items), [t for r in items for t in r.token_ids], items)


def generate(stub, request, timeout: float = RPC_TIMEOUT) -> Generated:
    return collect(stub.Generate(request, timeout=timeout))


def offline_greedy(llm, prompt, max_tokens: int):
    """(text, token ids) of the target alone, greedy, ignoring EOS (the reference)."""
    from specdec import SamplingParams

    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].outputs[0]
    return out.text, list(out.token_ids)


def rpc_error(call: Callable[[], Any]) -> grpc.RpcError:
    """Run ``call`` (which must fail with an RpcError) and return the error."""
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (str, bytes)):
            list(result)
    return info.value


def health_status(channel: grpc.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def verify_request(sequence_id: str, new_token_ids, start_position: int = 0, draft_token_ids=(), draft_probs=(),
                   temperature: float = 0.0, seed: int | None = None) -> target_service_pb2.VerifyRequest:
    return target_service_pb2.VerifyRequest(
        sequence_id=sequence_id, start_position=start_position, new_token_ids=list(new_token_ids),
        draft_token_ids=list(draft_token_ids), draft_probs=list(draft_probs),
        sampling_params=sampling(temperature, seed),
    )


def propose_request(sequence_id: str, new_token_ids, k: int = 3, start_position: int = 0,
                    method: int = draft_service_pb2.DRAFT_SAMPLE_METHOD_UNSPECIFIED, temperature: float = 0.0,
                    seed: int | None = None) -> draft_service_pb2.ProposeRequest:
    return draft_service_pb2.ProposeRequest(
        sequence_id=sequence_id, start_position=start_position, new_token_ids=list(new_token_ids),
        num_speculative_tokens=k, sampling_params=sampling(temperature, seed), draft_sample_method=method,
    )


def release(stub, sequence_id: str) -> bool:
    return stub.ReleaseSequence(common_pb2.ReleaseSequenceRequest(sequence_id=sequence_id), timeout=10).released


# --------------------------------------------------------------------------------------------------
# pacing a gateway stream deterministically


class Hook:
    """Wraps a gateway client's method (``gateway.target.verify`` / ``gateway.draft.propose``).

    ``pause_at(n)`` makes the n-th call (1-based, counted from installation) block BEFORE it reaches
    the service until ``resume()``; ``paused`` is set while it waits. The gateway thread is then
    parked at a known point of the stream, so a test can restart a service or cancel the client
    there, deterministically.
    """

    def __init__(self, client, method: str):
        self.client = client
        self.method = method
        self.original = getattr(client, method)
        self._own_attr = method in vars(client)  # e.g. a stub's multicallable, not a class method
        self.calls = 0
        self.seen: list[tuple[tuple, object]] = []  # (args, result) of each call that returned
        self.pause_points: set[int] = set()
        self.paused = threading.Event()
        self._resume = threading.Event()
        self._lock = threading.Lock()
        setattr(client, method, self._wrapper)

    def pause_at(self, *calls: int) -> "Hook":
        self.pause_points.update(calls)
        return self

    def wait_paused(self, timeout: float = 20.0) -> None:
        assert self.paused.wait(timeout), f"the stream never reached {self.method} call {sorted(self.pause_points)}"

    def resume(self) -> None:
        self.paused.clear()
        self._resume.set()

    def _wrapper(self, *args, **kwargs):
        with self._lock:
            self.calls += 1
            pause = self.calls in self.pause_points
        if pause:
            self._resume.clear()
            self.paused.set()
            if not self._resume.wait(30):
                raise RuntimeError("test hook: never resumed")
        result = self.original(*args, **kwargs)
        with self._lock:
            self.seen.append((args, result))
        return result

    def remove(self) -> None:
        self._resume.set()
        if self._own_attr:
            setattr(self.client, self.method, self.original)
        else:
            with contextlib.suppress(AttributeError):
                delattr(self.client, self.method)  # back to the class method


@contextlib.contextmanager
def hooked(client, method: str) -> Iterator[Hook]:
    hook = Hook(client, method)
    try:
        yield hook
    finally:
        hook.remove()


def run_in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict]:
    """Run ``fn`` in a daemon thread; the dict gets 'result' or 'error'."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box
