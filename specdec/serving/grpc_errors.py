"""Domain errors over gRPC, both ways, read from the one table in ``specdec.errors``.

Servers: ``map_errors`` / ``map_stream_errors`` abort a call with the error's status code and message,
and name its class in the trailing metadata (``specdec-error``). Clients: ``error_from_rpc`` turns a
failed call back into that domain error (from the bare code when the class is not named).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import grpc

from specdec.errors import SpecDecError, domain_class, error_from_code, public_message

logger = logging.getLogger(__name__)
ERROR_CLASS_KEY = "specdec-error"


def status_code_for(exc: BaseException) -> grpc.StatusCode:
    return grpc.StatusCode[domain_class(exc).grpc_code]


def abort_with(context: grpc.ServicerContext, exc: BaseException, method: str) -> None:
    """End the call with ``exc``'s row of the table. An unexpected exception is logged with its trace
    and reaches the client as ``internal error (Type); see the server log``, without its message."""
    cls = domain_class(exc)
    if cls is SpecDecError:  # the trace goes to this log line only; the request (prompt) goes nowhere
        logger.error("%s failed: unexpected %s", method, type(exc).__name__, exc_info=exc)
    message = public_message(exc)
    context.set_trailing_metadata(((ERROR_CLASS_KEY, cls.__name__),))
    context.abort(grpc.StatusCode[cls.grpc_code], message)


def map_errors(method: Callable) -> Callable:
    """Servicer method decorator: domain errors become status codes with their message."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except grpc.RpcError:
            raise
        except Exception as exc:
            abort_with(context, exc, method.__name__)

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
            abort_with(context, exc, method.__name__)

    return wrapper


def error_from_rpc(err: grpc.RpcError, prefix: str = "") -> SpecDecError:
    """The domain error a failed call stands for; ``prefix`` (e.g. 'draft service: ') goes before its message.

    CANCELLED (the service shut down mid-call) counts as UNAVAILABLE: retry elsewhere or later."""
    code = err.code()
    metadata = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    class_name = next((value for key, value in (metadata or ()) if key == ERROR_CLASS_KEY), None)
    message = f"{prefix}{err.details()}"
    if code == grpc.StatusCode.CANCELLED:
        code, message = grpc.StatusCode.UNAVAILABLE, f"{message} (CANCELLED)"
    return error_from_code(code.name, message, class_name)
