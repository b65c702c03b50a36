"""Structured outputs and tool calling, served (``specdec serve``, tiny models, a draft model at k=3) through the
official ``openai`` client, raw HTTP and gRPC: outputs equal constrained target-only decoding (greedy), parsed
objects validate, tool calls come back (and stream) as OpenAI sends them, and bad grammars are 400s."""

from __future__ import annotations

import json
import re
from typing import Literal

import grpc
import openai
import pytest
from pydantic import BaseModel, Field

from specdec import SamplingParams
from specdec.structured import StructuredOutputsParams
from specdec.v1 import common_pb2, generation_service_pb2 as gen_pb, generation_service_pb2_grpc
from tests.gateway.openai.http_helpers import HOST, KEY, PROMPTS, assert_error_body

SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["colour", "size"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer",
                                                                                            "minimum": 1, "maximum": 7}},
                                                "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
CHAT = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


class Item(BaseModel):
    colour: Literal["red", "green", "blue"]
    size: int = Field(ge=0, le=99)
    ok: bool


@pytest.mark.parametrize("extra, spec", [
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
    ({"structured_outputs": {"regex": "[a-f]{3}-[0-9]{2}"}}, StructuredOutputsParams(regex="[a-f]{3}-[0-9]{2}")),
    ({"guided_choice": ["yes", "no", "perhaps"]}, StructuredOutputsParams(choice=["yes", "no", "perhaps"])),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"guided_grammar": 'root ::= "x" [0-9]+ "y"'}, StructuredOutputsParams(grammar='root ::= "x" [0-9]+ "y"')),
], ids=["json", "regex", "guided_choice", "response_format", "grammar"])
def test_greedy_completion_equals_constrained_target_alone(client, model, target_llm, extra, spec):
    for prompt in PROMPTS:
        out = client.completions.create(model=model, prompt=prompt, max_tokens=30, temperature=0, extra_body=extra)
        want = target_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30,
                                                          structured_outputs=spec))[0].outputs[0]
        assert out.choices[0].text == want.text and out.choices[0].finish_reason == want.finish_reason


def test_min_p_and_allowed_token_ids_equal_target_alone(client, model, target_llm):
    ids = list(range(300, 700))
    out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=0,
                                    extra_body={"min_p": 0.2, "allowed_token_ids": ids, "ignore_eos": True})
    want = target_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, min_p=0.2,
                                                          allowed_token_ids=ids, ignore_eos=True))[0].outputs[0]
    assert out.choices[0].text == want.text


@pytest.mark.heavy
def test_parse_with_a_pydantic_model_validates_every_time(client, model):
    """The client's ``parse`` (strict JSON schema from a pydantic model), sampled with 10 seeds: every reply is a
    valid object."""
    for seed in range(10):
        out = client.beta.chat.completions.parse(model=model, messages=CHAT, response_format=Item, max_tokens=200,
                                                 temperature=1.0, seed=seed)
        parsed = out.choices[0].message.parsed
        assert isinstance(parsed, Item), out.choices[0]


def test_json_object_mode_gives_json(client, model):
    out = client.chat.completions.create(model=model, messages=CHAT, max_tokens=60, temperature=0,
                                         response_format={"type": "json_object"},
                                         extra_body={"structured_outputs": None})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:
        assert out.choices[0].message.content.lstrip().startswith("{")


def test_unfinished_structure_reports_length(client, model):
    out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=3, temperature=0,
                                    extra_body={"structured_outputs": {"json": SCHEMA}})
    assert out.choices[0].finish_reason == "length" and out.choices[0].text.lstrip().startswith("{")


def test_named_tool_choice_returns_the_call(client, model):
    out = client.chat.completions.create(model=model, messages=CHAT, tools=[WEATHER, TIME], max_tokens=60,
                                         temperature=0, tool_choice={"type": "function",
                                                                     "function": {"name": "get_weather"}})
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7


def test_named_tool_choice_streams_name_then_arguments(client, model):
    stream = client.chat.completions.create(model=model, messages=CHAT, tools=[WEATHER], max_tokens=60,
                                            temperature=0, stream=True,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    assert calls[0].function.name == "get_weather" and calls[0].id and calls[0].function.arguments == ""
    assert all(c.index == 0 and c.id is None for c in calls[1:]) and len(calls) > 2
    args = json.loads("".join(c.function.arguments for c in calls))
    assert args["city"] in ("Paris", "Oslo")
    assert deltas[-1].finish_reason == "stop"
    whole = client.chat.completions.create(model=model, messages=CHAT, tools=[WEATHER], max_tokens=60, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(whole.choices[0].message.tool_calls[0].function.arguments) == args


def test_required_tool_choice_calls_one_of_the_tools(client, model):
    for stream in (False, True):
        kwargs = dict(model=model, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER, TIME],
                      max_tokens=70, temperature=0, tool_choice="required")
        if stream:
            deltas = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
            calls = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
            finish = deltas[-1].finish_reason
            names = [c.function.name for c in calls]
            arguments = [c.function.arguments for c in calls]
            content = "".join(d.delta.content or "" for d in deltas)
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            finish = choice.finish_reason
            content = choice.message.content or ""
            names = [c.function.name for c in choice.message.tool_calls or []]
            arguments = [c.function.arguments for c in choice.message.tool_calls or []]
        if finish == "length":  # a random model may not close its array: the held reply comes back as text
            assert not names and re.match(r"\s*\[\s*\{\s*\"name\"", content), content
            continue
        assert finish == "tool_calls" and names and set(names) <= {"get_weather", "get_time"}
        for name, args in zip(names, arguments):
            assert set(json.loads(args)) == ({"city", "days"} if name == "get_weather" else {"zone"})


def test_auto_and_none_answer_in_text_when_the_model_calls_nothing(client, model):
    for choice in ("auto", "none"):
        out = client.chat.completions.create(model=model, messages=CHAT, tools=[WEATHER], max_tokens=8,
                                             temperature=0, tool_choice=choice)
        assert out.choices[0].message.tool_calls is None and out.choices[0].message.content


def test_tool_results_go_back_into_the_conversation(client, model):
    messages = CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, param, words", [
    ({"structured_outputs": {"json": {"type": "objekt"}}}, "structured_outputs.json", "Unsupported type"),
    ({"guided_regex": "a(b"}, "guided_regex.regex", "parenthesis"),
    ({"guided_grammar": "root ::= foo"}, "guided_grammar.grammar", "not defined"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "both constrain"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": [{"type": "function"}]}, "tools.0", "function"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"allowed_token_ids": [10 ** 7]}, "allowed_token_ids", "outside the vocabulary"),
    ({"min_p": 2}, "min_p", None),
    ({"guided_regex": "a+", "min_tokens": 3}, "min_tokens", "cannot be combined"),
])
def test_bad_constraints_are_400_naming_the_field(raw, model, body, param, words):
    r = raw.post("/v1/chat/completions", json={"model": model, "messages": CHAT, "max_tokens": 4, **body})
    err = assert_error_body(r, 400, param=param)
    if words:
        assert words in err["message"], err
    ok = raw.post("/v1/chat/completions", json={"model": model, "messages": CHAT, "max_tokens": 2})
    assert ok.status_code == 200  # and the server goes on serving


def test_metrics_count_structured_requests(raw, client, model):
    def sample(name: str, **labels) -> float:
        # this stack's series: the process-wide registry also holds other gateways' (other model names) when
        # other test files ran in this process first, as they do under xdist
        labels["model_name"] = model
        for line in raw.get("/metrics").text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} {labels} not on /metrics")

    before = sample("specdec_structured_output_requests_total", service="gateway", kind="regex")
    forced = sample("specdec_structured_output_forced_tokens_total", service="gateway")
    client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                              extra_body={"structured_outputs": {"regex": "fixed prefix [a-z]+"}})
    assert sample("specdec_structured_output_requests_total", service="gateway", kind="regex") == before + 1
    assert sample("specdec_structured_output_forced_tokens_total", service="gateway") > forced  # "fixed prefix "
    sample("specdec_structured_output_invalid_draft_tokens_total", service="gateway")


def test_completions_refuse_tools(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"tools": [WEATHER]})
    assert_error_body(info.value.response, 400, param="tools")


def test_grpc_structured_outputs(http_stack, target_llm, tokenizer):
    prompt_ids = tokenizer(PROMPTS[1]).input_ids
    so = gen_pb.StructuredOutputs(regex="[0-9]{2,4}(,[0-9]{2,4})*")
    request = gen_pb.GenerateRequest(prompt_token_ids=prompt_ids, max_tokens=20, structured_outputs=so,
                                     sampling_params=common_pb2.SamplingParams(temperature=0))
    with grpc.insecure_channel(f"{HOST}:{http_stack.gateway.port}") as channel:
        stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
        meta = [("authorization", f"Bearer {KEY}")]
        responses = list(stub.Generate(request, timeout=30, metadata=meta))
        text = "".join(r.text for r in responses)
        want = target_llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(
            temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=so.regex)))[0].outputs[0]
        assert text == want.text and re.fullmatch("[0-9,]*", text)
        bad = gen_pb.GenerateRequest(prompt_token_ids=prompt_ids, max_tokens=4,
                                     structured_outputs=gen_pb.StructuredOutputs(json='{"type": "objekt"}'))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(bad, timeout=30, metadata=meta))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "Unsupported type" in info.value.details()
