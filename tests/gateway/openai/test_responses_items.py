"""Responses input items as chat turns, tools as the chat path's ToolPlan, text.format as a grammar
(``gateway.openai.responses_items``), without a server."""

from __future__ import annotations

import pytest

from gateway.openai.responses_items import (
    ResponsesRequest, canonical_items, chat_messages, grammar_of, plan_of, text_grammar,
)
from specdec.errors import InvalidRequestError

TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}


def test_a_string_is_one_user_message():
    (item,) = canonical_items("hello")
    assert item["type"] == "message" and item["role"] == "user" and item["id"].startswith("msg_")
    assert item["content"] == [{"type": "input_text", "text": "hello"}]


def test_items_become_the_chat_turns_chat_completions_reads():
    items = canonical_items([
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"x\": 1}", "id": "fc_1"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{\"x\": 2}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "one"}]},
        {"type": "function_call_output", "call_id": "c2", "output": "two"},
        {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
    ])
    assert items[1]["id"] == "fc_1" and items[2]["id"].startswith("fc_")  # ids kept, or made
    turns = chat_messages("Be kind.", items)
    assert [(t.role, t.content) for t in turns] == [("system", "Be kind."), ("user", "ab"), ("assistant", None),
                                                    ("tool", "one"), ("tool", "two"), ("assistant", "no")]
    calls = turns[2].tool_calls  # a run of calls is one assistant turn, as chat sends them
    assert [(c["id"], c["function"]["arguments"]) for c in calls] == [("c1", "{\"x\": 1}"), ("c2", "{\"x\": 2}")]
    assert (turns[3].tool_call_id, turns[4].tool_call_id) == ("c1", "c2")
    assert chat_messages(None, items)[0].role == "user"  # no instructions: no system turn


@pytest.mark.parametrize("raw, param", [
    ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "input.0.content.0"),
    ([{"role": "user", "content": [{"type": "input_text"}]}], "input.0.content.0.text"),
    ([{"role": "user", "content": 5}], "input.0.content"),
    ([{"type": "function_call", "call_id": "c", "name": "", "arguments": "{}"}], "input.0.name"),
    ([{"type": "function_call_output", "call_id": "c", "output": 3}], "input.0.output"),
    ([{"type": "reasoning", "summary": []}], "input.0.type"),
    ([{"content": "no role, no type"}], "input.0.type"),
    (["text"], "input.0"),
])
def test_bad_items_name_their_field(raw, param):
    with pytest.raises(InvalidRequestError) as info:
        canonical_items(raw)
    assert info.value.param == param


def test_function_tools_map_onto_the_chat_plan():
    plan = plan_of(ResponsesRequest(input="x", tools=[TOOL], tool_choice={"type": "function", "name": "f"}))
    assert plan.choice == "named" and plan.named == "f" and plan.tools[0]["function"]["name"] == "f"
    assert plan_of(ResponsesRequest(input="x")) is None
    plan = plan_of(ResponsesRequest(input="x", tools=[TOOL], tool_choice="required", parallel_tool_calls=False))
    assert plan.grammar().json["maxItems"] == 1  # one call per reply
    (call,) = plan.calls('[{"name": "f", "arguments": {"x": 1}}, {"name": "f", "arguments": {"x": 2}}]')
    assert call["function"] == {"name": "f", "arguments": "{\"x\": 1}"}  # the first of the reply's calls
    with pytest.raises(InvalidRequestError) as info:
        plan_of(ResponsesRequest(input="x", tools=[{"type": "code_interpreter"}]))
    assert info.value.param == "tools.0" and "not supported" in str(info.value)


def test_text_format_and_a_forcing_tool_choice():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert text_grammar({"format": {"type": "json_schema", "name": "s", "schema": schema}}).json == schema
    assert text_grammar({"format": {"type": "json_object"}}).json_object
    assert text_grammar({"format": {"type": "text"}}) is None and text_grammar(None) is None
    body = ResponsesRequest(input="x", tools=[TOOL], tool_choice="required",
                            text={"format": {"type": "json_schema", "name": "s", "schema": schema}})
    assert grammar_of(body, plan_of(body)).json["type"] == "array"  # the forced call constrains this turn


def _accepts(spec, text: str) -> bool:
    import json

    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(xgrammar.Grammar.from_json_schema(json.dumps(spec.json)), text)


def test_auto_tools_with_a_text_format_allow_a_call_or_an_answer_in_the_format():
    """The Agents SDK's default for an agent with tools and an output type: tool_choice auto and text.format.
    The reply may be calls of the request's tools or an answer in the format, nothing else; ``$defs`` (as
    pydantic writes nested models) resolve from the combined schema's root."""
    answer = {"type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}}, "required": ["item"],
              "additionalProperties": False,
              "$defs": {"Item": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                                 "additionalProperties": False}}}
    tool = {**TOOL, "parameters": {"type": "object", "properties": {"c": {"$ref": "#/$defs/City"}}, "required": ["c"],
                                   "$defs": {"City": {"enum": ["Paris", "Oslo"]}}}}
    body = ResponsesRequest(input="x", tools=[tool], text={"format": {"type": "json_schema", "name": "s",
                                                                      "schema": answer}})
    plan = plan_of(body)
    spec = grammar_of(body, plan)
    assert spec.param == "text.format" and set(spec.json["$defs"]) == {"Item", "City"}
    assert _accepts(spec, '{"item": {"n": 3}}')  # the answer
    assert _accepts(spec, '[{"name": "f", "parameters": {"c": "Oslo"}}]')  # a call
    for wrong in ('{"item": {"n": "three"}}', '[{"name": "g", "parameters": {"c": "Oslo"}}]',
                  '[{"name": "f", "parameters": {"c": "Rome"}}]', '"free text"'):
        assert not _accepts(spec, wrong), wrong
    (call,) = plan.calls('[{"name": "f", "parameters": {"c": "Oslo"}}]')
    assert call["function"] == {"name": "f", "arguments": '{"c": "Oslo"}'}
    assert plan.calls('{"item": {"n": 3}}') is None  # an answer, not a call
    body = ResponsesRequest(input="x", tools=[TOOL], text={"format": {"type": "json_object"}})
    spec = grammar_of(body, plan_of(body))
    assert _accepts(spec, '{"anything": 1}') and _accepts(spec, '[{"name": "f", "parameters": {"x": 1}}]')
    assert not _accepts(spec, '[1, 2]')
    body = ResponsesRequest(input="x", tools=[TOOL], tool_choice="none", text={"format": {"type": "json_object"}})
    assert grammar_of(body, plan_of(body)).json_object  # no calls allowed: the format alone


def test_one_name_defined_twice_differently_is_refused():
    a = {**TOOL, "name": "a", "parameters": {"type": "object", "$defs": {"X": {"type": "integer"}}}}
    b = {**TOOL, "name": "b", "parameters": {"type": "object", "$defs": {"X": {"type": "string"}}}}
    with pytest.raises(InvalidRequestError, match="X differently"):
        plan_of(ResponsesRequest(input="x", tools=[a, b], tool_choice="required")).grammar()


def test_item_ids_are_strings():
    with pytest.raises(InvalidRequestError) as info:
        canonical_items([{"role": "user", "content": "x", "id": 7}])
    assert info.value.param == "input.0.id"
    assert canonical_items([{"role": "user", "content": "x", "id": ""}])[0]["id"].startswith("msg_")
