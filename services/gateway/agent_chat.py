"""The agent's step policy for chat-completions tool loops: ``model: "<name>:agent"`` or ``X-Agent-Policy: on``.

Most agent frameworks run their own tool loop over ``/v1/chat/completions``: each request carries the whole
history and gets one assistant turn back. Given the raw model, a small model repeats calls, calls tools it does not
need and ends with an empty or runaway message. Opted in, a request is answered by the agent loop
(``services.agent.loop.Run``) with the step policy ``/v1/responses`` uses: the history becomes the loop's
conversation (read as a re-sent ``/v1/responses`` item list is), the request's tools its caller tools, and the
loop runs until it hands out a call of the client's or answers. So a call written in any shape comes back as a
``tool_calls`` entry, a repeat of a call the history holds is answered from its result without the client, a
candidate answer the policy sends back never reaches the client, and the final message is never empty.

Only the client's tools are offered (it runs every call; the gateway's configured tools would be calls it never
sees). A completion hands out every call of the client's tools the step made. With ``X-Session-Id`` the run keeps that session's KV warm for
the next request; without, its session is dropped when the completion is made.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Header
from pydantic import ValidationError
from sse_starlette import EventSourceResponse, ServerSentEvent

from services.agent.loop import Steering
from services.gateway.access import Gateway
from services.gateway.disconnect import unless_disconnected
from services.gateway.errors import bad_request, from_service_error
from services.gateway.replies import ChatShape
from services.gateway.responses import AgentRun, collect, conversation_of, drop_session, instructions_of
from services.gateway.schemas import (ChatCompletionRequest, ChatMessage, FunctionCallInput, FunctionCallOutput,
                                      FunctionTool, InputMessage)
from shared import protocol as wire
from shared.client import ServiceError

#: A model name with this suffix opts a chat-completions request into the agent's step policy.
AGENT_SUFFIX = ":agent"

AgentHeader = Annotated[str | None, Header(
    alias="X-Agent-Policy", pattern="^(on|off)$",
    description="on: answer with the agent's step policy (as a model name ending in :agent does)")]


def wants_agent(req: ChatCompletionRequest, header: str | None) -> bool:
    return header == "on" or (req.model or "").endswith(AGENT_SUFFIX)


async def agent_completion(http, gw: Gateway, req: ChatCompletionRequest, owner: str | None,
                           session_id: str | None, priority: str | None):
    """The chat completion the agent loop makes of ``req``'s history: a call of the client's, or the answer."""
    if req.response_format is not None and req.response_format.type != "text":
        raise bad_request("response_format cannot be combined with the agent's step policy", "response_format")
    if req.n not in (None, 1):
        raise bad_request("n must be 1 with the agent's step policy", "n")
    model = (req.model or "").removesuffix(AGENT_SUFFIX) or None
    try:
        items = _items(req.messages)
    except ValidationError as err:  # a message the Responses API's items cannot hold (a tool reply with no id)
        raise bad_request(f"a message cannot be read as a conversation turn: {err.errors()[0]['msg']}",
                          "messages") from None
    goal, earlier = conversation_of(items)
    tools = [FunctionTool(type="function", **t.function.model_dump()) for t in req.tools or []]
    run = AgentRun(gw, owner, model if model != "default" else None, goal, tools, instructions_of(None, items),
                   earlier, session_id, store=False, steering=_steering(req), priority=priority,
                   configured_tools=False)
    shape = ChatShape(req.model or run.model, bool(req.stream_options and req.stream_options.include_usage))
    try:
        await unless_disconnected(http, collect(run.items()))
    finally:
        if session_id is None:
            drop_session(gw, owner, run.loop.trace.session_id)
    result = _result(run)
    if not req.stream:
        return shape.result(result)
    chunks = [*shape.opening(), *shape.closing(result)]
    return EventSourceResponse(_replay(chunks), ping=gw.config.gateway.sse_ping_s, sep="\n")


def _items(messages: list[ChatMessage]) -> list:
    """A chat history as the Responses API's input items (system text, user and assistant messages, each call
    and each tool's output), so both APIs read a conversation one way."""
    items: list = []
    for m in messages:
        text = m.content if isinstance(m.content, str) or m.content is None else "".join(p.text for p in m.content)
        if m.role == "tool":
            items.append(FunctionCallOutput(type="function_call_output", call_id=m.tool_call_id or "", output=text or ""))
            continue
        if text:
            items.append(InputMessage(role="system" if m.role == "developer" else m.role, content=text))
        items += [FunctionCallInput(type="function_call", call_id=c.id, name=c.function.name,
                                    arguments=c.function.arguments) for c in m.tool_calls or []]
    return items


def _steering(req: ChatCompletionRequest) -> Steering:
    choice: str | dict = (req.tool_choice or "auto" if isinstance(req.tool_choice, str) or req.tool_choice is None
                          else {"type": "function", "function": {"name": req.tool_choice.function.name}})
    return Steering(req.temperature, req.top_p, req.max_completion_tokens or req.max_tokens, choice,
                    req.parallel_tool_calls is not False)


def _result(run: AgentRun) -> wire.ChatResult:
    """The run's outcome as one chat turn: the calls it hands out, or its answer; its tokens over all its steps."""
    trace = run.loop.trace
    if trace.stopped == "error" and not run.waiting:
        code, _, why = (trace.error or "internal: the run failed").partition(": ")
        raise from_service_error(ServiceError(code, why))
    stats = wire.Stats(prompt_tokens=trace.prompt_tokens + trace.cached_tokens, cached_tokens=trace.cached_tokens,
                       prefill_tokens=trace.prompt_tokens, completion_tokens=trace.output_tokens,
                       total_s=trace.elapsed_s, model=run.model)
    if run.waiting:
        calls = [wire.ToolCall(id=call.call_id, type="function",
                               function=wire.CalledFunction(name=call.name, arguments=call.arguments))
                 for call in run.waiting]
        return wire.ChatResult(message=wire.AssistantMessage(content=None, tool_calls=calls),
                               finish_reason="tool_calls", stats=stats)
    answer = run.answer_text() or "I could not finish the task."  # never an empty final message
    return wire.ChatResult(message=wire.AssistantMessage(content=answer), stats=stats,
                           finish_reason="length" if trace.stopped == "max_output_tokens" else "stop")


async def _replay(chunks):
    for chunk in chunks:
        yield ServerSentEvent(data=chunk.model_dump_json(exclude_none=True))
    yield ServerSentEvent(data="[DONE]")
