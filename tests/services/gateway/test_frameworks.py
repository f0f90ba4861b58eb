"""Agent frameworks as their users run them, on the real model: the official packages, no hand-written requests,
so the shapes they really send are the ones tested. Most of it is in test_framework_pages.py, which runs the
programs of docs/frameworks/*.md (the Agents SDK, LangChain's create_agent, pydantic-ai; each through
/v1/responses and through /v1/chat/completions with "default:agent"). Here: what those pages leave out, the Agents
SDK's plain ``Runner.run`` on OpenAIResponsesModel (its page streams with ``run_streamed``, and ``run_sync`` goes
through OpenAIChatCompletionsModel)."""

from __future__ import annotations

import asyncio

import agents  # the test extra installs it: a missing one fails, it never skips
import pytest
from openai import AsyncOpenAI

from tests.services.gateway.test_gateway_agent import FIRST_START_KEYS, stack  # noqa: F401  (the module's stack: inference, tools, gateways)

pytestmark = pytest.mark.model


def sdk_client(stack) -> AsyncOpenAI:  # noqa: F811
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
