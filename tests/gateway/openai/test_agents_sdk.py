"""The OpenAI Agents SDK (``openai-agents``) against a served stack, offline, tracing off: an agent with one
function tool calls it through ``/v1/responses`` (``tool_choice="required"``), gets its result back as a
``function_call_output``, and answers in its output type (a JSON schema); streamed the same way."""

from __future__ import annotations

import asyncio
from typing import Literal

import agents  # openai-agents, in the test extra
import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel

from tests.gateway.openai.http_helpers import CLIENT_TIMEOUT, KEY, base_url


class Forecast(BaseModel):
    sky: Literal["sunny", "cloudy", "rainy"]
    warm: bool


@pytest.fixture(scope="module")
def sdk(http_stack, model):
    agents.set_tracing_disabled(True)  # offline: nothing is exported to OpenAI
    calls: list[str] = []

    # a random-weight model given the choice (tool_choice auto with an output type: a call or a Forecast) may
    # call forever: once called, the tool is switched off for the run (the SDK's is_enabled), so the next turn
    # answers in the output type
    @agents.function_tool(is_enabled=lambda ctx, _agent: not ctx.context["called"])
    def get_weather(ctx: agents.RunContextWrapper[dict], city: Literal["Paris", "Oslo"]) -> str:
        """Weather."""
        ctx.context["called"] = True
        calls.append(city)
        return f"sunny in {city}"

    def agent():  # a client per event loop (asyncio.run): its connections belong to the loop
        client = AsyncOpenAI(base_url=f"{base_url(http_stack)}/v1", api_key=KEY, timeout=CLIENT_TIMEOUT,
                             max_retries=0)
        return agents.Agent(
            name="forecaster", instructions="Be brief.", tools=[get_weather], output_type=Forecast,
            model=agents.OpenAIResponsesModel(model=model, openai_client=client),
            # a random-weight model would neither choose to call nor ever end its text: the first turn must call
            # (one call: parallel_tool_calls false closes the array), and the answer (the SDK resets tool_choice to
            # auto after a call; the tool is off by then) is a Forecast, whose JSON schema (text.format) ends it
            model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                                max_tokens=70))
    return agent, calls


def _tool_outputs(result) -> list[str]:
    return [item.output for item in result.new_items if item.type == "tool_call_output_item"]


def test_an_agent_calls_its_tool_and_answers(sdk):
    agent, calls = sdk
    calls.clear()
    result = asyncio.run(agents.Runner.run(agent(), "Paris?", max_turns=4, context={"called": False}))
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert calls and calls[0] in ("Paris", "Oslo") and _tool_outputs(result)[0] == f"sunny in {calls[0]}"
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, Forecast)
    assert len(result.raw_responses) == 2 and all(r.response_id.startswith("resp_") for r in result.raw_responses)


def test_a_streamed_agent_run_gives_the_same_result(sdk):
    agent, calls = sdk

    async def run():
        plain = await agents.Runner.run(agent(), "Paris?", max_turns=4, context={"called": False})
        streamed = agents.Runner.run_streamed(agent(), "Paris?", max_turns=4, context={"called": False})
        kinds = [event.type async for event in streamed.stream_events()]
        return plain, streamed, kinds

    plain, streamed, kinds = asyncio.run(run())
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    assert streamed.final_output == plain.final_output  # greedy: the same calls and the same answer
    assert _tool_outputs(streamed) == _tool_outputs(plain)
