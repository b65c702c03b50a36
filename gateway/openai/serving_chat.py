"""POST /v1/chat/completions (vLLM's ``OpenAIServingChat``): the chat template, sampling, the response or
its stream."""

from __future__ import annotations

import time
import uuid

import jinja2
from fastapi import Request

from gateway.openai.bridge import deltas, run_to_end, sse
from gateway.openai.logprobs import LogprobFormatter
from gateway.openai.protocol import ChatCompletionRequest, ChatMessage, stream_error, usage
from gateway.openai.serving_engine import OpenAIServing
from specdec.errors import InvalidRequestError
from specdec.sequence import SequenceState


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, body: ChatCompletionRequest, request: Request):
        """The response body (a dict), or an SSE stream when ``stream`` is set; n outputs of one prompt."""
        self.check_request(body)
        ids = self.chat_prompt(body.messages)
        params = body.to_sampling_params(body.max_completion_tokens or body.max_tokens)
        try:
            seqs = [self.new_sequence(ids, params, i) for i in range(body.n)]
        except InvalidRequestError as exc:  # name the field the request used
            if exc.param == "max_tokens" and body.max_completion_tokens is not None:
                exc.param = "max_completion_tokens"
            raise
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        k = body.num_speculative_tokens
        if body.stream:
            return sse(self._stream(seqs, k, rid, body))
        await run_to_end(self.gateway, seqs, k, self.request_timeout, request)
        fmt = LogprobFormatter(self.gateway.tokenizer)
        top = body.num_logprobs()
        choices = [{"index": i, "message": {"role": "assistant", "content": s.text},
                    "logprobs": fmt.chat(s.logprobs or [], top) if top is not None else None,
                    "finish_reason": s.finish_reason, "stop_reason": s.stop_reason} for i, s in enumerate(seqs)]
        response = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                    "choices": choices, "usage": usage(seqs, [ids])}
        if body.prompt_logprobs is not None:  # vLLM's extension, once per response
            response["prompt_logprobs"] = fmt.prompt_logprobs(seqs[0].prompt_logprobs or [], body.prompt_logprobs)
        return response

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        """The messages (text content only) through the served tokenizer's chat template, with the
        generation prompt; a template that refuses them is a 400."""
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
        tokenizer = self.gateway.tokenizer
        if tokenizer.chat_template is None:
            raise InvalidRequestError("the served model's tokenizer has no chat template; use /v1/completions",
                                      param="messages")
        try:
            ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                tokenize=True)
        except jinja2.TemplateError as exc:  # the template's own checks (e.g. roles must alternate)
            raise InvalidRequestError(f"the chat template refused these messages: {exc}", param="messages") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    async def _stream(self, seqs: list[SequenceState], k: int | None, rid: str, body: ChatCompletionRequest):
        created = int(time.time())
        fmt = LogprobFormatter(self.gateway.tokenizer)
        top = body.num_logprobs()
        prompt_sent = body.prompt_logprobs is None

        def chunk(i: int, delta: dict, finish: str | None, logprobs: list | None = None) -> dict:
            out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                   "choices": [{"index": i, "delta": delta, "logprobs": None if logprobs is None or top is None
                                else fmt.chat(logprobs, top), "finish_reason": finish}]}
            nonlocal prompt_sent
            if not prompt_sent and seqs[i].prompt_logprobs is not None:  # vLLM's extension, once
                prompt_sent = True
                out["prompt_logprobs"] = fmt.prompt_logprobs(seqs[i].prompt_logprobs, body.prompt_logprobs)
            return out

        for i in range(len(seqs)):
            yield chunk(i, {"role": "assistant", "content": ""}, None)
        try:
            async for i, delta in deltas(self.gateway, seqs, k, self.request_timeout):
                if delta.text or delta.finished or (top is not None and delta.token_ids):
                    yield chunk(i, {"content": delta.text} if delta.text else {},
                                seqs[i].finish_reason if delta.finished else None, delta.logprobs)
        except Exception as exc:  # the stream has started: report in-band, OpenAI style
            yield stream_error(exc, self.model_name)
            return
        if body.include_usage():
            yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                   "choices": [], "usage": usage(seqs, [seqs[0].prompt_token_ids])}
