"""The agent bench through agent frameworks, as their users run them against the gateway: the OpenAI Agents SDK,
LangChain's ``create_agent`` (LangGraph underneath) on ``ChatOpenAI`` and pydantic-ai, each on ``/v1/responses``
(model ``default``) and on ``/v1/chat/completions`` with the agent alias (model ``default:agent``).

Every framework gets the stack's tools (calculator, file_reader, memory_search, the MCP server's) as its own
function tools, run through the bench's tool service (``ToolBox``), so the gateway sees caller tools only, as it
would from any framework. No system prompt is sent: a framework user does not know Magnitude's.

Needs the ``test`` extra (the pinned openai-agents, langchain, langchain-openai and pydantic-ai-slim).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from scripts.bench.agent.runners import Outcome, ToolBox
from scripts.bench.agent.tasks import Task

#: system name -> (framework, API): the runner below for each
FRAMEWORK_SYSTEMS = {
    "sdk": ("agents_sdk", "responses"), "sdk-chat": ("agents_sdk", "chat"),
    "langchain": ("langchain", "responses"), "langchain-chat": ("langchain", "chat"),
    "pydantic-ai": ("pydantic_ai", "responses"), "pydantic-ai-chat": ("pydantic_ai", "chat"),
}


def model_name(api: str) -> str:
    """The model name a framework user sets: the agent alias on chat completions (docs/gateway.md)."""
    return "default:agent" if api == "chat" else "default"


def agents_sdk(url: str, key: str, api: str, box: ToolBox, task: Task, max_steps: int) -> tuple[str, int]:
    """OpenAI Agents SDK: ``Runner.run`` with the tools as ``FunctionTool``s; (final output, model turns)."""
    import agents
    from openai import AsyncOpenAI

    def function_tool(spec: dict) -> agents.FunctionTool:
        async def invoke(_context, arguments: str) -> str:  # the blocking client runs a loop of its own
            return await asyncio.to_thread(box.call, spec["name"], arguments)
        return agents.FunctionTool(name=spec["name"], description=spec["description"],
                                   params_json_schema=spec["parameters"], on_invoke_tool=invoke,
                                   strict_json_schema=False)

    async def run() -> agents.RunResult:
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=600) as client:
            model_class = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
            agent = agents.Agent(name="bench", tools=[function_tool(s) for s in box.specs],
                                 model=model_class(model=model_name(api), openai_client=client))
            return await agents.Runner.run(agent, task.goal, max_turns=max_steps,
                                           run_config=agents.RunConfig(tracing_disabled=True))

    result = asyncio.run(run())
    return str(result.final_output), len(result.raw_responses)


def langchain(url: str, key: str, api: str, box: ToolBox, task: Task, max_steps: int) -> tuple[str, int]:
    """LangChain's ``create_agent`` on ``ChatOpenAI`` (``use_responses_api`` for /v1/responses)."""
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage
    from langchain_core.tools import StructuredTool
    from langchain_openai import ChatOpenAI

    def structured_tool(spec: dict) -> StructuredTool:
        return StructuredTool.from_function(func=lambda **args: box.call(spec["name"], args), name=spec["name"],
                                            description=spec["description"], args_schema=spec["parameters"])

    model = ChatOpenAI(model=model_name(api), base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=600,
                       use_responses_api=api == "responses")
    agent = create_agent(model, tools=[structured_tool(s) for s in box.specs])
    messages = agent.invoke({"messages": [("user", task.goal)]}, {"recursion_limit": 2 * max_steps + 1})["messages"]
    return messages[-1].text, sum(isinstance(m, AIMessage) for m in messages)


def pydantic_ai(url: str, key: str, api: str, box: ToolBox, task: Task, max_steps: int) -> tuple[str, int]:
    """pydantic-ai's ``Agent`` on its OpenAI Responses or Chat model."""
    import pydantic_ai
    from pydantic_ai.messages import ModelResponse
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    def schema_tool(spec: dict) -> pydantic_ai.Tool:
        return pydantic_ai.Tool.from_schema(lambda **args: box.call(spec["name"], args), name=spec["name"],
                                            description=spec["description"], json_schema=spec["parameters"])

    provider = OpenAIProvider(base_url=f"{url}/v1", api_key=key)
    model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatModel
    agent = pydantic_ai.Agent(model_class(model_name(api), provider=provider),
                              tools=[schema_tool(s) for s in box.specs])
    result = agent.run_sync(task.goal, usage_limits=UsageLimits(request_limit=max_steps))
    return result.output, sum(isinstance(m, ModelResponse) for m in result.all_messages())


RUNNERS: dict[str, Callable[..., tuple[str, int]]] = {"agents_sdk": agents_sdk, "langchain": langchain,
                                                       "pydantic_ai": pydantic_ai}


def framework_task(system: str, url: str, key: str, box: ToolBox, task: Task, max_steps: int) -> Outcome:
    """One task through one framework; a framework's own error (turns exceeded, a refused request) fails the
    task with its message, and the bench goes on."""
    framework, api = FRAMEWORK_SYSTEMS[system]
    box.start_task()
    t0, answer, turns, error = time.monotonic(), None, 0, None
    try:
        answer, turns = RUNNERS[framework](url, key, api, box, task, max_steps)
    except Exception as err:  # noqa: BLE001  (every framework raises its own classes)
        error = f"{type(err).__name__}: {err}"[:300]
    return Outcome(task, answer, turns, box.calls, box.valid, time.monotonic() - t0, error, box.log)
