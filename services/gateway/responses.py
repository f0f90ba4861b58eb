"""POST /v1/responses: Magnitude's agent loop, run by the gateway, in the shape of OpenAI's Responses API.

The loop is ``services.agent.loop.Run``, the one ``magnitude.agent`` drives in
process; ``AgentRun`` carries its requests to the services through the
gateway's upstream pools. A run starts from a goal (``input``), runs the
configured tools (``agent.tools``) itself and reports each step as output items:
the model's text (``message``) and each configured call with its result
(``tool_call``, an extension). A call of a tool the caller declared (``tools``)
is the loop's request to the service ``caller`` (a step's calls of them
together): the response ends there with a ``function_call`` item per call and
status ``requires_action``; the caller runs the tools and posts a
``function_call_output`` for each with ``previous_response_id``, which resumes
the same run (its history, its session's warm KV) in a new response.

A waiting run is a suspended generator in this process's memory: it holds no
generation, no admission slot and no HTTP request. ``Runs`` keeps it for
``gateway.agent_wait_s``, then drops it and its session. A run whose client goes
away (a stream closed, a request given up) is cancelled with its generation.
Failures before the run's first model step answer with their status (tools not
running 503, unknown model 404, busy 429); later ones end the run ``failed``, as
the loop records them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, cast

import msgspec
from fastapi import APIRouter
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request as HttpRequest

from services.agent.context import Turn, turn_text
from services.agent.loop import Conversation, Run, ServiceCall, Steering
from services.gateway.access import Context, Gateway, Owner, PriorityHeader, owned, scoped, wire_owner
from services.gateway.disconnect import unless_disconnected
from services.gateway.errors import ApiError, bad_request, documented, from_service_error
from services.gateway.stored import Stored, StoredResponse
from services.gateway.schemas import (
    FunctionCallInput,
    FunctionCallItem,
    FunctionCallOutput,
    FunctionTool,
    FunctionToolChoice,
    IncompleteDetails,
    InputMessage,
    InputTokensDetails,
    MessageItem,
    OutputItem,
    OutputText,
    Response,
    ResponseDeleted,
    ResponseError,
    ResponseEvent,
    ResponseRequest,
    ResponseUsage,
    ToolCallInput,
    ToolCallItem,
)
from shared.client import ServiceError
from shared.config import FINAL_ANSWER
from shared.protocol import ChatRequest, ErrorCode
from shared.security import session_ref
from shared.text import cap_text

router = APIRouter()
#: What each event of a streamed run carries (app.py writes it into the OpenAPI document).
STREAM_EVENTS = {"/v1/responses": ResponseEvent}

#: The loop's end -> the response's status.
_STATUS = {FINAL_ANSWER: "completed", "max_iterations": "incomplete", "max_output_tokens": "incomplete",
           "error": "failed"}
#: A response's status -> the event that ends its stream, where they differ.
_TERMINAL = {"requires_action": "completed"}
#: Session drops in flight (asyncio keeps only weak references to tasks).
_DROPS: set[asyncio.Task] = set()


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class AgentRun:
    """One run of the loop, the caller it belongs to, and how much of it has been reported as items."""

    def __init__(self, gw: Gateway, owner: str | None, model: str | None, goal: str, tools: list[FunctionTool],
                 instructions: str | None = None, earlier: Conversation | None = None, session_id: str | None = None,
                 store: bool = True, steering: Steering = Steering(), priority: str | None = None,
                 configured_tools: bool = True):
        """``earlier``: the conversation the run goes on, in ``session_id`` (None: a session of its own);
        ``store``: keep the finished response for GET and the next turn; ``steering``: the caller's sampling
        and tool choice; ``priority``: every model step's; ``configured_tools``: offer the gateway's tools
        beside the caller's."""
        config = gw.config
        if model:
            config = config.model_copy(update={"agent": config.agent.model_copy(update={"model": model})})
        specs = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type", "strict"})}
                 for t in tools]
        self.gw, self.owner, self.tools, self.instructions, self.store = gw, owner, tools, instructions, store
        self.model = model or config.agent.model or "default"
        self.caller_tools = {t.name for t in tools}
        self.loop = Run(config, goal, session_id or _id("agent"), None, specs, instructions, earlier, steering,
                        priority, configured_tools)
        self.metadata: dict[str, str] = {}  # the caller's, echoed on each response of the run
        self._counted = (0, 0, 0)  # the trace's (input, cached, output) tokens when the last response was made
        self.session = scoped(owner, self.loop.trace.session_id)
        self.waiting: list[FunctionCallItem] = []  # the caller's calls the run waits for
        self.last: Response | None = None  # the run's latest response
        self._steps = self._calls = 0  # steps of the trace, and calls of its last step, reported so far
        self._answered = False  # the answer's message is made

    async def items(self, outputs: dict[str, str] | None = None) -> AsyncIterator[OutputItem]:
        """The run's output items as it makes them, until it ends or waits for the caller's tools (``waiting``);
        ``outputs``: the results of the calls it waited for, by call id."""
        if outputs is not None:
            results = [outputs[call.call_id] for call in self.waiting]
            self.waiting = []
            self.loop.advance({"outputs": results})
            for item in self._new_items():
                yield item
        while (req := self.loop.pending) is not None:
            if req.service == "caller":  # a tool.calls: the step's calls of the caller's tools
                step = self.loop.trace.steps[-1].index
                self.waiting = [FunctionCallItem(id=_id("fc"), call_id=_id("call"), name=call["tool"],
                                                 arguments=json.dumps(call["args"]), step=step)
                                for call in cast(dict, req.body)["calls"]]
                for item in self.waiting:
                    yield item
                return
            self.loop.advance(await self._carry(req))
            for item in self._new_items():
                yield item

    async def _carry(self, req: ServiceCall) -> dict | ServiceError:
        """The reply to one of the loop's requests, or its failure for the loop to handle; before the first
        model step a failure is the HTTP request's own (``ApiError``)."""
        body = (msgspec.structs.replace(req.body, owner=wire_owner(self.owner)) if isinstance(req.body, ChatRequest)
                else req.body)
        try:
            reply = await self.gw.upstreams.exchange(req.service, req.type, body, scoped(self.owner, req.session))
        except ServiceError as err:
            error = err
        except TimeoutError:
            error = ServiceError(ErrorCode.TIMEOUT, f"{req.type} did not finish within gateway.request_timeout_s")
        except (ValueError, OverflowError) as err:  # what msgpack cannot encode (lone surrogates)
            error = ServiceError(ErrorCode.BAD_REQUEST, f"the request cannot be encoded: {err}")
        else:
            if req.type == "tool.list":  # a caller's tool shadows a configured one of its name for this run
                reply = {**reply, "tools": [t for t in reply["tools"] if t["name"] not in self.caller_tools]}
                self._check_choice({t["name"] for t in reply["tools"] if t.get("available", True)} | self.caller_tools)
            return reply
        if not self.loop.trace.steps and not req.optional:
            raise from_service_error(error)
        return error

    def _check_choice(self, tools: set[str]) -> None:
        """A tool_choice the run's tools cannot meet, refused before the run starts: a name none of them has,
        or required with no tools at all."""
        choice = self.loop.steering.tool_choice
        if isinstance(choice, dict) and choice["function"]["name"] not in tools:
            raise bad_request(f"tool_choice names {choice['function']['name']!r}, which is none of this run's "
                              "tools", "tool_choice")
        if choice == "required" and not tools:
            raise bad_request("tool_choice is required, but this run has no tools", "tool_choice")

    def _new_items(self) -> Iterator[OutputItem]:
        """Items for what the trace gained: each call of a configured tool as it is made (a caller's call is
        reported when it is handed out, unless the loop refused it: arguments that are no JSON), and the run's
        answer once it ends. The other steps' texts stay in the trace (a reply the step policy sent back, prose
        about a call, text beside calls): clients join every message of a response into its text (the official
        client's ``output_text``, LangChain, pydantic-ai), so the answer is the one message."""
        steps = self.loop.trace.steps
        if self._steps < len(steps):
            self._steps, self._calls = len(steps), 0
        calls = steps[-1].calls if steps else []
        for call in calls[self._calls:]:
            if call.name not in self.caller_tools or call.error is not None:
                yield ToolCallItem(id=_id("tc"), name=call.name, arguments=call.arguments, output=call.output,
                                   error=call.error, status="completed" if call.error is None else "failed",
                                   step=steps[-1].index)
        self._calls = len(calls)
        if self.loop.pending is None and not self._answered:
            self._answered = True
            if text := self.answer_text():
                yield MessageItem(id=_id("msg"), content=[OutputText(text=text)], step=steps[-1].index)

    def answer_text(self) -> str | None:
        """The run's answer; a run cut short (max_iterations, max_output_tokens) answers with its last step's
        text, a failed one with none."""
        trace = self.loop.trace
        if trace.answer is not None or trace.stopped == "error" or not trace.steps:
            return trace.answer
        return trace.steps[-1].content or None

    def response(self, response_id: str, created: int, previous: str | None, output: list[OutputItem],
                 final: bool = True) -> Response:
        """``final``: the response as it ends (it counts its usage); else the one ``response.created`` announces."""
        trace = self.loop.trace
        if self.waiting:
            status = "requires_action"
        else:
            status = "in_progress" if self.loop.pending is not None else _STATUS[trace.stopped]
        error = None
        if status == "failed":
            code, _, message = (trace.error or "internal: the run failed").partition(": ")
            error = ResponseError(code=code, message=message)
        incomplete = IncompleteDetails(reason=trace.stopped) if status == "incomplete" else None
        return Response(id=response_id, created_at=created, model=self.model, status=status, output=output,
                        previous_response_id=previous, error=error, incomplete_details=incomplete,
                        metadata=self.metadata, usage=self._usage() if final else None)

    def _usage(self) -> ResponseUsage:
        """What the steps since the last response cost (OpenAI counts usage per response)."""
        trace = self.loop.trace
        now = (trace.prompt_tokens + trace.cached_tokens, trace.cached_tokens, trace.output_tokens)  # every turn's
        (inputs, cached, outputs), self._counted = (a - b for a, b in zip(now, self._counted)), now
        return ResponseUsage(input_tokens=inputs, input_tokens_details=InputTokensDetails(cached_tokens=cached),
                             output_tokens=outputs, total_tokens=inputs + outputs)

    def end(self) -> None:
        """Drop the run's session (its KV) in inference: no one else can name it."""
        drop_session(self.gw, self.owner, self.loop.trace.session_id)

    def stored(self, response: Response) -> StoredResponse:
        return StoredResponse(self.owner, response, self.loop.conversation(), self.loop.trace.session_id, self.tools,
                              self.instructions)


def drop_session(gw: Gateway, owner: str | None, session_id: str) -> None:
    """Drop a run's session (its KV) in inference, in the background, so a cancelled request still does it."""
    task = asyncio.ensure_future(_drop(gw, owner, scoped(owner, session_id)))
    _DROPS.add(task)
    task.add_done_callback(_DROPS.discard)


async def _drop(gw: Gateway, owner: str | None, session_id: str) -> None:
    try:
        await gw.upstreams.exchange("inference", "session.drop", owned({}, owner), session_id)
    except (ServiceError, TimeoutError) as err:
        gw.log.warning("agent_session_not_dropped", session=session_ref(session_id), error=str(err))


class Runs:
    """The runs waiting for their caller's tool result, by the id of the response that handed out the call."""

    def __init__(self, gw: Gateway):
        self.gw = gw
        self._waiting: dict[str, tuple[AgentRun, asyncio.TimerHandle]] = {}
        self._by_call: dict[str, str] = {}  # the call a run waits for -> its response (stateless re-sends)

    def park(self, response_id: str, run: AgentRun) -> None:
        """Hold ``run`` for its caller's tool result; over gateway.max_parked_runs (or the per-key cap) the run is
        dropped and the caller told to come back (429), so no caller can fill the gateway's memory."""
        settings = self.gw.config.gateway
        mine = sum(1 for waiting, _ in self._waiting.values() if waiting.owner == run.owner)
        if len(self._waiting) >= settings.max_parked_runs or mine >= settings.max_parked_runs_per_key:
            run.end()
            raise ApiError(429, "rate_limit_error", "too_many_parked_runs",
                           f"too many runs wait for a tool result ({mine} of this caller, {len(self._waiting)} in "
                           "all): send their outputs first, or wait for gateway.agent_wait_s to drop them")
        wait_s = settings.agent_wait_s
        self._waiting[response_id] = (run, asyncio.get_running_loop().call_later(wait_s, self._expire, response_id))
        self._by_call.update((call.call_id, response_id) for call in run.waiting)

    def waits(self, response_id: str) -> bool:
        return response_id in self._waiting

    def waiting_response(self, response_id: str, owner: str | None) -> Response | None:
        """The response of a run that waits under ``response_id`` for its caller (None: no such run of theirs)."""
        entry = self._waiting.get(response_id)
        return entry[0].last if entry is not None and entry[0].owner == owner else None

    def waiting_for(self, call_id: str) -> str | None:
        """The response whose run waits for the output of ``call_id``: a client that re-sends the whole item
        list (no previous_response_id) resumes the run that handed the call out."""
        return self._by_call.get(call_id)

    def take(self, response_id: str, owner: str | None, outputs: dict[str, str]) -> AgentRun:
        """The run that response left waiting, for the outputs of every call it handed out, by call id (404 for
        another caller's run; 400 for a missing output, or one of a call it does not wait for)."""
        entry = self._waiting.get(response_id)
        if entry is None or entry[0].owner != owner:
            raise ApiError(404, "not_found_error", "response_not_found",
                           f"no run waits under {response_id!r}: unknown, finished, or dropped after "
                           "gateway.agent_wait_s", "previous_response_id")
        run, timer = entry
        waited = [call.call_id for call in run.waiting]
        if set(outputs) != set(waited):
            raise bad_request(f"the run waits for the outputs of calls {', '.join(map(repr, waited))}; this input "
                              f"has outputs of {', '.join(map(repr, outputs)) or 'none'}", "input")
        del self._waiting[response_id]
        for call_id in waited:
            del self._by_call[call_id]
        timer.cancel()
        return run

    def _expire(self, response_id: str) -> None:
        run, _ = self._waiting.pop(response_id)
        for call in run.waiting:
            self._by_call.pop(call.call_id, None)
        self.gw.log.info("agent_run_expired", response=response_id, session=session_ref(run.session),
                         waited_s=self.gw.config.gateway.agent_wait_s)
        run.end()


def install(app, gw: Gateway) -> None:
    app.state.runs = Runs(gw)
    app.state.stored = Stored(gw.config.gateway, lambda owner, session_id: drop_session(gw, owner, session_id))
    app.include_router(router)


@router.post("/v1/responses", response_model=Response, responses={
    200: {"description": "the run's response; with stream: true, server-sent events as OpenAI streams them "
                         "(each item added, its text or arguments, done), then the response"}, **documented(400, 401, 404, 413, 429, 503, 504)},
    summary="Run Magnitude's agent: configured tools run here, the caller's come back as function calls")
async def responses(req: ResponseRequest, gw: Context, owner: Owner, http: HttpRequest,
                    x_priority: PriorityHeader = None):
    runs: Runs = http.app.state.runs
    if req.priority is None and x_priority is not None:
        req = req.model_copy(update={"priority": x_priority})
    req = _outputs_capped(req, gw.config.agent.sandbox.max_output_bytes)
    previous, outputs = req.previous_response_id, _trailing_outputs(req)
    if previous is None and outputs:
        previous = runs.waiting_for(next(iter(outputs)))  # a re-sent history; else a new run from it (stateless)
    if previous is not None and runs.waits(previous):
        if not outputs:
            raise bad_request("a run is resumed with the function_call_output of each call it waits for", "input")
        run = runs.take(previous, owner, outputs)
    else:
        run, outputs = _new_run(req, gw, owner, previous, http.app.state.stored), None
        gw.log.info("agent_run_started", session=session_ref(run.session), caller_tools=sorted(run.caller_tools),
                    previous=previous)
    if req.metadata is not None:
        run.metadata = req.metadata
    req = req.model_copy(update={"previous_response_id": previous})
    response_id, created = _id("resp"), int(time.time())
    items = run.items(outputs)
    finish = _Finish(runs, http.app.state.stored, run)
    try:
        if not req.stream:
            made = await unless_disconnected(http, collect(items))
            return finish(run.response(response_id, created, req.previous_response_id, made))
        first = await anext(items, None)  # failures before the first step answer with their status
    except BaseException:  # refused, or the client went away: the run ends here
        run.end()
        raise
    return EventSourceResponse(_events(finish, run, response_id, created, req.previous_response_id, first, items),
                               ping=gw.config.gateway.sse_ping_s, sep="\n")


@router.get("/v1/responses/{response_id}", response_model=Response, responses=documented(401, 404),
            summary="A kept response: a finished one (unless made with store: false), or one waiting for a call")
async def get_response(response_id: str, owner: Owner, http: HttpRequest):
    waiting = http.app.state.runs.waiting_response(response_id, owner)
    return waiting if waiting is not None else http.app.state.stored.get(response_id, owner).response


@router.delete("/v1/responses/{response_id}", response_model=ResponseDeleted, responses=documented(401, 404),
               summary="Forget a finished response (and, if it was its conversation's latest, the session's KV)")
async def delete_response(response_id: str, owner: Owner, http: HttpRequest):
    http.app.state.stored.delete(response_id, owner)
    return ResponseDeleted(id=response_id)


def _new_run(req: ResponseRequest, gw: Gateway, owner: str | None, previous: str | None, stored: Stored) -> AgentRun:
    """A run for a new user turn: of the conversation ``previous`` ends (its session's warm KV when that is the
    conversation's latest response), else of the one the input holds (a string, or a history of items)."""
    if req.tools and len({t.name for t in req.tools}) < len(req.tools):
        raise bad_request("two tools share a name", "tools")
    items = [InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    instructions = instructions_of(req.instructions, items)
    store, steering = req.store is not False, _steering(req)
    if previous is None:
        goal, earlier = conversation_of(items)
        return AgentRun(gw, owner, req.model, goal, req.tools or [], instructions, earlier, store=store,
                        steering=steering, priority=req.priority)
    before, warm = stored.go_on(previous, owner)
    turns, facts = _turns(items)
    goal = _last_question(items)
    earlier = Conversation(before.conversation.opening, [*before.conversation.turns, *turns],
                           before.conversation.memories, [*before.conversation.facts, *facts])
    return AgentRun(gw, owner, req.model or before.response.model, goal, req.tools or before.tools,
                    instructions or before.instructions, earlier, before.session_id if warm else None, store,
                    steering, req.priority)


def _steering(req: ResponseRequest) -> Steering:
    """The request's sampling and tool settings, as the loop takes them (a named function in chat's shape)."""
    tool_choice = req.tool_choice
    choice: str | dict
    if isinstance(tool_choice, FunctionToolChoice):
        choice = {"type": "function", "function": {"name": tool_choice.name}}
    else:
        choice = tool_choice or "auto"
    return Steering(req.temperature, req.top_p, req.max_output_tokens, choice, req.parallel_tool_calls is not False)


def instructions_of(instructions: str | None, items: list) -> str | None:
    """The caller's system text: ``instructions`` and the input's system and developer messages."""
    texts = [instructions] if instructions else []
    texts += [i.text for i in items if i.type == "message" and i.role in ("system", "developer")]
    return "\n\n".join(texts) or None


def conversation_of(items: list) -> tuple[str, Conversation | None]:
    """A new run's goal (the input's last user message) and the conversation before it (None: the input is its
    one user message). The first user message opens the conversation; what follows is its history."""
    said = [i for i in items if not (i.type == "message" and i.role in ("system", "developer"))]
    goal = _last_question(said)
    if not said or said[0].type != "message" or said[0].role != "user":
        raise bad_request("a conversation starts with a user message", "input")
    if len(said) == 1:
        return goal, None
    turns, facts = _turns(said[1:])
    asked = max(i for i, item in enumerate(said) if item.type == "message" and item.role == "user")
    return goal, Conversation(said[0].text, turns, [], facts, len(_turns(said[asked + 1:])[1]))


def _last_question(items: list) -> str:
    questions = [i.text for i in items if i.type == "message" and i.role == "user"]
    if not questions:
        raise bad_request("the input has no user message to answer", "input")
    return questions[-1]


def _turns(items: list) -> tuple[list[Turn], list[tuple[str, str, str]]]:
    """Input items as the agent's history turns (a step's function calls as one assistant message, each output
    as a tool message), and the (tool, arguments, output) facts the outputs hold."""
    turns: list[Turn] = []
    calls: dict[str, FunctionCallInput] = {}
    facts: list[tuple[str, str, str]] = []
    for item in (made for item in items for made in _as_calls(item)):
        if item.type == "function_call":
            calls[item.call_id] = item
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = turns[-1].message if turns else None
            made = [*last["tool_calls"], call] if last and last["role"] == "assistant" and last.get("tool_calls") \
                else [call]
            if len(made) > 1:
                turns.pop()
            message = {"role": "assistant", "content": "", "tool_calls": made}
            turns.append(Turn("assistant", turn_text(message), message=message))
        elif item.type == "function_call_output":
            called = calls.get(item.call_id)
            message = {"role": "tool", "tool_call_id": item.call_id, "content": item.output}
            if called is not None:
                message["name"] = called.name
                facts.append((called.name, called.arguments, item.output))
            turns.append(Turn("tool", item.output, message=message))
        elif item.role in ("user", "assistant"):
            turns.append(Turn(item.role, item.text))
    return turns, facts


def _as_calls(item) -> list:
    """An input item, with a re-sent ``tool_call`` (a configured tool's call and result) as the function call and
    output it stands for."""
    if not isinstance(item, ToolCallInput):
        return [item]
    return [FunctionCallInput(type="function_call", call_id=item.id, name=item.name, arguments=item.arguments),
            FunctionCallOutput(type="function_call_output", call_id=item.id, output=item.output)]


def _outputs_capped(req: ResponseRequest, cap: int) -> ResponseRequest:
    """The request with each of the caller's tool outputs cut to what a configured tool may give
    (agent.sandbox.max_output_bytes), with a note, as a configured tool's is: the model reads no more of it
    anyway, and a 900k-character output became a memory write over the mesh's frame limit."""
    if not isinstance(req.input, list):
        return req
    items = [item.model_copy(update={"output": cap_text(item.output, cap)[0]})
             if item.type in ("function_call_output", "tool_call") else item for item in req.input]
    return req.model_copy(update={"input": items})


def _trailing_outputs(req: ResponseRequest) -> dict[str, str]:
    """The function_call_outputs an item list ends with, by call id: what resumes a waiting run (its model and
    tools are the run's own: ones sent again are not read; in a re-sent item list, the outputs after the last
    step's calls)."""
    outputs: dict[str, str] = {}
    for item in reversed(req.input if isinstance(req.input, list) else []):
        if item.type != "function_call_output":
            break
        outputs[item.call_id] = item.output
    return dict(reversed(outputs.items()))


async def collect(items: AsyncIterator[OutputItem]) -> list[OutputItem]:
    return [item async for item in items]


@dataclass
class _Finish:
    """What becomes of a run when its response is made: parked while it waits for its caller, kept (its
    conversation, for GET and the next turn) or ended when it is done."""

    runs: Runs
    stored: Stored
    run: AgentRun

    def __call__(self, response: Response) -> Response:
        run = self.run
        run.last = response
        if response.status == "requires_action":
            self.runs.park(response.id, run)
        elif run.store:
            self.stored.keep(run.stored(response))
        else:
            run.end()
        self.runs.gw.log.info("agent_response", id=response.id, session=session_ref(run.session),
                              status=response.status, items=len(response.output), steps=len(run.loop.trace.steps),
                              waiting_for=[call.name for call in run.waiting] or None)
        return response


async def _events(finish: _Finish, run: AgentRun, response_id: str, created: int, previous: str | None,
                  first: OutputItem | None, items: AsyncIterator[OutputItem]):
    """response.created and .in_progress, each item's events as it is made, then the response (its status names
    the event). A client that goes away cancels this, and with it the step in flight: the run ends there."""
    sequence, output = itertools.count(), []

    def event(kind: str, **fields) -> ServerSentEvent:
        data = ResponseEvent(type=kind, sequence_number=next(sequence), **fields)
        return ServerSentEvent(data=data.model_dump_json(exclude_none=True), event=kind)

    finished = False
    try:
        started = run.response(response_id, created, previous, [], final=False).model_copy(
            update={"status": "in_progress"})
        yield event("response.created", response=started)
        yield event("response.in_progress", response=started)
        async for item in _chain(first, items):
            output.append(item)
            for kind, fields in _item_events(len(output) - 1, item):
                yield event(kind, **fields)
        try:
            response = finish(run.response(response_id, created, previous, output))
        except ApiError as err:  # no room to park the run (finish ended it): the stream has begun, so it fails
            response = run.response(response_id, created, previous, output).model_copy(
                update={"status": "failed", "error": ResponseError(code=err.code, message=err.message)})
        finished = True
        # a run waiting for a caller's tool ends its stream as OpenAI's does, with response.completed (the
        # event the SDKs wait for); its response's status still says requires_action
        yield event(f"response.{_TERMINAL.get(response.status, response.status)}", response=response)
    finally:
        if not finished:
            run.end()


#: What an item holds when it is added, before its deltas fill it.
_EMPTY: dict[str, dict[str, Any]] = {"message": {"content": []}, "function_call": {"arguments": ""}, "tool_call": {"output": ""}}


def _item_events(index: int, item: OutputItem) -> Iterator[tuple[str, dict]]:
    """One item's events, as OpenAI streams them: added (empty, in progress), its text parts or its arguments
    (each whole, as one delta: a step's text is known once the step is done), then done."""
    at = {"output_index": index}
    yield "response.output_item.added", {**at, "item": item.model_copy(update={"status": "in_progress",
                                                                                **_EMPTY[item.type]})}
    if isinstance(item, MessageItem):
        for n, part in enumerate(item.content):
            where = {**at, "item_id": item.id, "content_index": n}
            yield "response.content_part.added", {**where, "part": part.model_copy(update={"text": ""})}
            yield "response.output_text.delta", {**where, "delta": part.text, "logprobs": []}
            yield "response.output_text.done", {**where, "text": part.text, "logprobs": []}
            yield "response.content_part.done", {**where, "part": part}
    elif isinstance(item, FunctionCallItem):
        yield "response.function_call_arguments.delta", {**at, "item_id": item.id, "delta": item.arguments}
        yield "response.function_call_arguments.done", {**at, "item_id": item.id, "arguments": item.arguments}
    yield "response.output_item.done", {**at, "item": item}


async def _chain(first: OutputItem | None, rest: AsyncIterator[OutputItem]) -> AsyncIterator[OutputItem]:
    if first is not None:
        yield first
    async for item in rest:
        yield item
