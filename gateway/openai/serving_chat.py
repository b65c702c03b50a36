"""POST /v1/chat/completions (vLLM's ``OpenAIServingChat``): the chat template, sampling, the response or
its stream."""

from __future__ import annotations

import json
import time
import uuid

import jinja2
from fastapi import Request

from gateway.openai.bridge import deltas, run_to_end, sse
from gateway.openai.logprobs import LogprobFormatter
from gateway.openai.protocol import ChatCompletionRequest, ChatMessage, stream_error, usage
from gateway.openai.serving_engine import OpenAIServing
from gateway.openai.structured import ToolPlan, tool_call, tool_plan, tools_prompt
from specdec.errors import InvalidRequestError
from specdec.sequence import SequenceState


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, body: ChatCompletionRequest, request: Request):
        """The response body (a dict), or an SSE stream when ``stream`` is set; n outputs of one prompt."""
        self.check_request(body)
        plan = tool_plan(body.model_extra or {})
        ids = self.chat_prompt(body.messages, tools=plan.tools if plan else None)
        params = body.to_sampling_params(body.max_completion_tokens or body.max_tokens, plan and plan.grammar())
        try:
            seqs = [self.new_sequence(ids, params, i, body.priority) for i in range(body.n)]
        except InvalidRequestError as exc:  # name the field the request used
            if exc.param == "max_tokens" and body.max_completion_tokens is not None:
                exc.param = "max_completion_tokens"
            raise
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        k = body.num_speculative_tokens
        if body.stream:
            return sse(self._stream(seqs, k, rid, body, plan))
        await run_to_end(self.gateway, seqs, k, self.request_timeout, request)
        fmt = LogprobFormatter(self.gateway.tokenizer)
        top = body.num_logprobs()
        choices = []
        for i, s in enumerate(seqs):
            message, finish = reply(s, plan)
            choices.append({"index": i, "message": message,
                            "logprobs": fmt.chat(s.logprobs or [], top) if top is not None else None,
                            "finish_reason": finish, "stop_reason": s.stop_reason})
        response = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                    "choices": choices, "usage": usage(seqs, [ids])}
        if body.prompt_logprobs is not None:  # vLLM's extension, once per response
            response["prompt_logprobs"] = fmt.prompt_logprobs(seqs[0].prompt_logprobs or [], body.prompt_logprobs)
        return response

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        """The messages (text content only) through the served tokenizer's chat template, with the
        generation prompt; a template that refuses them is a 400. ``tools`` go to a template that renders
        them; another template gets them as a system message (and earlier calls as JSON content)."""
        tokenizer = self.gateway.tokenizer
        native_tools = bool(tools) and "tools" in (tokenizer.chat_template or "")
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
            turn = {"role": m.role, "content": content or ""}
            if m.tool_calls:
                if native_tools:
                    turn["tool_calls"] = m.tool_calls
                else:
                    turn["content"] = (turn["content"] + "\n" if turn["content"] else "") + json.dumps(
                        [{"name": c.get("function", {}).get("name"), "arguments": c.get("function", {}).get("arguments")}
                         for c in m.tool_calls], ensure_ascii=False)
            if m.tool_call_id is not None:
                turn["tool_call_id"] = m.tool_call_id
            conversation.append(turn)
        if tools and not native_tools:
            if conversation and conversation[0]["role"] == "system":
                conversation[0] = {**conversation[0], "content": conversation[0]["content"] + "\n\n" + tools_prompt(tools)}
            else:
                conversation.insert(0, {"role": "system", "content": tools_prompt(tools)})
        if tokenizer.chat_template is None:
            raise InvalidRequestError("the served model's tokenizer has no chat template; use /v1/completions",
                                      param="messages")
        try:
            ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                tokenize=True, **({"tools": tools} if native_tools else {}))
        except jinja2.TemplateError as exc:  # the template's own checks (e.g. roles must alternate)
            raise InvalidRequestError(f"the chat template refused these messages: {exc}", param="messages") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    async def _stream(self, seqs: list[SequenceState], k: int | None, rid: str, body: ChatCompletionRequest,
                      plan: ToolPlan | None):
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
        calls = [ToolStream(plan) if plan is not None and plan.choice != "none" else None for _ in seqs]
        try:
            async for i, delta in deltas(self.gateway, seqs, k, self.request_timeout):
                if calls[i] is not None:  # tool calls: as OpenAI streams them
                    for out, finish in calls[i].step(seqs[i], delta):
                        yield chunk(i, out, finish)
                elif delta.text or delta.finished or (top is not None and delta.token_ids):
                    yield chunk(i, {"content": delta.text} if delta.text else {},
                                seqs[i].finish_reason if delta.finished else None, delta.logprobs)
        except Exception as exc:  # the stream has started: report in-band, OpenAI style
            yield stream_error(exc, self.model_name)
            return
        if body.include_usage():
            yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                   "choices": [], "usage": usage(seqs, [seqs[0].prompt_token_ids])}


def reply(seq: SequenceState, plan: ToolPlan | None) -> tuple[dict, str | None]:
    """(the assistant message, finish_reason) of a finished output: tool calls when the reply is one."""
    calls = plan.calls(seq.text) if plan is not None and seq.finish_reason == "stop" else None
    if not calls:
        return {"role": "assistant", "content": seq.text}, seq.finish_reason
    # OpenAI: a named tool_choice finishes with "stop", a call the model made with "tool_calls"
    return {"role": "assistant", "content": None, "tool_calls": calls}, "stop" if plan.choice == "named" else "tool_calls"


class ToolStream:
    """One output's stream under tools. A named function: its call's id and name first, then the arguments
    as they are generated. required / auto: the reply is held while it may be a call (required: always;
    auto: once it starts with ``{``, ``[`` or ``<``), then sent as calls (one delta each: id, name,
    arguments) or as content; auto text that starts otherwise streams as content."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.started = False
        self.hold: bool | None = True if plan.choice == "required" else None  # None: not decided yet

    def step(self, seq: SequenceState, delta) -> list[tuple[dict, str | None]]:
        plan, out = self.plan, []
        finish = seq.finish_reason if delta.finished else None
        if plan.choice == "named":
            if not self.started:
                self.started = True
                out.append(({"tool_calls": [{"index": 0, **tool_call(plan.named, "")}]}, None))
            if delta.text:
                out.append(({"tool_calls": [{"index": 0, "function": {"arguments": delta.text}}]}, None))
            if finish:
                out.append(({}, "stop" if finish == "stop" else finish))
            return out
        if self.hold is None and seq.text.strip():
            self.hold = seq.text.lstrip()[0] in "{[<"
            held = seq.text[: len(seq.text) - len(delta.text)]
            if not self.hold and held:  # a plain answer: what was held so far goes out now
                out.append(({"content": held}, None))
        if not self.hold:
            if delta.text or finish:
                out.append(({"content": delta.text} if delta.text else {}, finish))
            return out
        if not finish:
            return out
        message, reason = reply(seq, plan)
        if message.get("tool_calls"):
            out += [({"tool_calls": [{"index": j, **c}]}, None) for j, c in enumerate(message["tool_calls"])]
        elif seq.text:
            out.append(({"content": seq.text}, None))
        out.append(({}, reason))
        return out
