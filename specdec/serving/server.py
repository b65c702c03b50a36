"""Starting and stopping a gRPC server: TLS, interceptors, health, reflection, graceful shutdown on SIGTERM."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.serving.batching import BATCH_HINT_KEY, parse_batch_hint

logger = logging.getLogger(__name__)

_MESSAGE_LIMITS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
                   ("grpc.max_send_message_length", 64 * 1024 * 1024)]


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
    """Options of every channel to a specdec service (message size limits as the servers')."""
    return list(_MESSAGE_LIMITS)


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
    limits = dict(_MESSAGE_LIMITS)
    if max_receive_bytes is not None:
        limits["grpc.max_receive_message_length"] = max_receive_bytes
    options = [*limits.items(), ("grpc.so_reuseport", 0)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), interceptors=list(interceptors),
                         options=options, maximum_concurrent_rpcs=max_concurrent_rpcs)
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


def serve_until_signal(handle: ServerHandle, grace: float = 10.0) -> None:
    """Block until SIGTERM/SIGINT, then shut down gracefully."""
    done = threading.Event()

    def on_signal(signum, _frame):
        logger.info("signal %d: stopping (grace %.0f s)", signum, grace)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    done.wait()
    handle.stop(grace)
