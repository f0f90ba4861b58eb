"""Agent frameworks as their users run them, against /v1/responses on the real model: the official packages
(openai-agents, LangChain's create_agent on langchain-openai, pydantic-ai), no hand-written requests, so the shapes
they really send are the ones tested."""

from __future__ import annotations

import asyncio

import agents  # the test extra installs every framework here: a missing one fails, it never skips
import pydantic_ai
import pytest
from langchain import agents as langchain_agents
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI
from pydantic_ai.models.openai import OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import UsageLimits

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


def test_a_langchain_agent_on_chat_openai_runs_a_function_tool_through_the_responses_api(stack):  # noqa: F811
    """LangChain's create_agent (LangGraph underneath) on ChatOpenAI(use_responses_api=True): the tool loop that
    langchain-openai users point at any OpenAI-compatible server with base_url."""
    readings = []

    @tool
    def room_temperature(room: str) -> str:
        """Reads the thermometer in a room of the house, in degrees Celsius."""
        readings.append(room)
        return '{"celsius": 23.5}'

    url = stack["open"]
    model = ChatOpenAI(model="default", base_url=f"{url}/v1", api_key=FIRST_START_KEYS[url], max_retries=0,
                       use_responses_api=True)
    agent = langchain_agents.create_agent(model, tools=[room_temperature])
    result = agent.invoke({"messages": [("user", "How warm is it in the study right now?")]},
                          {"recursion_limit": 6})
    answer = result["messages"][-1].text
    assert readings == ["study"]
    assert "23.5" in answer, answer


def test_a_pydantic_ai_agent_runs_a_function_tool_through_the_responses_api(stack):  # noqa: F811
    """pydantic-ai's OpenAIResponsesModel over the stack's client: its tool loop re-sends the history each step."""
    readings = []
    model = OpenAIResponsesModel("default", provider=OpenAIProvider(openai_client=sdk_client(stack)))
    agent = pydantic_ai.Agent(model)

    @agent.tool_plain
    def room_temperature(room: str) -> str:
        """Reads the thermometer in a room of the house, in degrees Celsius."""
        readings.append(room)
        return '{"celsius": 18.5}'

    result = agent.run_sync("How warm is it in the cellar right now?", usage_limits=UsageLimits(request_limit=4))
    assert readings == ["cellar"]
    assert "18.5" in result.output, result.output


# --- chat-completions tool loops, with the agent's step policy (model "<name>:agent") -------------------------
FLOOR = "The bathroom floor has 37 rows of 26 tiles each.\n"


def test_the_openai_agents_sdk_chat_completions_loop_finishes_a_multi_step_task_with_the_agent_alias(stack):  # noqa: F811
    """The SDK's own tool loop over /v1/chat/completions: read a file, compute, answer; every call is the SDK's."""
    calls = []

    @agents.function_tool
    def read_file(path: str) -> str:
        """Reads a text file of the house's notes and returns its text."""
        calls.append(("read_file", path))
        return FLOOR if path.endswith("floor.txt") else "no such file"

    @agents.function_tool
    def calculate(expression: str) -> str:
        """Evaluates an arithmetic expression such as 12 * 7 and returns the result."""
        calls.append(("calculate", expression))
        return str(eval(expression, {"__builtins__": {}}))  # the test's own tool: digits and operators only

    agent = agents.Agent(name="house", tools=[read_file, calculate], model=agents.OpenAIChatCompletionsModel(
        model="default:agent", openai_client=sdk_client(stack)))
    result = asyncio.run(agents.Runner.run(agent, "floor.txt says how the bathroom floor is tiled. Compute how "
                                                  "many tiles it has.", max_turns=8,
                                           run_config=agents.RunConfig(tracing_disabled=True)))
    assert calls[0] == ("read_file", "floor.txt") and "962" in result.final_output, (calls, result.final_output)


def test_a_langchain_chat_completions_agent_finishes_a_multi_step_task_with_the_agent_alias(stack):  # noqa: F811
    calls = []

    @tool
    def read_file(path: str) -> str:
        """Reads a text file of the house's notes and returns its text."""
        calls.append(("read_file", path))
        return FLOOR if path.endswith("floor.txt") else "no such file"

    @tool
    def calculate(expression: str) -> str:
        """Evaluates an arithmetic expression such as 12 * 7 and returns the result."""
        calls.append(("calculate", expression))
        return str(eval(expression, {"__builtins__": {}}))

    url = stack["open"]
    model = ChatOpenAI(model="default:agent", base_url=f"{url}/v1", api_key=FIRST_START_KEYS[url], max_retries=0)
    agent = langchain_agents.create_agent(model, tools=[read_file, calculate])
    result = agent.invoke({"messages": [("user", "floor.txt says how the bathroom floor is tiled. Compute how "
                                                 "many tiles it has.")]}, {"recursion_limit": 12})
    answer = result["messages"][-1].text
    assert calls[0] == ("read_file", "floor.txt") and "962" in answer, (calls, answer)
