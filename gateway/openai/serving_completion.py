"""POST /v1/completions (vLLM's ``OpenAIServingCompletion``): prompts, sampling, the response or its stream."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request

from gateway.openai.bridge import deltas, run_to_end, sse
from gateway.openai.protocol import CompletionRequest, stream_error, usage
from gateway.openai.serving_engine import OpenAIServing
from specdec.errors import InvalidRequestError
from specdec.sequence import SequenceState


DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, body: CompletionRequest, request: Request):
        """The response body (a dict), or an SSE stream when ``stream`` is set. Each prompt has n
        outputs, in order: output i belongs to prompt i // n."""
        self.check_request(body)
        prompts = self.prompt_ids(body.prompt)
        params = body.to_sampling_params(body.max_tokens)
        if body.max_tokens is None:  # OpenAI's default of 16, or what the context leaves if that is less
            seqs = [self.new_sequence(ids, params.clone(max_tokens=max(1, min(DEFAULT_MAX_TOKENS,
                                                                            self.gateway.max_model_len - len(ids)))), i)
                    for ids in prompts for i in range(body.n)]
        else:
            seqs = [self.new_sequence(ids, params, i) for ids in prompts for i in range(body.n)]
        texts = [self.gateway.tokenizer.decode(ids) for ids in prompts] if body.echo else None
        rid = f"cmpl-{uuid.uuid4().hex}"
        k = body.num_speculative_tokens
        if body.stream:
            return sse(self._stream(seqs, k, rid, body, texts))
        await run_to_end(self.gateway, seqs, k, self.request_timeout, request)
        choices = [{"index": i, "text": (texts[i // body.n] if texts else "") + s.text, "logprobs": None,
                    "finish_reason": s.finish_reason, "stop_reason": s.stop_reason} for i, s in enumerate(seqs)]
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": usage(seqs, prompts)}

    def prompt_ids(self, prompt: Any) -> list[list[int]]:
        """OpenAI's four prompt forms (a string, strings, token ids, lists of token ids) as token-id lists."""
        if isinstance(prompt, str):
            return [self.gateway.tokenize(prompt)]
        if not prompt:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if all(isinstance(p, str) for p in prompt):
            return [self.gateway.tokenize(p) for p in prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return [list(p) for p in prompt]

    async def _stream(self, seqs: list[SequenceState], k: int | None, rid: str, body: CompletionRequest,
                      texts: list[str] | None):
        created = int(time.time())
        n = body.n

        def chunk(i: int, text: str, finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": finish}]}

        if texts:  # echo: each output starts with its prompt's text
            for i in range(len(seqs)):
                yield chunk(i, texts[i // n], None)
        try:
            async for i, delta in deltas(self.gateway, seqs, k, self.request_timeout):
                if delta.text or delta.finished:
                    yield chunk(i, delta.text, seqs[i].finish_reason if delta.finished else None)
        except Exception as exc:  # the stream has started: report in-band, OpenAI style
            yield stream_error(exc, self.model_name)
            return
        if body.include_usage():
            prompts = [s.prompt_token_ids for s in seqs[::n]]
            yield {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                   "choices": [], "usage": usage(seqs, prompts)}
