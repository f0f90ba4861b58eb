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

import asyncio
import json
import secrets
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request

from services.gateway.access import Caller, Context, Gateway, PriorityHeader, Session, owned, prioritized
from services.gateway.errors import ApiError, documented, error_body
from services.gateway.replies import ChatShape, CompletionShape, Shape
from services.gateway.schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    Completion,
    CompletionRequest,
    SamplingParams,
)
from shared.client import chat_body as client_chat_body
from shared.protocol import MAX_SEED, ErrorCode, Reply

router = APIRouter()

GENERATION_RESPONSES = {200: {"description": "the result; with stream: true, server-sent events: one chunk per "
                                             "data: event, then data: [DONE]"},
                        **documented(400, 401, 404, 413, 429, 501, 503, 504)}
#: What each event of a streamed result carries (app.py writes it into the OpenAPI document).
STREAM_CHUNKS = {"/v1/chat/completions": ChatCompletionChunk, "/v1/completions": Completion}


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses=GENERATION_RESPONSES,
             summary="Chat with the model's own template and native tool calls")
async def chat_completions(req: ChatCompletionRequest, gw: Context, session_id: Session, owner: Caller,
                           http: Request, x_priority: PriorityHeader = None):
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    body = prioritized(owned(chat_body(req, session_id), owner), req.priority or x_priority)
    return await _generate(http, gw, "chat", body, session_id, ChatShape(req.model, include_usage), req.stream)


@router.post("/v1/completions", response_model=Completion, responses=GENERATION_RESPONSES,
             summary="Complete a raw prompt")
async def completions(req: CompletionRequest, gw: Context, session_id: Session, owner: Caller,
                      http: Request, x_priority: PriorityHeader = None):
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    shape = CompletionShape(req.model, include_usage, echo=req.prompt_text() if req.echo else None)
    body = prioritized(owned({"prompt": req.prompt_text(), **sampling_body(req, req.max_tokens)}, owner),
                       req.priority or x_priority)
    return await _generate(http, gw, "generate", body, session_id, shape, req.stream)


def sampling_body(req: SamplingParams, max_tokens: int | None) -> dict[str, Any]:
    """The generate/chat fields both endpoints share. Without a seed each request draws one, as OpenAI
    samples differently each time unless told otherwise (the engine's own default seed is fixed)."""
    body = {"model": req.model, "max_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "top_k": req.top_k, "stop": req.stop_list(), "stream": req.stream,
            "seed": req.seed if req.seed is not None else secrets.randbelow(MAX_SEED + 1)}
    return {k: v for k, v in body.items() if v is not None}


def chat_body(req: ChatCompletionRequest, session_id: str | None) -> dict[str, Any]:
    """The ``chat`` request, built by the client library (a long conversation goes in shared memory)."""
    params = sampling_body(req, req.max_completion_tokens or req.max_tokens)
    if req.tools:
        params["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    if req.tool_choice is not None:
        params["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump()
    if req.response_format is not None and req.response_format.type != "text":
        params["response_format"] = req.response_format.model_dump(by_alias=True, exclude_none=True)
    return client_chat_body([_message(m) for m in req.messages], session_id, **params)


def _message(m: ChatMessage) -> dict[str, Any]:
    """One message as the chat message takes it: developer is system (text parts go as they are; inference joins
    them, so the HTTP and ZeroMQ paths render the same prompt)."""
    content = m.content if not isinstance(m.content, list) else [p.model_dump() for p in m.content]
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


async def _generate(http: Request, gw: Gateway, msg_type: str, body: dict, session_id: str | None, shape: Shape,
                    stream: bool):
    deadline = gw.upstreams.deadline()
    if not stream:
        reply = await unless_disconnected(http, gw.upstreams.request("inference", msg_type, body, session_id,
                                                                      deadline))
        return shape.result(reply)
    frames = gw.upstreams.stream("inference", msg_type, body, session_id, deadline)
    first = await anext(frames)  # refusals answer with their status (the generator is finished then)
    cfg = gw.config.gateway
    return EventSourceResponse(_events(gw, shape, first, frames), ping=cfg.sse_ping_s, sep="\n")


#: How often a non-streamed request checks whether its HTTP client is still there.
DISCONNECT_POLL_S = 0.25

_T = TypeVar("_T")


async def unless_disconnected(http: Request, work: Awaitable[_T]) -> _T:
    """``work``'s result; if the HTTP client goes away first, ``work`` is cancelled (and with it the generation:
    the ZeroMQ client sends ``cancel``), and the request ends as 499, as nginx names a closed request."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await http.is_disconnected():
                raise ApiError(499, "client_closed_request", ErrorCode.CANCELLED, "the client went away")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _events(gw: Gateway, shape: Shape, reply: Reply, frames: AsyncGenerator[Reply, None]):
    try:
        for chunk in shape.opening():
            yield _data(chunk)
        while not reply.final:
            for chunk in shape.on_event(reply.body):
                yield _data(chunk)
            reply = await anext(frames)
        for chunk in shape.closing(reply.body):
            yield _data(chunk)
        yield ServerSentEvent(data="[DONE]")
    except ApiError as err:
        gw.log.warning("stream_failed", id=shape.id, status=err.status, code=err.code, error=err.message)
        yield ServerSentEvent(data=json.dumps(error_body(err)))
    finally:
        await frames.aclose()


def _data(chunk) -> ServerSentEvent:
    return ServerSentEvent(data=chunk.model_dump_json(exclude_none=True))
