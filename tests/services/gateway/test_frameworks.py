"""Agent frameworks as their users run them, against /v1/responses on the real model: the official packages
(openai-agents, ...), no hand-written requests, so the shapes they really send are the ones tested."""

from __future__ import annotations

import asyncio

import pytest

from tests.services.gateway.test_gateway_agent import FIRST_START_KEYS, stack  # noqa: F401  (the module's stack: inference, tools, gateways)

agents = pytest.importorskip("agents", reason="openai-agents is in the test extra")
from openai import AsyncOpenAI  # noqa: E402

pytestmark = pytest.mark.model


def sdk_client(stack) -> AsyncOpenAI:
    """The client a framework user makes: the gateway's URL and the key its first start wrote."""
    url = stack["open"]
    return AsyncOpenAI(base_url=f"{url}/v1", api_key=FIRST_START_KEYS[url], max_retries=0)


def test_the_openai_agents_sdk_runs_a_function_tool_through_the_responses_api(stack):  # noqa: F811
    """The SDK runs statelessly: after the function call it re-sends every item, no previous_response_id."""
    readings = []

    @agents.function_tool
    def read_thermometer(room: str) -> str:
        """Reads the thermometer in a room of the house, in degrees Celsius."""
        readings.append(room)
        return '{"celsius": 21.5}'

    client = sdk_client(stack)
    agent = agents.Agent(name="house", tools=[read_thermometer],
                         model=agents.OpenAIResponsesModel(model="default", openai_client=client))
    result = asyncio.run(agents.Runner.run(agent, "How warm is it in the kitchen right now?",
                                           run_config=agents.RunConfig(tracing_disabled=True)))
    assert readings == ["kitchen"]
    assert "21.5" in result.final_output, result.final_output


def test_the_openai_agents_sdk_streams_a_function_tool_run(stack):  # noqa: F811
    @agents.function_tool
    def read_thermometer(room: str) -> str:
        """Reads the thermometer in a room of the house, in degrees Celsius."""
        return '{"celsius": 19}'

    client = sdk_client(stack)
    agent = agents.Agent(name="house", tools=[read_thermometer],
                         model=agents.OpenAIResponsesModel(model="default", openai_client=client))

    async def run():
        result = agents.Runner.run_streamed(agent, "How warm is it in the hall?",
                                            run_config=agents.RunConfig(tracing_disabled=True))
        async for _ in result.stream_events():
            pass
        return result.final_output

    assert "19" in str(asyncio.run(run()))
