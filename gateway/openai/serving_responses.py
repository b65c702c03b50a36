"""POST /v1/responses, GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items: OpenAI's
Responses API (vLLM's ``OpenAIServingResponses``) on the chat path.

A request becomes the chat turns of its conversation (``previous_response_id``'s stored turns, then its own
input; ``responses_items``), one sequence through the same speculative loop, and a response whose ``output``
holds an assistant ``message`` or the ``function_call`` items the model made. A stream is Responses' event
sequence (``response.created``, ``response.output_item.added``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, ..., ``response.completed``); its items are the ones the final
response holds. ``store`` (default true) keeps the response for continuation and ``GET``
(``response_store``).
"""

from __future__ import annotations

import json
import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from gateway.openai.bridge import deltas, run_to_end
from gateway.openai.logprobs import LogprobFormatter
from gateway.openai.protocol import domain_error_body, usage
from gateway.openai.response_store import ResponseStore, StoredResponse, owner_of
from gateway.openai.responses_items import (
    ResponsesRequest, canonical_items, chat_messages, grammar_of, new_id, plan_of,
)
from gateway.openai.serving_chat import OpenAIServingChat, ToolStream, reply
from gateway.openai.structured import ToolPlan, tool_call
from specdec.errors import InvalidRequestError
from specdec.sequence import SequenceState
from specdec.serving.metrics import request_error

# OpenAI's ResponseError codes for a stream that fails after it started
_FAILED_CODE = {429: "rate_limit_exceeded", 400: "invalid_prompt"}


class OpenAIServingResponses(OpenAIServingChat):
    def __init__(self, gateway, model_name: str, request_timeout: float | None, store: ResponseStore,
                 per_key: bool = False):
        """``per_key``: the server checks API keys, so each key's responses are its own (else all are shared)."""
        super().__init__(gateway, model_name, request_timeout)
        self.store = store
        self.per_key = per_key

    def owner(self, request: Request) -> str:
        return owner_of(request.headers.get("authorization")) if self.per_key else ""

    async def create_response(self, body: ResponsesRequest, request: Request):
        """The response object (a dict), or its event stream when ``stream`` is set."""
        self.check_request(body)
        body.check()
        owner = self.owner(request)
        earlier = []
        if body.previous_response_id is not None:
            earlier = self.store.get(owner, body.previous_response_id, param="previous_response_id").items
        items = canonical_items(body.input)
        plan = plan_of(body)
        if not chat_messages(body.instructions, earlier + items):
            raise InvalidRequestError("input is empty and there are no instructions or earlier turns: send at least "
                                      "one message", param="input")
        try:
            ids = self.fit_prompt(body, earlier + items, plan)
        except InvalidRequestError as exc:  # the chat template's refusal names chat's field
            exc.param = "input" if exc.param == "messages" else exc.param
            raise
        params = body.to_sampling_params(body.max_output_tokens, grammar_of(body, plan))
        try:
            seq = self.new_sequence(ids, params, 0, body.priority)
        except InvalidRequestError as exc:  # name the field the request used
            if exc.param == "max_tokens":
                raise InvalidRequestError(str(exc).replace("max_tokens", "max_output_tokens"),
                                          param="max_output_tokens") from None
            exc.param = "input" if exc.param == "prompt" else exc.param
            raise
        draft = Draft(self, body, owner, earlier + items, seq, plan)
        if body.stream:
            return StreamingResponse(draft.events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        await run_to_end(self.gateway, [seq], body.num_speculative_tokens, self.request_timeout, request)
        if seq.finish_reason not in ("stop", "length"):  # the client went away: nobody reads it, nothing is stored
            return None
        return draft.finish(output_items(seq, plan, body.num_logprobs(), self.gateway.tokenizer))

    def fit_prompt(self, body: ResponsesRequest, items: list[dict], plan: ToolPlan | None) -> list[int]:
        """The prompt's token ids. ``truncation: "auto"`` leaves the oldest items out of the prompt until
        prompt + max_output_tokens fits the context (the store keeps them all, as OpenAI's input items);
        ``disabled`` (the default) leaves a prompt that does not fit to the length check (a 400)."""
        tools = plan.tools if plan else None
        dropped = 0
        while True:
            ids = self.chat_prompt(chat_messages(body.instructions, items[dropped:]), tools=tools)
            room = self.gateway.max_model_len - (body.max_output_tokens or 1)
            if body.truncation != "auto" or len(ids) <= room or dropped >= len(items) - 1:
                return ids
            dropped += 1

    def get(self, request: Request, response_id: str) -> dict:
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise InvalidRequestError("stream replays a background response's events, and this server does not run "
                                      "background responses; GET without stream returns the stored response",
                                      param="stream")
        return self.store.get(self.owner(request), response_id, param="response_id").response

    def input_items(self, request: Request, response_id: str) -> dict:
        """OpenAI's list of a response's input items: ``order`` (desc, newest first, by default), ``limit``
        (1-100, default 20) and ``after`` (an item id: the page after it)."""
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidRequestError("order must be \"asc\" or \"desc\"", param="order")
        try:
            limit = int(query.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise InvalidRequestError("limit must be an integer from 1 to 100", param="limit")
        entry = self.store.get(self.owner(request), response_id, param="response_id")
        items = entry.items[:entry.input_count]
        items = list(reversed(items)) if order == "desc" else list(items)
        if "after" in query:
            ids = [item["id"] for item in items]
            if query["after"] not in ids:
                raise InvalidRequestError(f"after {query['after']!r} is not an input item of {response_id}",
                                          param="after")
            items = items[ids.index(query["after"]) + 1:]
        data = items[:limit]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(items) > limit}

    def delete(self, request: Request, response_id: str) -> dict:
        self.store.delete(self.owner(request), response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def output_items(seq: SequenceState, plan: ToolPlan | None, top: int | None, tokenizer) -> list[dict]:
    """A finished reply as Responses output items: an assistant message, or the function calls. A named
    call cut at max_output_tokens is still that call, ``incomplete`` with the arguments it has (as streamed)."""
    status = "incomplete" if seq.finish_reason == "length" else "completed"
    if plan is not None and plan.choice == "named" and status == "incomplete":
        call = tool_call(plan.named, seq.text)
        return [{"type": "function_call", "id": new_id("fc"), "call_id": call["id"], "name": call["function"]["name"],
                 "arguments": seq.text, "status": status}]
    message, _ = reply(seq, plan)
    if message.get("tool_calls"):
        return [{"type": "function_call", "id": new_id("fc"), "call_id": c["id"], "name": c["function"]["name"],
                 "arguments": c["function"]["arguments"], "status": "completed"} for c in message["tool_calls"]]
    logprobs = LogprobFormatter(tokenizer).chat(seq.logprobs or [], top)["content"] if top is not None else []
    return [message_item(new_id("msg"), message["content"] or "", status, logprobs)]


def message_item(item_id: str, text: str | None, status: str, logprobs: list | None = None) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [],
                                        "logprobs": logprobs or []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


class Draft:
    """One response as it is made: its object (in progress, then final), its events when streamed, and
    what the store keeps."""

    def __init__(self, serving: OpenAIServingResponses, body: ResponsesRequest, owner: str, items: list[dict],
                 seq: SequenceState, plan: ToolPlan | None):
        self.serving, self.body, self.owner, self.items, self.seq, self.plan = serving, body, owner, items, seq, plan
        self.id = new_id("resp")
        self.created = time.time()
        self.sequence_number = 0

    def response(self, status: str, output: list[dict], error: dict | None = None) -> dict:
        body = self.body
        finished = status in ("completed", "incomplete")
        extra = body.model_extra or {}
        tool_choice = body.tool_choice if body.tool_choice is not None else "auto"  # OpenAI's echo of unset
        return {
            "id": self.id, "object": "response", "created_at": int(self.created), "status": status,
            "completed_at": int(time.time()) if finished else None, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "max_tool_calls": None,
            "metadata": body.metadata or {}, "model": self.serving.model_name, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": body.store is not False, "temperature": body.temperature,
            "text": {"format": (body.text or {}).get("format") or {"type": "text"}}, "tool_choice": tool_choice,
            "tools": body.tools or [], "top_logprobs": body.top_logprobs, "top_p": body.top_p,
            "truncation": body.truncation or "disabled", "background": False, "service_tier": "default",
            "user": body.user, "usage": responses_usage(self.seq) if finished else None,
            # hints this server takes as they are (its prefix cache needs no key), echoed as OpenAI does
            "prompt_cache_key": extra.get("prompt_cache_key"), "safety_identifier": extra.get("safety_identifier"),
        }

    def finish(self, output: list[dict]) -> dict:
        """The final response (completed, or incomplete at max_output_tokens), stored when asked."""
        status = "incomplete" if self.seq.finish_reason == "length" else "completed"
        response = self.response(status, output)
        if response["store"]:
            stored = self.serving.store.put(StoredResponse(self.owner, response, self.items + output, len(self.items)))
            response["store"] = stored  # larger than the whole store: said, not hidden
        return response

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async def events(self):
        """Responses' event stream: created, in_progress, each output item (added, its deltas, done),
        then completed / incomplete; an error after the start is an ``error`` event and ``response.failed``."""
        yield self.event("response.created", response=self.response("in_progress", []))
        yield self.event("response.in_progress", response=self.response("in_progress", []))
        stream = ItemStream(self)
        calls = ToolStream(self.plan) if self.plan is not None and self.plan.choice != "none" else None
        top = self.body.num_logprobs()
        fmt = LogprobFormatter(self.serving.gateway.tokenizer)
        pending: list = []  # logprobs of tokens whose text has not gone out yet (held while it may be a call)
        try:
            async for _, delta in deltas(self.serving.gateway, [self.seq], self.body.num_speculative_tokens,
                                         self.serving.request_timeout):
                if top is not None:
                    pending += fmt.chat(delta.logprobs or [], top)["content"]
                steps = calls.step(self.seq, delta) if calls is not None else [
                    ({"content": delta.text} if delta.text else {}, None)]
                for chat_delta, _ in steps:
                    logprobs = []
                    if chat_delta.get("content") or chat_delta.get("tool_calls"):  # calls carry no logprobs
                        logprobs, pending = (pending if chat_delta.get("content") else []), []
                    for line in stream.step(chat_delta, logprobs):
                        yield line
        except Exception as exc:  # the stream has started: report in-band
            status, body = domain_error_body(exc)
            request_error(self.serving.model_name, "http", status)
            err = body["error"]
            yield self.event("error", code=err["code"], message=err["message"], param=err["param"])
            failed = {"code": _FAILED_CODE.get(status, "server_error"), "message": err["message"]}
            yield self.event("response.failed", response=self.response("failed", stream.output, failed))
            return
        for line in stream.close(self.seq.finish_reason == "length"):
            yield line
        response = self.finish(stream.output)
        yield self.event("response.incomplete" if response["status"] == "incomplete" else "response.completed",
                         response=response)


class ItemStream:
    """The chat path's deltas (text, or tool calls as ToolStream sends them) as output items and their
    events; ``output`` is the items as the final response holds them."""

    def __init__(self, draft: Draft):
        self.draft = draft
        self.output: list[dict] = []
        self.open: dict | None = None

    def step(self, chat_delta: dict, logprobs: list):
        ev = self.draft.event
        if chat_delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                yield from self._close(False)
                yield from self._open(message_item(new_id("msg"), None, "in_progress"))
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                self.open["content"].append(part)
                yield ev("response.content_part.added", item_id=self.open["id"], output_index=len(self.output) - 1,
                         content_index=0, part=part)
            part = self.open["content"][0]
            part["text"] += chat_delta["content"]
            part["logprobs"] += logprobs
            yield ev("response.output_text.delta", item_id=self.open["id"], output_index=len(self.output) - 1,
                     content_index=0, delta=chat_delta["content"], logprobs=logprobs)
        for call in chat_delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if "id" in call:  # a new call: its own item
                yield from self._close(False)
                yield from self._open({"type": "function_call", "id": new_id("fc"), "call_id": call["id"],
                                       "name": function["name"], "arguments": "", "status": "in_progress"})
            if function.get("arguments"):
                self.open["arguments"] += function["arguments"]
                yield ev("response.function_call_arguments.delta", item_id=self.open["id"],
                         output_index=len(self.output) - 1, delta=function["arguments"])

    def close(self, incomplete: bool):
        if not self.output:  # nothing generated: still one (empty) message, as the final response has
            yield from self._open(message_item(new_id("msg"), None, "in_progress"))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.open["content"].append(part)
            yield self.draft.event("response.content_part.added", item_id=self.open["id"], output_index=0,
                                   content_index=0, part=part)
        yield from self._close(incomplete)

    def _open(self, item: dict):
        self.open = item
        self.output.append(item)
        yield self.draft.event("response.output_item.added", output_index=len(self.output) - 1,
                               item={**item, "content": []} if item["type"] == "message" else dict(item))

    def _close(self, incomplete: bool):
        item, self.open = self.open, None
        if item is None:
            return
        ev, index = self.draft.event, self.output.index(item)
        if item["type"] == "message":
            part = item["content"][0]
            yield ev("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                     text=part["text"], logprobs=part["logprobs"])
            yield ev("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
        else:
            yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                     name=item["name"], arguments=item["arguments"])
        item["status"] = "incomplete" if incomplete else "completed"
        yield ev("response.output_item.done", output_index=index, item=item)


def responses_usage(seq: SequenceState) -> dict:
    """Responses' usage (input / output tokens) with the speculation stats chat reports."""
    chat = usage([seq], [seq.prompt_token_ids])
    return {"input_tokens": chat["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": chat["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat["total_tokens"], "spec_decode": chat["spec_decode"]}
