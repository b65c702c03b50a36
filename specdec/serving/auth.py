"""API keys: loading them (``--api-key``, ``--api-key-file``), checking a bearer token in constant time,
and a gRPC server interceptor that refuses calls without a valid ``authorization: Bearer <key>``.

The HTTP layer (``gateway.openai.api_server``) and the gRPC interceptor check tokens with the same
``ApiKeys.check``. Health (``grpc.health.v1``) and reflection stay open, as do HTTP /health, /ready
and /metrics.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable

import grpc

from specdec.errors import AuthenticationError, ConfigError
from specdec.serving.grpc_errors import abort_with

BEARER = "bearer"
# services every client may call without a key: health probes and reflection (grpcurl, grpcui)
OPEN_SERVICES = frozenset({
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
})
MISSING_OR_WRONG = "invalid or missing API key: send 'Authorization: Bearer <key>'"


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()


def read_key_file(path: str) -> list[str]:
    """One key per line; blank lines and lines starting with '#' are ignored."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise ConfigError(f"--api-key-file: cannot read {path!r}: {exc.strerror or exc}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ConfigError(f"--api-key-file: {path!r} holds no key (one key per line)")
    return keys


class ApiKeys:
    """The accepted keys. Empty: nothing is required. ``check`` takes the same time whichever key
    matches, or none: every key is compared (``hmac.compare_digest`` on SHA-256 digests, so neither a
    key's content nor its length shows in the timing)."""

    def __init__(self, keys: Iterable[str] = ()):
        self._digests = tuple(_digest(k) for k in keys)

    @classmethod
    def load(cls, keys: str | Iterable[str] | None = None, key_file: str | None = None) -> ApiKeys:
        """The keys of ``--api-key`` (a string or a list) and of ``--api-key-file``."""
        if isinstance(keys, str):
            keys = [keys]
        found = [k.strip() for k in keys or () if k and k.strip()]
        if key_file:
            found += read_key_file(key_file)
        return cls(dict.fromkeys(found))

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def check(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value carries one of the keys (always true when none is set)."""
        if not self._digests:
            return True
        scheme, _, token = (authorization or "").strip().partition(" ")
        candidate = _digest(token.strip())
        ok = False
        for digest in self._digests:  # no early exit: the time does not say which key matched
            ok |= hmac.compare_digest(candidate, digest)
        return ok and scheme.lower() == BEARER


class ApiKeyInterceptor(grpc.ServerInterceptor):
    """Refuse every call except to ``open_services`` unless its metadata carries ``authorization:
    Bearer <key>`` with one of ``keys``: UNAUTHENTICATED, through the error table
    (``AuthenticationError``). ``on_reject(method)`` is called for each refused call (metrics)."""

    def __init__(self, keys: ApiKeys, open_services: Iterable[str] = OPEN_SERVICES,
                 on_reject: Callable[[str], None] | None = None):
        self.keys = keys
        self.open_services = frozenset(open_services)
        self.on_reject = on_reject

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or not self.keys or method.lstrip("/").split("/")[0] in self.open_services:
            return handler
        metadata = handler_call_details.invocation_metadata or ()
        authorization = next((value for key, value in metadata if key == "authorization"), None)
        if isinstance(authorization, bytes):
            authorization = authorization.decode("latin-1")
        if self.keys.check(authorization):
            return handler
        if self.on_reject is not None:
            self.on_reject(method)
        return _refusing(handler, method.rsplit("/", 1)[-1])


def _refusing(handler: grpc.RpcMethodHandler, name: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call with UNAUTHENTICATED."""

    def refuse(_request_or_iterator, context):
        abort_with(context, AuthenticationError(MISSING_OR_WRONG), name)

    serializers = {"request_deserializer": handler.request_deserializer,
                   "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, **serializers)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse, **serializers)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **serializers)
    return grpc.stream_stream_rpc_method_handler(refuse, **serializers)


def bearer_metadata(key: str) -> tuple[tuple[str, str]]:
    """The call metadata a client sends: ``stub.Generate(request, metadata=bearer_metadata(key))``."""
    return (("authorization", f"Bearer {key}"),)
