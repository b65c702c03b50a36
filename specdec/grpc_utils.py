"""gRPC plumbing shared by the three services: error mapping, conversions, server start/stop.

Domain errors map to status codes here and only here.
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.errors import (
    BackendUnavailableError,
    ConfigError,
    InvalidRequestError,
    ModelNotFoundError,
    ResourceExhaustedError,
    SequenceNotFoundError,
    SpecDecError,
)
from specdec.sampling import SamplingParams
from specdec.v1 import common_pb2

logger = logging.getLogger(__name__)

# Order matters: the first matching class wins.
ERROR_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (SequenceNotFoundError, grpc.StatusCode.NOT_FOUND),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (BackendUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (ModelNotFoundError, grpc.StatusCode.FAILED_PRECONDITION),
    (ConfigError, grpc.StatusCode.FAILED_PRECONDITION),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (futures.TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
]


def status_code_for(exc: BaseException) -> grpc.StatusCode:
    for cls, code in ERROR_CODES:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def map_errors(method: Callable) -> Callable:
    """Servicer method decorator: domain errors become status codes with their message."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except grpc.RpcError:
            raise
        except Exception as exc:
            code = status_code_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                logger.exception("%s failed", method.__name__)
                context.abort(code, f"internal error: {type(exc).__name__}: {exc}")
            context.abort(code, str(exc) or type(exc).__name__)

    return wrapper


def map_stream_errors(method: Callable) -> Callable:
    """Like ``map_errors`` for server-streaming methods (generators)."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            yield from method(self, request, context)
        except grpc.RpcError:
            raise
        except Exception as exc:
            code = status_code_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                logger.exception("%s failed", method.__name__)
            context.abort(code, str(exc) or type(exc).__name__)

    return wrapper


def require_ready(backend: Any) -> None:
    """Refuse calls until the backend's model is loaded; say why for good if loading failed."""
    if not backend.ready.is_set():
        error = getattr(backend, "load_error", None)
        if error is not None:  # FAILED_PRECONDITION: retrying will not help; the operator must act
            raise ConfigError(f"the model failed to load: {type(error).__name__}: {error}")
        raise BackendUnavailableError("the model is still loading; retry shortly")


def time_remaining(context: grpc.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return remaining if remaining is not None and remaining < 1e8 else None


# -- conversions ----------------------------------------------------------------------------------


def sampling_from_proto(msg: common_pb2.SamplingParams, **extra) -> SamplingParams:
    seed = msg.seed if msg.HasField("seed") else None
    if seed is not None and seed >= 2**63:
        raise InvalidRequestError("seed must be below 2**63", param="seed")
    return SamplingParams(
        temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.top_p > 0 else 1.0,
        top_k=int(msg.top_k),
        seed=seed,
        **extra,
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def probs_to_proto(probs: torch.Tensor | None) -> list[common_pb2.TokenDistribution]:
    """[k, vocab] → one TokenDistribution per row, sparse when that is smaller."""
    if probs is None:
        return []
    out = []
    for row in probs:
        nz = row.nonzero().squeeze(-1)
        if nz.numel() * 2 < row.numel():
            out.append(common_pb2.TokenDistribution(token_ids=nz.tolist(), probs=row[nz].tolist()))
        else:
            out.append(common_pb2.TokenDistribution(probs=row.tolist()))
    return out


def probs_from_proto(rows: Iterable[common_pb2.TokenDistribution], k: int, vocab_size: int) -> torch.Tensor | None:
    rows = list(rows)
    if not rows:
        return None
    if len(rows) != k:
        raise InvalidRequestError(f"draft_probs has {len(rows)} rows for {k} draft tokens", param="draft_probs")
    out = torch.zeros((k, vocab_size), dtype=torch.float32)
    for i, row in enumerate(rows):
        if row.token_ids:
            if len(row.token_ids) != len(row.probs):
                raise InvalidRequestError("draft_probs: token_ids and probs differ in length", param="draft_probs")
            ids = torch.tensor(list(row.token_ids), dtype=torch.long)
            if int(ids.max()) >= vocab_size:
                raise InvalidRequestError("draft_probs names a token outside the vocabulary", param="draft_probs")
            out[i, ids] = torch.tensor(list(row.probs), dtype=torch.float32)
        else:
            if len(row.probs) > vocab_size:  # shorter: a draft with a smaller (padded) vocabulary
                raise InvalidRequestError(
                    f"dense draft_probs row has {len(row.probs)} entries, the vocabulary has {vocab_size}",
                    param="draft_probs",
                )
            out[i, : len(row.probs)] = torch.tensor(list(row.probs), dtype=torch.float32)
    return out


def model_info_to_proto(info: dict) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(**info)


# -- servers ---------------------------------------------------------------------------------------


@dataclass
class ServerHandle:
    """A started gRPC server: its bound port and how to stop it."""

    server: grpc.Server
    port: int
    health: health.HealthServicer
    service_names: list[str]
    on_stop: list[Callable[[], None]]
    backend: Any = None  # the engine-side object the servicer wraps (tests inspect it)
    http_port: int | None = None  # the gateway's OpenAI-compatible HTTP port, when it serves one

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


def start_server(
    register: Callable[[grpc.Server], None],
    service_names: list[str],
    host: str,
    port: int,
    max_workers: int = 64,
) -> ServerHandle:
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=[("grpc.max_receive_message_length", 64 * 1024 * 1024),
                 ("grpc.max_send_message_length", 64 * 1024 * 1024),
                 ("grpc.so_reuseport", 0)],
    )
    register(server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
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


def start_backend_server(backend, register, service_names: list[str], host: str, port: int,
                         load_async: bool = False) -> ServerHandle:
    """Start the server NOT_SERVING, load + warm the model, then flip health to SERVING."""
    handle = start_server(register, service_names, host, port)
    handle.backend = backend
    handle.on_stop.append(backend.close)

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
    # with it, rather than staying on the caller's thread (see specdec.batching).
    loader = threading.Thread(target=load, name="model-load", daemon=True)
    loader.start()
    if not load_async:
        loader.join()
        if backend.load_error is not None:
            handle.stop(0)
            raise backend.load_error
    return handle


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
