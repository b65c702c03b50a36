"""The Responses API's request (``POST /v1/responses``) and its items, as chat turns.

A request's ``input`` (a string, or a list of items: messages with roles, ``function_call`` items the model
made, ``function_call_output`` items the client answers them with) becomes canonical items (what the store
keeps and ``GET .../input_items`` lists), and items become the chat messages the served chat template reads:
the same prompt ``/v1/chat/completions`` builds for the same conversation. Function tools (Responses' flat
``{"type": "function", "name", "parameters"}``) and ``text.format`` become the chat path's ``ToolPlan`` and
grammar. Whatever this server cannot honour (other tool types, non-text parts, background mode) is a 400
whose ``param`` names the field.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import Field

from gateway.openai.protocol import ChatMessage, OpenAIRequest
from gateway.openai.structured import ToolPlan, hoist_defs, tool_plan
from specdec.errors import InvalidRequestError
from specdec.sampling_params import MAX_LOGPROBS
from specdec.structured import StructuredOutputsParams

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# include values with nothing to add here: this server's models produce no reasoning to encrypt
NOTHING_TO_INCLUDE = ("reasoning.encrypted_content",)
# request fields OpenAI defines that this server refuses unless at their "off" value
UNSUPPORTED = {"background": (None, False), "conversation": (None,), "prompt": (None,), "max_tool_calls": (None,),
               "context_management": (None, [])}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(OpenAIRequest):
    """OpenAI's ``ResponseCreateParams`` (the sampling extensions of chat, vLLM's and ours, apply too)."""

    input: str | list[Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None

    def num_logprobs(self) -> int | None:
        """Top logprobs per output token: with ``include: ["message.output_text.logprobs"]`` (or top_logprobs)."""
        if LOGPROBS_INCLUDE in (self.include or []) or self.top_logprobs:
            return self.top_logprobs or 0
        return None

    def check(self) -> None:
        """What the fields alone say is unsupported (400 naming the field)."""
        extra = self.model_extra or {}
        for name, off in UNSUPPORTED.items():
            if extra.get(name) not in off:
                raise InvalidRequestError(f"{name} is not supported by this server; leave it unset", param=name)
        if self.n != 1:
            raise InvalidRequestError("the Responses API makes one output; leave n unset (or use chat completions)",
                                      param="n")
        if self.max_tokens is not None:
            raise InvalidRequestError("the Responses API's output cap is max_output_tokens; leave max_tokens unset",
                                      param="max_tokens")
        if self.input is None:
            raise InvalidRequestError("input is required: a string, or a list of input items", param="input")
        for i, value in enumerate(self.include or []):
            if value != LOGPROBS_INCLUDE and value not in NOTHING_TO_INCLUDE:
                raise InvalidRequestError(f"include[{i}] {value!r} is not supported; this server can include "
                                          f"{LOGPROBS_INCLUDE!r}", param=f"include.{i}")
        effort = (self.reasoning or {}).get("effort")
        if effort not in (None, "none", "minimal") or (self.reasoning or {}).get("summary") not in (None,):
            raise InvalidRequestError("reasoning is not supported: the served model does not reason; leave it unset",
                                      param="reasoning")
        if self.metadata is not None and len(self.metadata) > 16:
            raise InvalidRequestError("metadata holds at most 16 key-value pairs", param="metadata")


# -- input items -------------------------------------------------------------------------------------


def _text_of(content: Any, param: str) -> list[dict]:
    """A message's content as canonical text parts (a string is one part)."""
    if isinstance(content, str):
        return [{"type": "input_text", "text": content}]
    if not isinstance(content, list):
        raise InvalidRequestError(f"{param} must be a string or a list of input_text parts", param=param)
    parts = []
    for j, part in enumerate(content):
        where = f"{param}.{j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "output_text", "text": part["refusal"]})
            continue
        if kind not in TEXT_PARTS:
            what = f"{kind} parts are" if isinstance(kind, str) else "a part without a text type is"
            raise InvalidRequestError(f"{where}: {what} not supported: the served model reads text only; send "
                                      "{\"type\": \"input_text\", \"text\": ...}", param=where)
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{where}.text must be a string", param=f"{where}.text")
        parts.append({"type": kind, "text": part["text"]})
    return parts


def _string(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise InvalidRequestError(f"{param}.{key} must be a non-empty string", param=f"{param}.{key}")
    return value


def _item_id(item: dict, param: str, prefix: str) -> str:
    """The item's own id (a non-empty string, where given), or a new one."""
    value = item.get("id")
    if value is None or value == "":
        return new_id(prefix)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{param}.id must be a string (or left out)", param=f"{param}.id")
    return value


def canonical_items(raw: str | list[Any]) -> list[dict]:
    """The request's input as canonical items (each with an id), every item checked."""
    if isinstance(raw, str):
        return [{"type": "message", "id": new_id("msg"), "role": "user", "status": "completed",
                 "content": _text_of(raw, "input")}]
    items = []
    for i, item in enumerate(raw):
        param = f"input.{i}"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{param} must be an object: a message {{role, content}}, a function_call or "
                                      "a function_call_output", param=param)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            if item.get("role") not in ROLES:
                raise InvalidRequestError(f"{param}.role must be one of {list(ROLES)}", param=f"{param}.role")
            items.append({"type": "message", "id": _item_id(item, param, "msg"), "role": item["role"],
                          "status": "completed", "content": _text_of(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            items.append({"type": "function_call", "id": _item_id(item, param, "fc"),
                          "call_id": _string(item, "call_id", param), "name": _string(item, "name", param),
                          "arguments": _string(item, "arguments", param), "status": "completed"})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = "".join(p["text"] for p in _text_of(output, f"{param}.output"))
            items.append({"type": "function_call_output", "id": _item_id(item, param, "fco"),
                          "call_id": _string(item, "call_id", param), "output": output, "status": "completed"})
        else:
            what = f"items of type {kind!r} are" if isinstance(kind, str) else "an item without a type is"
            raise InvalidRequestError(f"{param}: {what} not supported; send messages, function_call and "
                                      "function_call_output items", param=f"{param}.type")
    return items


def chat_messages(instructions: str | None, items: list[dict]) -> list[ChatMessage]:
    """The conversation as chat turns: the instructions as the system message, messages as they are, a run
    of function_call items as one assistant turn with tool_calls, each output as a tool turn."""
    turns = [ChatMessage(role="system", content=instructions)] if instructions else []
    for item in items:
        if item["type"] == "message":
            turns.append(ChatMessage(role=item["role"], content="".join(p["text"] for p in item["content"])))
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if turns and turns[-1].role == "assistant" and turns[-1].tool_calls and not turns[-1].content:
                turns[-1].tool_calls.append(call)
            else:
                turns.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        else:
            turns.append(ChatMessage(role="tool", content=item["output"], tool_call_id=item["call_id"]))
    return turns


# -- tools and text.format ---------------------------------------------------------------------------


def plan_of(body: ResponsesRequest) -> ToolPlan | None:
    """Function tools and tool_choice as the chat path's ToolPlan (None: no tools)."""
    chat_tools = []
    for i, tool in enumerate(body.tools or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            what = f"{kind!r} tools are" if isinstance(kind, str) else "a tool without a type is"
            raise InvalidRequestError(f"tools[{i}]: {what} not supported (web search, file search, computer use and "
                                      "hosted tools run at OpenAI); this server calls function tools: {\"type\": "
                                      "\"function\", \"name\": ..., \"parameters\": {...}}", param=f"tools.{i}")
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        chat_tools.append({"type": "function", "function": function})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise InvalidRequestError("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                                      "\"name\": ...}", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return tool_plan({"tools": chat_tools, "tool_choice": choice, "parallel_tool_calls": body.parallel_tool_calls})


def text_grammar(text: dict | None) -> StructuredOutputsParams | None:
    """``text.format`` as a grammar: json_schema or json_object (text: free)."""
    text = text or {}
    if text.get("verbosity") not in (None, "medium"):
        raise InvalidRequestError("text.verbosity is not supported; leave it unset", param="text.verbosity")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, param="text.format")
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequestError("text.format.schema must be a JSON schema (an object)", param="text.format.schema")
        return StructuredOutputsParams(json=schema, param="text.format.schema")
    raise InvalidRequestError("text.format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": "
                              "\"json_schema\", \"name\": ..., \"schema\": {...}}", param="text.format")


def grammar_of(body: ResponsesRequest, plan: ToolPlan | None) -> StructuredOutputsParams | None:
    """The one grammar of the request. A tool_choice that forces calls (a named function, required) makes
    the output calls, so it constrains this turn; text.format constrains a text answer (OpenAI's reading:
    an agent with an output type forces a call first, then answers in that format). With tool_choice auto
    the reply is either: calls of this request's tools, or an answer in text.format (an agent with an output
    type and tools, as the Agents SDK sends it by default)."""
    text, tools = text_grammar(body.text), plan.grammar() if plan else None
    if tools is None and text is not None and plan is not None and plan.choice == "auto":
        answer = text.json if text.json is not None else {"type": "object"}  # json_object: any object
        if isinstance(answer, str):
            answer = json.loads(answer)
        (calls, answer), defs = hoist_defs([plan.calls_schema(), answer])
        return StructuredOutputsParams(json={"anyOf": [calls, answer], **defs}, param="text.format")
    return tools or text
