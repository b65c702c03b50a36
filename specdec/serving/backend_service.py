"""The skeleton the draft and the target service share: settings, server start-up with model loading,
the RPCs both answer (GetInfo, ReleaseSequence), and the command line. Each service keeps only what
differs: its own RPC (Propose / Verify), its extra settings and its default port."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from specdec.errors import BackendUnavailableError, ModelLoadError
from specdec.serving.backend import Backend, BackendConfig
from specdec.serving.batching import ComputeThread
from specdec.serving.grpc_errors import map_errors
from specdec.serving.server import ServerHandle, start_metrics_server, start_server
from specdec.serving.settings import service_cli
from specdec.serving.tls import server_credentials_from, server_tls_field
from specdec.serving.wire import model_info_to_proto
from specdec.v1 import common_pb2

logger = logging.getLogger(__name__)


@dataclass
class BackendServiceConfig(BackendConfig):
    """Settings of a draft or target service run alone: the backend's, plus where and how it listens."""

    host: str = field(default="0.0.0.0", metadata={"help": "address to bind"})
    port: int = field(default=0, metadata={"help": "gRPC port (0: any free port)"})
    metrics_port: int | None = field(default=None, metadata={"help": "serve Prometheus /metrics on this HTTP port "
                                                                     "(none: off; 0: any free port)"})
    drain_grace_seconds: float = field(default=25.0, metadata={
        "help": "on SIGTERM: health turns NOT_SERVING, calls for sequences this service does not hold get "
                "UNAVAILABLE (the gateway moves them to another replica), and the sequences it holds get this "
                "long to finish before the process exits (keep it under Kubernetes' "
                "terminationGracePeriodSeconds)"})
    tls_cert_file: str | None = server_tls_field("tls_cert_file")
    tls_key_file: str | None = server_tls_field("tls_key_file")
    tls_client_ca_file: str | None = server_tls_field("tls_client_ca_file")


def require_ready(backend: Any) -> None:
    """Refuse calls until the backend's model is loaded; say why for good if loading failed."""
    if not backend.ready.is_set():
        error = getattr(backend, "load_error", None)
        if error is not None:  # retrying will not help; the operator must act
            raise ModelLoadError(f"the model failed to load: {type(error).__name__}: {error}")
        raise BackendUnavailableError("the model is still loading; retry shortly")


class BackendServicerMixin:
    """GetInfo and ReleaseSequence, identical for the draft and the target service."""

    backend: Any

    @map_errors
    def GetInfo(self, request, context):
        require_ready(self.backend)
        return common_pb2.GetInfoResponse(info=model_info_to_proto(self.backend.info()))

    @map_errors
    def ReleaseSequence(self, request, context):
        require_ready(self.backend)
        return common_pb2.ReleaseSequenceResponse(released=self.backend.release(request.sequence_id))


def start_backend_service(
    role: str,
    config: BackendServiceConfig,
    servicer: Callable[[Backend], Any],
    add_servicer: Callable[[Any, grpc.Server], None],
    service_name: str,
    load_async: bool = False,
    compute: ComputeThread | None = None,
    **backend_options: Any,
) -> ServerHandle:
    """Start a draft or target service on config.host:config.port, health NOT_SERVING; load and warm
    the model, then flip health to SERVING.

    ``load_async``: return at once (the port answers UNAVAILABLE until the model is loaded, and
    FAILED_PRECONDITION with the reason if loading fails) instead of waiting and raising.
    ``compute``: run the forward passes on this thread, shared with another model in the process.
    """
    credentials = server_credentials_from(config)  # a bad TLS file stops start-up before the model loads
    backend = Backend(role, config, compute=compute, **backend_options)
    instance = servicer(backend)
    handle = start_server(lambda server: add_servicer(instance, server), [service_name], config.host, config.port,
                          credentials=credentials)
    handle.backend = backend
    handle.on_stop.append(backend.close)
    handle.drain_grace = config.drain_grace_seconds  # SIGTERM: hold no new sequence, finish the held ones
    handle.on_drain.append(backend.drain)
    handle.in_flight = backend.live_sequences
    start_metrics_server(handle, config.metrics_port, config.host)

    def load() -> None:
        try:
            backend.load()
        except Exception as exc:  # kept on the backend: calls answer FAILED_PRECONDITION with it
            backend.load_error = exc
            if load_async:
                logger.exception("loading the model failed; the service stays NOT_SERVING and answers "
                                 "FAILED_PRECONDITION")
            return
        if backend.ready.is_set():
            handle.set_serving(True)

    # Load on a thread of its own even when the caller waits: the thread's OpenMP pool goes away
    # with it, rather than staying on the caller's thread (see specdec.serving.batching).
    loader = threading.Thread(target=load, name="model-load", daemon=True)
    loader.start()
    if not load_async:
        loader.join()
        if backend.load_error is not None:
            handle.stop(0)
            raise backend.load_error
    return handle


def backend_service_cli(config_cls: type, env_prefix: str, create_server_path: str, name: str):
    """(add_arguments, run, main) of a service's ``__main__``: the port opens at once, NOT_SERVING
    until the model is loaded (what a container's probes expect)."""
    return service_cli(config_cls, env_prefix, create_server_path, name, load_async=True)
