"""POST /v1/completions (vLLM's ``OpenAIServingCompletion``): prompts, sampling, the response or its stream."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request

from gateway.openai.bridge import deltas, run_to_end, sse
from gateway.openai.logprobs import LogprobFormatter
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
        for name in ("tools", "tool_choice"):
            if (body.model_extra or {}).get(name) not in (None, [], "none"):
                raise InvalidRequestError(f"{name} are for /v1/chat/completions", param=name)
        prompt_only = body.max_tokens == 0  # echo scoring the prompt: one token is generated, then dropped
        if prompt_only and not body.echo:
            raise InvalidRequestError("max_tokens must be at least 1; 0 is only for echo=true (scoring the prompt)",
                                      param="max_tokens")
        prompts = self.prompt_ids(body.prompt)
        params = body.to_sampling_params(1 if prompt_only else body.max_tokens)
        if body.max_tokens is None:  # OpenAI's default of 16, or what the context leaves if that is less
            seqs = [self.new_sequence(ids, params.clone(max_tokens=max(1, min(DEFAULT_MAX_TOKENS,
                                                                            self.gateway.max_model_len - len(ids)))), i,
                                       body.priority)
                    for ids in prompts for i in range(body.n)]
        else:
            seqs = [self.new_sequence(ids, params, i, body.priority) for ids in prompts for i in range(body.n)]
        texts = [self.gateway.tokenizer.decode(ids) for ids in prompts] if body.echo else None
        rid = f"cmpl-{uuid.uuid4().hex}"
        k = body.num_speculative_tokens
        if body.stream:
            return sse(self._stream(seqs, k, rid, body, texts, prompt_only))
        await run_to_end(self.gateway, seqs, k, self.request_timeout, request)
        fmt = LogprobFormatter(self.gateway.tokenizer)
        choices = []
        for i, s in enumerate(seqs):
            choice = {"index": i, "text": (texts[i // body.n] if texts else "") + ("" if prompt_only else s.text),
                      "logprobs": None, "finish_reason": s.finish_reason, "stop_reason": s.stop_reason}
            if body.logprobs is not None:
                ids, entries = ((list(s.prompt_token_ids), list(s.prompt_logprobs or [])) if body.echo else ([], []))
                if not prompt_only:
                    ids, entries = ids + s.output_token_ids, entries + (s.logprobs or [])
                choice["logprobs"] = fmt.completion(ids, entries, body.logprobs)
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = fmt.prompt_logprobs(s.prompt_logprobs or [], body.prompt_logprobs)
            choices.append(choice)
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
                      texts: list[str] | None, prompt_only: bool = False):
        created = int(time.time())
        n = body.n
        fmt = LogprobFormatter(self.gateway.tokenizer)
        offsets = [0] * len(seqs)  # text_offset: characters of token text sent so far, per output
        prompt_sent: set[int] = set()

        def chunk(i: int, text: str, finish: str | None, ids: list[int] = (), entries: list = ()) -> dict:
            logprobs = None
            if body.logprobs is not None:
                logprobs = fmt.completion(list(ids), list(entries), body.logprobs, offsets[i])
                offsets[i] += sum(len(fmt.text(t)) for t in ids)
            choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}
            if body.prompt_logprobs is not None and i not in prompt_sent and seqs[i].prompt_logprobs is not None:
                prompt_sent.add(i)  # vLLM's extension: with the output's first chunk after the prompt was scored
                choice["prompt_logprobs"] = fmt.prompt_logprobs(seqs[i].prompt_logprobs, body.prompt_logprobs)
            return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": [choice]}

        # echo: each output starts with its prompt's text; with logprobs, once the first round scored it
        late_echo = texts is not None and body.logprobs is not None
        if texts and not late_echo:
            for i in range(len(seqs)):
                yield chunk(i, texts[i // n], None)
        echoed: set[int] = set()
        try:
            async for i, delta in deltas(self.gateway, seqs, k, self.request_timeout):
                s = seqs[i]
                if late_echo and i not in echoed:
                    echoed.add(i)
                    yield chunk(i, texts[i // n], None, s.prompt_token_ids, s.prompt_logprobs or [])
                if prompt_only:
                    if delta.finished:
                        yield chunk(i, "", s.finish_reason)
                elif delta.text or delta.finished or (body.logprobs is not None and delta.token_ids):
                    yield chunk(i, delta.text, s.finish_reason if delta.finished else None, delta.token_ids,
                                delta.logprobs or [])
        except Exception as exc:  # the stream has started: report in-band, OpenAI style
            yield stream_error(exc, self.model_name)
            return
        if body.include_usage():
            prompts = [s.prompt_token_ids for s in seqs[::n]]
            yield {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                   "choices": [], "usage": usage(seqs, prompts)}
