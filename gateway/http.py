"""OpenAI-compatible HTTP API on the gateway (FastAPI, served by uvicorn in the gateway's process).

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health, GET /ready,
GET /version. Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``.
Generation runs in a worker thread per output; a client that disconnects from a stream cancels the
generation at the next round, which releases both services' caches.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

import specdec
from gateway.generation import Gateway, deadline_from_timeout
from specdec.errors import AuthenticationError, InvalidRequestError, ModelNotFoundError, SpecDecError, openai_error_body
from specdec.sampling import SamplingParams
from specdec.sequence import SequenceState
from specdec.seeding import output_seed

logger = logging.getLogger(__name__)
_TYPE_NAME = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|function-.*)$")


# -- request bodies (OpenAI's fields; unknown fields are accepted and ignored, as OpenAI does) --------


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, lt=2**31)  # extension (vLLM's)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    user: str | None = None
    ignore_eos: bool = False  # extension (vLLM's)
    num_speculative_tokens: int | None = Field(default=None, ge=1)  # extension: per-request k
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


# -- errors ----------------------------------------------------------------------------------------


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": type_, "param": param,
                                                                "code": code}})


def domain_error_response(exc: BaseException) -> JSONResponse:
    """OpenAI's error body for any exception, from the one table in specdec.errors."""
    status, body = openai_error_body(exc)
    if status >= 500 and not isinstance(exc, SpecDecError):
        logger.error("unexpected error", exc_info=exc)
    return JSONResponse(status_code=status, content=body)


# -- the app ---------------------------------------------------------------------------------------


def create_app(gateway: Gateway, api_key: str | None = None, served_model_name: str | None = None,
               request_timeout: float | None = None) -> FastAPI:
    app = FastAPI(title="specdec", version=specdec.__version__)
    model_name = served_model_name or gateway.model_name
    created = int(time.time())

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return domain_error_response(
                    AuthenticationError("invalid or missing API key: send 'Authorization: Bearer <key>'"))
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
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

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        problems = await asyncio.to_thread(gateway.check_backends)
        if problems:
            return error_response(503, "; ".join(problems), "service_unavailable", code="backend_unavailable")
        return {"status": "ready", "target": gateway.target_info.model_name,
                "draft": gateway.draft_info.model_name if gateway.draft_info else None}

    @app.get("/version")
    async def version():
        return {"version": specdec.__version__}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "specdec", "max_model_len": gateway.max_model_len}]}

    def check_request(body: _Common) -> None:
        if body.model is not None and body.model != model_name:
            raise ModelNotFoundError(f"the model {body.model!r} does not exist; this server serves {model_name!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name):
                raise InvalidRequestError(f"{name} is not supported (only 0)", param=name)
        gateway.resolve_k(body.num_speculative_tokens)  # a bad k is a 400 before any stream starts
        if body.logprobs not in (None, False, 0):
            raise InvalidRequestError("logprobs are not supported", param="logprobs")

    def sampling(body: _Common, max_tokens: int | None) -> SamplingParams:
        return SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                              max_tokens=max_tokens, stop=body.stop, ignore_eos=body.ignore_eos)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_request(body)
        prompts = _prompt_list(body.prompt, gateway)
        params = sampling(body, body.max_tokens or 16)
        seqs = [_new_seq(gateway, ids, params, i) for ids in prompts for i in range(body.n)]
        texts = [gateway.tokenizer.decode(ids) for ids in prompts] if body.echo else None
        rid = f"cmpl-{uuid.uuid4().hex}"
        k = body.num_speculative_tokens
        if body.stream:
            return _sse(_stream_completion(gateway, seqs, k, rid, model_name, body, texts, request_timeout))
        await _run_to_end(gateway, seqs, k, request_timeout, request)
        choices = [{"index": i, "text": (texts[i // body.n] if texts else "") + s.text, "logprobs": None,
                    "finish_reason": s.finish_reason, "stop_reason": s.stop_reason} for i, s in enumerate(seqs)]
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": choices, "usage": _usage(seqs, prompts)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_request(body)
        ids = _chat_prompt(gateway, body.messages)
        params = sampling(body, body.max_completion_tokens or body.max_tokens)
        seqs = [_new_seq(gateway, ids, params, i) for i in range(body.n)]
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        k = body.num_speculative_tokens
        if body.stream:
            return _sse(_stream_chat(gateway, seqs, k, rid, model_name, body, request_timeout))
        await _run_to_end(gateway, seqs, k, request_timeout, request)
        choices = [{"index": i, "message": {"role": "assistant", "content": s.text}, "logprobs": None,
                    "finish_reason": s.finish_reason, "stop_reason": s.stop_reason} for i, s in enumerate(seqs)]
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                "choices": choices, "usage": _usage(seqs, [ids])}

    return app


# -- helpers ---------------------------------------------------------------------------------------


def _prompt_list(prompt, gateway: Gateway) -> list[list[int]]:
    if isinstance(prompt, str):
        return [gateway.tokenize(prompt)]
    if not prompt:
        raise InvalidRequestError("prompt is empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return [gateway.tokenize(p) for p in prompt]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [list(p) for p in prompt]


def _chat_prompt(gateway: Gateway, messages: list[ChatMessage]) -> list[int]:
    conversation = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text":
                    raise InvalidRequestError(f"messages[{i}].content: only text parts are supported",
                                              param=f"messages.{i}.content")
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
        conversation.append({"role": m.role, "content": content or ""})
    if gateway.tokenizer.chat_template is None:
        raise InvalidRequestError("the served model's tokenizer has no chat template; use /v1/completions",
                                  param="messages")
    try:
        ids = gateway.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    except jinja2.TemplateError as exc:  # the template's own checks (e.g. roles must alternate)
        raise InvalidRequestError(f"the chat template refused these messages: {exc}", param="messages") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def _new_seq(gateway: Gateway, ids: list[int], params: SamplingParams, index: int) -> SequenceState:
    if params.seed is not None and index:
        params = params.clone(seed=output_seed(params.seed, index))  # n > 1: distinct, reproducible samples
    return gateway.new_sequence(ids, params)


async def _run_to_end(gateway: Gateway, seqs: list[SequenceState], k: int | None, timeout: float | None,
                      request: Request) -> None:
    """A non-streamed request: every sequence runs to its end on a thread of its own (not a shared
    pool that a large n could fill); a client that goes away cancels them all, freeing the caches."""
    async def disconnected() -> None:  # the body is read: the next ASGI message is the disconnect
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    deltas = _deltas(gateway, seqs, k, timeout)
    try:
        async for _ in deltas:
            if watcher.done():
                break
    finally:
        watcher.cancel()
        await deltas.aclose()


def _usage(seqs: list[SequenceState], prompts: list[list[int]]) -> dict:
    """OpenAI's usage (each prompt counted once, whatever n) plus the speculation stats."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(s.output_token_ids) for s in seqs)
    drafted = sum(s.stats.num_draft_tokens for s in seqs)
    accepted = sum(s.stats.num_accepted_tokens for s in seqs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "spec_decode": {"num_draft_tokens": drafted, "num_accepted_tokens": accepted,
                            "acceptance_rate": accepted / drafted if drafted else 0.0}}


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _deltas(gateway: Gateway, seqs: list[SequenceState], k: int | None, timeout: float | None):
    """Run every sequence in its own thread; yield (index, Delta) as rounds complete.

    Leaving the iteration early (client disconnect) sets the cancel flag: each thread stops at its
    next round and its generator's cleanup releases both services' caches.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancel = threading.Event()
    done = object()

    def run(i: int, seq: SequenceState) -> None:
        try:
            for delta in gateway.stream(seq, k, deadline_from_timeout(timeout), cancelled=cancel.is_set):
                loop.call_soon_threadsafe(queue.put_nowait, (i, delta))
        except BaseException as exc:  # surfaced to the client as an error event
            loop.call_soon_threadsafe(queue.put_nowait, (i, exc))
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, (i, done))

    threads = [threading.Thread(target=run, args=(i, s), daemon=True) for i, s in enumerate(seqs)]
    for t in threads:
        t.start()
    remaining = len(seqs)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        cancel.set()


async def _stream_completion(gateway, seqs, k, rid, model_name, body: CompletionRequest, texts, timeout):
    created = int(time.time())
    n = body.n

    def chunk(i: int, text: str, finish: str | None) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": finish}]}

    if texts:
        for i in range(len(seqs)):
            yield chunk(i, texts[i // n], None)
    try:
        async for i, delta in _deltas(gateway, seqs, k, timeout):
            if delta.text or delta.finished:
                yield chunk(i, delta.text, seqs[i].finish_reason if delta.finished else None)
    except Exception as exc:  # the stream has started: report in-band, OpenAI style
        yield {"error": json.loads(domain_error_response(exc).body)["error"]}
        return
    if (body.stream_options or {}).get("include_usage"):
        prompts = [s.prompt_token_ids for s in seqs[::n]]
        yield {"id": rid, "object": "text_completion", "created": created, "model": model_name, "choices": [],
               "usage": _usage(seqs, prompts)}


async def _stream_chat(gateway, seqs, k, rid, model_name, body: ChatCompletionRequest, timeout):
    created = int(time.time())

    def chunk(i: int, delta: dict, finish: str | None) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    for i in range(len(seqs)):
        yield chunk(i, {"role": "assistant", "content": ""}, None)
    try:
        async for i, delta in _deltas(gateway, seqs, k, timeout):
            if delta.text or delta.finished:
                yield chunk(i, {"content": delta.text} if delta.text else {},
                            seqs[i].finish_reason if delta.finished else None)
    except Exception as exc:
        yield {"error": json.loads(domain_error_response(exc).body)["error"]}
        return
    if (body.stream_options or {}).get("include_usage"):
        yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name, "choices": [],
               "usage": _usage(seqs, [seqs[0].prompt_token_ids])}


# -- running it --------------------------------------------------------------------------------------


class HttpServer:
    """uvicorn in a background thread on a socket we bind ourselves (so port 0 works in tests)."""

    def __init__(self, app: FastAPI, host: str, port: int):
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
