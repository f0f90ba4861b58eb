"""POST /v1/chat/completions (the inference ``chat`` message) and /v1/completions (``generate``).

A streamed request waits for the first frame from inference before it answers:
a request the service refuses (unknown model, bad tools, busy) gets its real
status, not a 200 followed by an error event. After that the status is sent,
so a failure mid-stream (inference restarted, the deadline passed) ends the
stream with one ``data: {"error": ...}`` event, which the openai SDK raises as
an APIError. A client that disconnects cancels its stream; the borrowed
client is closed (see ``upstream``).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request

from services.gateway.access import Context, Gateway, Owner, PriorityHeader, Session, SessionHeader, wire_owner
from services.gateway.agent_chat import AgentHeader, agent_completion, wants_agent
from services.gateway.disconnect import unless_disconnected
from services.gateway.errors import ApiError, documented, error_body
from services.gateway.replies import ChatShape, CompletionShape, Shape
from services.gateway.schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    Completion,
    CompletionRequest,
    JsonSchemaResponseFormat,
    Priority,
    ResponseFormat,
    SamplingParams,
    Tool,
)
from shared import protocol as wire
from shared.protocol import DEFAULT_PRIORITY, MAX_SEED, GenerateRequest, Reply

router = APIRouter()

GENERATION_RESPONSES = {200: {"description": "the result; with stream: true, server-sent events: one chunk per "
                                             "data: event, then data: [DONE]"},
                        **documented(400, 401, 404, 413, 429, 501, 503, 504)}
#: What each event of a streamed result carries (app.py writes it into the OpenAPI document).
STREAM_CHUNKS = {"/v1/chat/completions": ChatCompletionChunk, "/v1/completions": Completion}


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses=GENERATION_RESPONSES,
             summary="Chat with the model's own template and native tool calls")
async def chat_completions(req: ChatCompletionRequest, gw: Context, session_id: Session, owner: Owner,
                           http: Request, x_priority: PriorityHeader = None, x_session_id: SessionHeader = None,
                           x_agent_policy: AgentHeader = None):
    if wants_agent(req, x_agent_policy):  # the agent's step policy over the client's tool loop
        return await agent_completion(http, gw, req, owner, x_session_id, req.priority or x_priority)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    body = chat_request(req, owner, req.priority or x_priority)
    return await _generate(http, gw, "chat", body, session_id, ChatShape(req.model, include_usage), req.stream)


@router.post("/v1/completions", response_model=Completion, responses=GENERATION_RESPONSES,
             summary="Complete a raw prompt")
async def completions(req: CompletionRequest, gw: Context, session_id: Session, owner: Owner,
                      http: Request, x_priority: PriorityHeader = None):
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    shape = CompletionShape(req.model, include_usage, echo=req.prompt_text() if req.echo else None)
    body = GenerateRequest(prompt=req.prompt_text(), **sampling(req, req.max_tokens, owner, req.priority or x_priority))
    return await _generate(http, gw, "generate", body, session_id, shape, req.stream)


def sampling(req: SamplingParams, max_tokens: int | None, owner: str | None,
             priority: Priority | None) -> dict[str, Any]:
    """The generate/chat fields both endpoints share, as keywords of the wire body; the priority is the body's,
    else the header's. Without a seed each request draws one, as OpenAI samples differently each time unless told
    otherwise (the engine's own default seed is fixed)."""
    return dict(model=req.model, max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                top_k=req.top_k, stop=req.stop_list(), stream=req.stream,
                seed=req.seed if req.seed is not None else secrets.randbelow(MAX_SEED + 1),
                owner=wire_owner(owner), priority=priority or DEFAULT_PRIORITY)


def chat_request(req: ChatCompletionRequest, owner: str | None, priority: Priority | None) -> wire.ChatRequest:
    """The ``chat`` message, built from the validated HTTP request as it is (the gateway's one validation): a
    long conversation goes in shared memory when the client sees its frame is over the inline limit."""
    return wire.ChatRequest(
        messages=[_message(m) for m in req.messages],
        tools=[_tool(t) for t in req.tools] if req.tools else None,
        tool_choice=(req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None
                     else wire.NamedToolChoice(type="function", function=wire.ChosenFunction(name=req.tool_choice.function.name))),
        response_format=_format(req.response_format),
        **sampling(req, req.max_completion_tokens or req.max_tokens, owner, priority))


def _message(m: ChatMessage) -> wire.Message:
    """One message as the chat message takes it: developer is system (text parts go as they are; inference joins
    them, so the HTTP and ZeroMQ paths render the same prompt)."""
    content = (m.content if not isinstance(m.content, list)
               else [wire.TextPart(type="text", text=p.text) for p in m.content])
    calls = [wire.ToolCall(id=c.id, type="function", function=wire.CalledFunction(name=c.function.name, arguments=c.function.arguments))
             for c in m.tool_calls] if m.tool_calls else None
    return wire.Message(role="system" if m.role == "developer" else m.role, content=content, tool_calls=calls,
                        tool_call_id=m.tool_call_id, name=m.name)


def _tool(t: Tool) -> wire.Tool:
    fn = t.function
    return wire.Tool(type="function", function=wire.FunctionSpec(name=fn.name, description=fn.description, parameters=fn.parameters,
                                                strict=fn.strict))


def _format(fmt: ResponseFormat | None) -> wire.ResponseFormat | None:
    if isinstance(fmt, JsonSchemaResponseFormat):
        spec = fmt.json_schema
        return wire.ResponseFormat(type="json_schema", json_schema=wire.JsonSchemaSpec(
            name=spec.name, description=spec.description, schema=spec.json_schema, strict=spec.strict))
    return None if fmt is None or fmt.type == "text" else wire.ResponseFormat(type=fmt.type)


async def _generate(http: Request, gw: Gateway, msg_type: str, body: wire.Generation, session_id: str | None,
                    shape: Shape, stream: bool):
    deadline = gw.upstreams.deadline()
    if not stream:
        reply = await unless_disconnected(http, gw.upstreams.request("inference", msg_type, body, session_id,
                                                                      deadline))
        return shape.result(shape.read(reply))
    frames = gw.upstreams.stream("inference", msg_type, body, session_id, deadline)
    first = await anext(frames)  # refusals answer with their status (the generator is finished then)
    cfg = gw.config.gateway
    return EventSourceResponse(_events(gw, shape, first, frames), ping=cfg.sse_ping_s, sep="\n")


async def _events(gw: Gateway, shape: Shape, reply: Reply, frames: AsyncGenerator[Reply, None]):
    try:
        for chunk in shape.opening():
            yield _data(chunk)
        while not reply.final:
            for chunk in shape.on_event(reply.body):
                yield _data(chunk)
            reply = await anext(frames)
        for chunk in shape.closing(shape.read(reply.body)):
            yield _data(chunk)
        yield ServerSentEvent(data="[DONE]")
    except ApiError as err:
        gw.log.warning("stream_failed", id=shape.id, status=err.status, code=err.code, error=err.message)
        yield ServerSentEvent(data=json.dumps(error_body(err)))
    finally:
        await frames.aclose()


def _data(chunk) -> ServerSentEvent:
    return ServerSentEvent(data=chunk.model_dump_json(exclude_none=True))
