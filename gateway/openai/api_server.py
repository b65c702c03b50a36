"""The OpenAI-compatible HTTP app (FastAPI), and uvicorn serving it in the gateway's process.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (with GET and
DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items), POST /tokenize, POST /detokenize,
GET /health, GET /ready, GET /version, GET /metrics (Prometheus). With API keys, every /v1/ route (and
/tokenize, /detokenize) wants ``Authorization: Bearer <key>``
with one of them (checked in constant time); the other routes stay open. Errors use
OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: domain errors (and unexpected
exceptions, as internal errors) from the one table in specdec.errors, request validation as a 400
naming the param, unknown routes and methods as 404 / 405.
"""

from __future__ import annotations

import asyncio
import re
import socket
import ssl
import threading
import time

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import specdec
from gateway.generation import Gateway
from gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, domain_error_response, error_response
from gateway.openai.serving_chat import OpenAIServingChat
from gateway.openai.response_store import ResponseStore
from gateway.openai.responses_items import ResponsesRequest
from gateway.openai.serving_completion import OpenAIServingCompletion
from gateway.openai.serving_responses import OpenAIServingResponses
from gateway.openai.serving_tokenization import DetokenizeRequest, OpenAIServingTokenization, TokenizeRequest
from specdec.errors import AuthenticationError, SpecDecError
from specdec.serving.auth import MISSING_OR_WRONG, ApiKeys
from specdec.serving.metrics import CONTENT_TYPE, exposition, request_error

# the routes an API key guards (vLLM leaves /tokenize and /detokenize open; here they are /v1's peers)
GUARDED = ("/v1/", "/tokenize", "/detokenize")

# the type names pydantic appends to the location of an error in a union field ("stop.str")
_TYPE_NAME = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|function-.*)$")


def create_app(gateway: Gateway, api_key: ApiKeys | str | list[str] | None = None, served_model_name: str | None = None,
               request_timeout: float | None = None) -> FastAPI:
    """``api_key``: the accepted key(s); none: /v1/* is open."""
    keys = api_key if isinstance(api_key, ApiKeys) else ApiKeys.load(api_key)
    app = FastAPI(title="specdec", version=specdec.__version__)
    model_name = served_model_name or gateway.model_name
    created = int(time.time())
    completion = OpenAIServingCompletion(gateway, model_name, request_timeout)
    chat = OpenAIServingChat(gateway, model_name, request_timeout)
    tokenization = OpenAIServingTokenization(gateway, model_name, request_timeout)
    config = gateway.config
    responses = OpenAIServingResponses(gateway, model_name, request_timeout, ResponseStore(
        config.responses_store_max_entries, config.responses_store_max_bytes, config.responses_store_ttl_seconds,
        model_name), per_key=bool(keys))

    max_body = gateway.config.max_request_body_bytes

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if not request.url.path.startswith(GUARDED):
            return await call_next(request)
        length = request.headers.get("content-length", "")
        if not keys.check(request.headers.get("authorization")):  # constant time, every key compared
            response = domain_error_response(AuthenticationError(MISSING_OR_WRONG))
        elif (length.isdigit() and int(length) > max_body) or "chunked" in request.headers.get("transfer-encoding", ""):
            response = error_response(413, f"the request body is larger than this server's limit of {max_body} bytes "
                                      "(--max-request-body-bytes), or not sent with a Content-Length",
                                      "invalid_request_error", code="request_too_large")
        else:
            response = await call_next(request)
        if response.status_code >= 400:
            request_error(model_name, "http", response.status_code)
        return response

    install_error_handlers(app)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if gateway.draining:  # SIGTERM: out of the load balancer first, then the requests in flight finish
            return error_response(503, "the gateway is shutting down (draining its requests in flight)",
                                  "service_unavailable", code="draining")
        problems, degraded = await asyncio.to_thread(gateway.check_backends)
        if problems:
            return error_response(503, "; ".join(problems), "service_unavailable", code="backend_unavailable")
        body = {"status": "degraded" if degraded else "ready", "target": gateway.target_info.model_name,
                "draft": gateway.draft_info.model_name if gateway.draft_info else None}
        if degraded:
            body["degraded"] = degraded
        return body

    @app.get("/metrics")
    async def metrics():  # open like /health (no API key), as vLLM's
        return Response(exposition(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        return {"version": specdec.__version__}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "specdec", "max_model_len": gateway.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await completion.create_completion(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await chat.create_chat_completion(body, request)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        return await responses.create_response(body, request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        return responses.get(request, response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, request: Request):
        return responses.input_items(request, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        return responses.delete(request, response_id)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await asyncio.to_thread(tokenization.tokenize, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await asyncio.to_thread(tokenization.detokenize, body)

    return app


def install_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's body: validation (400, naming the param), routing (404 / 405), domain
    errors from the one table, and any other exception as a logged internal error."""

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, SpecDecError):  # raised by a body's own check (e.g. protocol.check_unicode)
            return domain_error_response(cause)
        body_error = _body_error(first, request.headers.get("content-type", ""))
        if body_error:
            return error_response(400, body_error, "invalid_request_error")
        # drop "body" and the type names pydantic appends for union fields ("stop.str")
        loc = [str(x) for x in first.get("loc", []) if x != "body" and not _TYPE_NAME.match(str(x))]
        param = ".".join(loc) or None
        return error_response(400, f"invalid parameter {param}: {first.get('msg', 'invalid request')}",
                              "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return error_response(404, f"no route {request.method} {request.url.path}", "invalid_request_error",
                                  code="not_found")
        if exc.status_code == 405:
            return error_response(405, f"method {request.method} not allowed on {request.url.path}",
                                  "invalid_request_error")
        if exc.status_code == 400 and isinstance(exc.__cause__, (RecursionError, ValueError)):
            # FastAPI's "There was an error parsing the body": the JSON parser's own limits
            why = ("it is nested too deeply" if isinstance(exc.__cause__, RecursionError)
                   else str(exc.__cause__).split(";")[0])
            return error_response(400, f"the request body could not be parsed ({why}); send a JSON object of "
                                  "OpenAI's request fields", "invalid_request_error")
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.exception_handler(SpecDecError)
    async def on_domain_error(_request: Request, exc: SpecDecError):
        return domain_error_response(exc)

    @app.exception_handler(Exception)
    async def on_unexpected(_request: Request, exc: Exception):  # still OpenAI-shaped, and logged
        return domain_error_response(exc)

    @app.exception_handler(TimeoutError)
    async def on_timeout(_request: Request, exc: TimeoutError):
        return domain_error_response(exc)


def _body_error(error: dict, content_type: str) -> str | None:
    """The message for a body that is not a JSON object at all (None: a parameter's error)."""
    loc = [x for x in error.get("loc", ()) if x != "body"]
    if error.get("type") == "json_invalid":
        detail = (error.get("ctx") or {}).get("error", "JSON decode error")
        where = f" at character {loc[0]}" if loc and isinstance(loc[0], int) else ""
        return f"the request body is not valid JSON ({detail}{where}); send a JSON object"
    if not loc and error.get("type") in ("model_attributes_type", "dict_type", "missing"):
        if "json" not in content_type.lower():
            got = content_type.split(";")[0] or "no Content-Type"
            return f"expected a JSON body with Content-Type: application/json, got {got}"
        if error.get("type") == "missing":
            return "the request body is empty; send a JSON object"
        return "the request body must be a JSON object"
    return None


class HttpServer:
    """uvicorn in a background thread on a socket we bind ourselves (so port 0 works in tests)."""

    def __init__(self, app: FastAPI, host: str, port: int, ssl_certfile: str | None = None,
                 ssl_keyfile: str | None = None, ssl_ca_certs: str | None = None, ssl_cert_reqs: int = ssl.CERT_NONE):
        """``ssl_certfile`` + ``ssl_keyfile`` (PEM): serve HTTPS; ``ssl_ca_certs`` + ``ssl_cert_reqs`` (1
        optional, 2 required): check clients' certificates against that CA (uvicorn's settings, as vLLM's
        flags; ``gateway.config.https_settings`` checks them)."""
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5,
                                                    ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile,
                                                    ssl_ca_certs=ssl_ca_certs, ssl_cert_reqs=int(ssl_cert_reqs)))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.server.started:  # e.g. uvicorn could not load the TLS files
            self.stop()
            raise OSError(f"the HTTP server on {host}:{self.port} did not start (see the log)")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
