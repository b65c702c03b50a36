"""Starting and stopping a gRPC server: TLS, interceptors, health, reflection, graceful shutdown on SIGTERM."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.serving.batching import BATCH_HINT_KEY, parse_batch_hint

logger = logging.getLogger(__name__)

_MESSAGE_LIMITS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
                   ("grpc.max_send_message_length", 64 * 1024 * 1024)]
# Keepalive: a client pings an idle or busy connection every KEEPALIVE_TIME_MS and drops it when no answer
# comes within KEEPALIVE_TIMEOUT_MS (a half-open TCP connection is found, not waited on forever). The
# servers permit those pings, with calls or without, so they never answer them with GOAWAY.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
_CLIENT_KEEPALIVE = [("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
                     ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                     ("grpc.keepalive_permit_without_calls", 1),
                     ("grpc.http2.max_pings_without_data", 0)]  # 0: no cap on pings while no data flows
_SERVER_KEEPALIVE = [("grpc.keepalive_permit_without_calls", 1),
                     ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
                     ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
                     ("grpc.http2.max_ping_strikes", 0)]  # 0: pings never count against the client


@dataclass
class ServerHandle:
    """A started gRPC server: its bound port and how to stop it."""

    server: grpc.Server
    port: int
    health: health.HealthServicer
    service_names: list[str]
    on_stop: list[Callable[[], None]]
    backend: Any = None  # the object the servicer wraps (tests inspect it)
    http_port: int | None = None  # the gateway's OpenAI-compatible HTTP port, when it serves one
    metrics_port: int | None = None  # the Prometheus /metrics port, when it serves one of its own
    drain_grace: float = 25.0  # --drain-grace-seconds: how long SIGTERM lets work in flight finish
    on_drain: list[Callable[[], None]] = field(default_factory=list)  # refuse new work from now on
    in_flight: Callable[[], int] = lambda: 0  # the work a drain waits for (sequences held or running)
    draining: bool = False

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            self.health.set(name, status)

    def stop(self, grace: float | None = 5.0) -> None:
        """Stop accepting, let in-flight calls finish for ``grace`` seconds, then cancel them."""
        self.set_serving(False)
        self.server.stop(grace).wait()
        for fn in self.on_stop:
            fn()

    def drain(self, grace: float | None = None) -> None:
        """Stop gracefully: readiness false (health NOT_SERVING) and new work refused first, then the work in
        flight gets up to ``grace`` seconds (default ``drain_grace``) to finish, then the server stops."""
        grace = self.drain_grace if grace is None else grace
        give_up = time.monotonic() + grace
        self.set_serving(False)
        self.draining = True
        for fn in self.on_drain:
            fn()
        left = self.in_flight()
        while left > 0 and time.monotonic() < give_up:
            time.sleep(0.05)
            left = self.in_flight()
        if left:
            logger.warning("drain: %d still in flight after %.0f s; stopping anyway", left, grace)
        else:
            logger.info("drain: nothing in flight; stopping")
        self.stop(max(0.5, give_up - time.monotonic()) if left else 0.5)

    def wait(self) -> None:
        self.server.wait_for_termination()


def start_metrics_server(handle: ServerHandle, port: int | None, host: str) -> None:
    """Serve /metrics on ``port`` (None: not at all) until the handle stops."""
    if port is None:
        return
    from specdec.serving.metrics import serve_metrics

    try:
        stop = serve_metrics(port, host)
    except OSError:
        handle.stop(0)
        raise
    handle.metrics_port = stop.port  # type: ignore[attr-defined]
    handle.on_stop.append(stop)


def channel_options() -> list[tuple[str, int]]:
    """Options of every channel to a specdec service (message size limits as the servers', keepalive)."""
    return [*_MESSAGE_LIMITS, *_CLIENT_KEEPALIVE]


def server_options(max_receive_bytes: int | None = None) -> list[tuple[str, int]]:
    """Options of every specdec gRPC server (message size limits, the clients' keepalive pings permitted)."""
    limits = dict(_MESSAGE_LIMITS)
    if max_receive_bytes is not None:
        limits["grpc.max_receive_message_length"] = max_receive_bytes
    return [*limits.items(), *_SERVER_KEEPALIVE, ("grpc.so_reuseport", 0)]


def start_server(
    register: Callable[[grpc.Server], None],
    service_names: list[str],
    host: str,
    port: int,
    max_workers: int = 64,
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    max_receive_bytes: int | None = None,
    max_concurrent_rpcs: int | None = None,
) -> ServerHandle:
    """Start serving ``register``'s services on host:port (0: any free port), health NOT_SERVING.

    ``credentials`` (``specdec.serving.tls.server_credentials``): the port speaks TLS only (None:
    plaintext). ``interceptors`` run before every call (e.g. ``specdec.serving.auth.ApiKeyInterceptor``).
    ``max_receive_bytes``: the largest request message (default 64 MiB; past it, RESOURCE_EXHAUSTED).
    ``max_concurrent_rpcs``: calls in progress at once; past it gRPC refuses a call at once with
    RESOURCE_EXHAUSTED (None: no limit, and calls past ``max_workers`` wait unseen in the pool's queue)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), interceptors=list(interceptors),
                         options=server_options(max_receive_bytes), maximum_concurrent_rpcs=max_concurrent_rpcs)
    register(server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    try:
        address = f"{host}:{port}"
        bound = (server.add_insecure_port(address) if credentials is None
                 else server.add_secure_port(address, credentials))
    except RuntimeError as exc:  # grpcio raises on a busy port
        server.stop(0)
        raise OSError(f"could not bind {host}:{port}: {exc}") from None
    if bound == 0:
        server.stop(0)
        raise OSError(f"could not bind {host}:{port}")
    server.start()
    handle = ServerHandle(server, bound, health_servicer, service_names, [])
    handle.set_serving(False)
    return handle


def batch_hint_of(context) -> tuple[str, int] | None:
    """The call's batch hint metadata (see specdec.serving.batching), parsed; None when absent."""
    for key, value in context.invocation_metadata() or ():
        if key == BATCH_HINT_KEY:
            return parse_batch_hint(value)
    return None


def time_remaining(context: grpc.ServicerContext) -> float | None:
    """The caller's deadline as seconds left (None: no deadline)."""
    remaining = context.time_remaining()
    return remaining if remaining is not None and remaining < 1e8 else None


def serve_until_signal(handle: ServerHandle, grace: float | None = None) -> None:
    """Block until SIGTERM/SIGINT, then drain (``ServerHandle.drain``: readiness false and new work refused at
    once, work in flight finishes within ``grace``, default the handle's --drain-grace-seconds) and stop."""
    done = threading.Event()
    grace = handle.drain_grace if grace is None else grace

    def on_signal(signum, _frame):
        logger.info("signal %d: draining (up to %.0f s), then stopping", signum, grace)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    done.wait()
    handle.drain(grace)
