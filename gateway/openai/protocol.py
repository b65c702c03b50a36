"""OpenAI's wire shapes: the request bodies (pydantic), the usage object, and the error body.

Request bodies take OpenAI's fields; unknown fields are accepted and ignored, as OpenAI does (the known
ones this server does not implement are refused: ``serving_engine.UNSUPPORTED``). A few extensions are
vLLM's (``top_k``, ``ignore_eos``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``,
``prompt_logprobs``, ``min_p``, ``allowed_token_ids``, ``structured_outputs`` and the ``guided_*`` names: see
``gateway.openai.structured``) or ours (``num_speculative_tokens``: a per-request k).
Every domain error's status and body come from the one table, ``specdec.errors.openai_error_body``.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.openai.structured import structured_from_request
from specdec.errors import InvalidRequestError as SpecDecInvalid, SpecDecError, openai_error_body
from specdec.sampling_params import MAX_LOGPROBS, SamplingParams, SpecDecodeStats
from specdec.sequence import SequenceState
from specdec.serving.metrics import request_error

logger = logging.getLogger(__name__)


# -- request bodies ----------------------------------------------------------------------------------


def check_unicode(data: Any) -> None:
    """400 naming the first string (or object key) of a parsed JSON body that is not valid Unicode.

    JSON's ``\\ud800`` escapes can spell a lone UTF-16 surrogate: valid JSON, but no text (UTF-8
    cannot encode it, and the tokenizer, the logs and the response body would fail on it). Walked
    without recursion, so any nesting the JSON parser accepted is walked too."""
    stack: list[tuple[tuple, Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            _check_text(value, path, "")
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path, "a key of ")  # (the param names the object: never the bad key)
                stack.append((path + (key,), item))
        elif isinstance(value, list):
            stack.extend((path + (i,), item) for i, item in enumerate(value))


def _check_text(text: Any, path: tuple, what: str) -> None:
    if not isinstance(text, str) or text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        param = ".".join(str(p) for p in path) or None
        bad = text[exc.start]
        raise SpecDecInvalid(
            f"{what}{param or 'the request body'} is not valid Unicode: it holds a lone UTF-16 surrogate "
            f"(\\u{ord(bad):04x} at character {exc.start}); send UTF-8 text, and a surrogate pair's two halves "
            "together", param=param) from None


class RequestBody(BaseModel):
    """A JSON request body: unknown fields are kept (and ignored), and every string must be valid Unicode
    (``check_unicode``: a 400 naming the field, before any field is read)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        check_unicode(data)
        return data


class OpenAIRequest(RequestBody):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, lt=2**31)  # extension (vLLM's)
    n: int = Field(default=1, ge=1)  # at most the gateway's --max-n (checked with the request)
    best_of: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    user: str | None = None
    ignore_eos: bool = False  # extension (vLLM's)
    num_speculative_tokens: int | None = Field(default=None, ge=0)  # extension: per-request k (0: off)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)  # extension (vLLM's)
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's form) -> [-100, 100]
    min_tokens: int = Field(default=0, ge=0)  # extension (vLLM's)
    stop_token_ids: list[int] | None = None  # extension (vLLM's)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # extension (vLLM's)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # extension (vLLM's)
    allowed_token_ids: list[int] | None = None  # extension (vLLM's)
    priority: int = Field(default=0, ge=-2**31, lt=2**31)  # extension (vLLM's): --scheduling-policy priority

    def num_logprobs(self) -> int | None:
        """Top logprobs per generated token (None: no logprobs)."""
        return None

    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def to_sampling_params(self, max_tokens: int | None, tool_grammar: Any = None) -> SamplingParams:
        """The request's sampling; its grammar from response_format / structured_outputs / guided_* (or the
        tools' ``tool_grammar``), compiled by the gateway when the sequence is made."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                              max_tokens=max_tokens, stop=self.stop, ignore_eos=self.ignore_eos,
                              logprobs=self.num_logprobs(), prompt_logprobs=self.num_prompt_logprobs(),
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, logit_bias=self.token_logit_bias(),
                              min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids, min_p=self.min_p,
                              allowed_token_ids=self.allowed_token_ids,
                              structured_outputs=structured_from_request(self.model_extra or {}, tool_grammar))

    def token_logit_bias(self) -> dict[int, float] | None:
        """logit_bias with integer token ids (OpenAI sends them as JSON object keys: strings)."""
        if not self.logit_bias:
            return None
        try:
            return {int(t): float(v) for t, v in self.logit_bias.items()}
        except ValueError:
            raise SpecDecInvalid("logit_bias keys must be token ids (integers as strings), got "
                                 f"{[t for t in self.logit_bias][:5]}", param="logit_bias") from None

    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(OpenAIRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    max_tokens: int | None = Field(default=None, ge=0)  # 0 only with echo: score the prompt
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """echo with logprobs scores the prompt too (as many top logprobs as the output's)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# -- responses ---------------------------------------------------------------------------------------


def usage(seqs: list[SequenceState], prompts: list[list[int]]) -> dict:
    """OpenAI's usage (each prompt counted once, whatever n) plus the speculation stats."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(s.output_token_ids) for s in seqs)
    stats = SpecDecodeStats()
    for s in seqs:
        stats.merge(s.stats)
    drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "spec_decode": {"num_drafts": stats.num_drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
                            "acceptance_rate": accepted / drafted if drafted else 0.0,
                            "num_accepted_tokens_per_pos": list(stats.accepted_per_position)}}


# -- errors ------------------------------------------------------------------------------------------


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    """An OpenAI error body made by hand (routing, validation, readiness: no domain error behind it)."""
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": type_, "param": param,
                                                                "code": code}})


def domain_error_body(exc: BaseException) -> tuple[int, dict]:
    """(status, OpenAI's error body) for any exception, from the one table in specdec.errors; an
    unexpected exception (not a SpecDecError) that maps to a 5xx is logged with its traceback."""
    status, body = openai_error_body(exc)
    if status >= 500 and not isinstance(exc, SpecDecError):
        logger.error("unexpected error", exc_info=exc)
    return status, body


RETRY_AFTER_SECONDS = {429: 1, 503: 5}  # what a client told to come back should wait


def domain_error_response(exc: BaseException) -> JSONResponse:
    status, body = domain_error_body(exc)
    retry = RETRY_AFTER_SECONDS.get(status)
    return JSONResponse(status_code=status, content=body,
                        headers={"Retry-After": str(retry)} if retry is not None else None)


def stream_error(exc: BaseException, model_name: str) -> dict:
    """The in-band error event of a stream that has already started (OpenAI style: no status to send;
    the metrics count it under the status it would have had)."""
    status, body = domain_error_body(exc)
    request_error(model_name, "http", status)
    return {"error": body["error"]}
