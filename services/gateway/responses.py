"""POST /v1/responses: Magnitude's agent loop, run by the gateway, in the shape of OpenAI's Responses API.

The loop is ``services.agent.loop._Run``, the one ``magnitude.agent`` drives in
process; ``AgentRun`` carries its requests to the services through the
gateway's upstream pools. A run starts from a goal (``input``), runs the
configured tools (``agent.tools``) itself and reports each step as output items:
the model's text (``message``) and each configured call with its result
(``tool_call``, an extension). A call of a tool the caller declared (``tools``)
is the loop's request to the service ``caller``: the response ends there with a
``function_call`` item and status ``requires_action``; the caller runs the tool
and posts a ``function_call_output`` with ``previous_response_id``, which
resumes the same run (its history, its session's warm KV) in a new response.

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

from fastapi import APIRouter
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request as HttpRequest

from services.agent.loop import Request, _Run
from services.gateway.access import Caller, Context, Gateway, scoped
from services.gateway.completions import unless_disconnected
from services.gateway.errors import ApiError, bad_request, documented, from_service_error
from services.gateway.schemas import (
    FunctionCallItem,
    FunctionCallOutput,
    FunctionTool,
    IncompleteDetails,
    MessageItem,
    OutputItem,
    OutputText,
    Response,
    ResponseError,
    ResponseEvent,
    ResponseRequest,
    ToolCallItem,
)
from shared.client import ServiceError
from shared.protocol import ErrorCode

router = APIRouter()
#: What each event of a streamed run carries (app.py writes it into the OpenAPI document).
STREAM_EVENTS = {"/v1/responses": ResponseEvent}

#: The loop's end -> the response's status.
_STATUS = {"final_answer": "completed", "max_iterations": "incomplete", "error": "failed"}
#: Session drops in flight (asyncio keeps only weak references to tasks).
_DROPS: set[asyncio.Task] = set()


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class AgentRun:
    """One run of the loop, the caller it belongs to, and how much of it has been reported as items."""

    def __init__(self, gw: Gateway, owner: str | None, model: str | None, goal: str, tools: list[FunctionTool]):
        config = gw.config
        if model:
            config = config.model_copy(update={"agent": config.agent.model_copy(update={"model": model})})
        specs = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type", "strict"})}
                 for t in tools]
        self.gw, self.owner = gw, owner
        self.model = model or config.agent.model or "default"
        self.caller_tools = {t.name for t in tools}
        self.loop = _Run(config, goal, _id("agent"), None, specs)
        self.session = scoped(owner, self.loop.trace.session_id)
        self.waiting: FunctionCallItem | None = None  # the caller's call the run waits for
        self._steps = self._calls = 0  # steps of the trace, and calls of its last step, reported so far

    async def items(self, output: str | None = None) -> AsyncIterator[OutputItem]:
        """The run's output items as it makes them, until it ends or waits for a caller's tool (``waiting``);
        ``output``: the result of the call it waited for."""
        if output is not None:
            self.waiting = None
            self.loop.advance({"output": output})
            for item in self._new_items():
                yield item
        while (req := self.loop.pending) is not None:
            if req.service == "caller":
                self.waiting = FunctionCallItem(id=_id("fc"), call_id=_id("call"), name=req.body["tool"],
                                                arguments=json.dumps(req.body["args"]),
                                                step=self.loop.trace.steps[-1].index)
                yield self.waiting
                return
            self.loop.advance(await self._carry(req))
            for item in self._new_items():
                yield item

    async def _carry(self, req: Request) -> dict | ServiceError:
        """The reply to one of the loop's requests, or its failure for the loop to handle; before the first
        model step a failure is the HTTP request's own (``ApiError``)."""
        body = {**req.body, "owner": self.owner} if req.type == "chat" and self.owner else req.body
        try:
            reply = await self.gw.upstreams.exchange(req.service, req.type, body, scoped(self.owner, req.session))
        except ServiceError as err:
            error = err
        except TimeoutError:
            error = ServiceError(ErrorCode.TIMEOUT, f"{req.type} did not finish within gateway.request_timeout_s")
        except (ValueError, OverflowError) as err:  # what msgpack cannot encode (lone surrogates)
            error = ServiceError(ErrorCode.BAD_REQUEST, f"the request cannot be encoded: {err}")
        else:
            if req.type == "tool.list":
                self._check_names(reply["tools"])
            return reply
        if not self.loop.trace.steps and not req.optional:
            raise from_service_error(error)
        return error

    def _check_names(self, configured: list[dict]) -> None:
        if clash := sorted(self.caller_tools & {t["name"] for t in configured}):
            raise bad_request(f"{', '.join(clash)}: the gateway runs a tool of this name itself (agent.tools); "
                              "name yours otherwise", "tools")

    def _new_items(self) -> Iterator[OutputItem]:
        """Items for what the trace gained: a new step's text, and its calls of configured tools (a caller's
        call is reported when it is handed out, unless the loop refused it: arguments that are no JSON)."""
        steps = self.loop.trace.steps
        while self._steps < len(steps):
            step = steps[self._steps]
            self._steps, self._calls = self._steps + 1, 0
            if step.content:
                yield MessageItem(id=_id("msg"), content=[OutputText(text=step.content)], step=step.index)
        calls = steps[-1].calls if steps else []
        for call in calls[self._calls:]:
            if call.name not in self.caller_tools or call.error is not None:
                yield ToolCallItem(id=_id("tc"), name=call.name, arguments=call.arguments, output=call.output,
                                   error=call.error, status="completed" if call.error is None else "failed",
                                   step=steps[-1].index)
        self._calls = len(calls)

    def response(self, response_id: str, created: int, previous: str | None, output: list[OutputItem]) -> Response:
        trace = self.loop.trace
        if self.waiting is not None:
            status = "requires_action"
        else:
            status = "in_progress" if self.loop.pending is not None else _STATUS[trace.stopped]
        error = None
        if status == "failed":
            code, _, message = (trace.error or "internal: the run failed").partition(": ")
            error = ResponseError(code=code, message=message)
        incomplete = IncompleteDetails(reason="max_iterations") if status == "incomplete" else None
        return Response(id=response_id, created_at=created, model=self.model, status=status, output=output,
                        previous_response_id=previous, error=error, incomplete_details=incomplete)

    def end(self) -> None:
        """Drop the run's session (its KV) in inference: no one else can name it. In the background, so a
        cancelled request still does it."""
        task = asyncio.ensure_future(self._drop())
        _DROPS.add(task)
        task.add_done_callback(_DROPS.discard)

    async def _drop(self) -> None:
        try:
            await self.gw.upstreams.exchange("inference", "session.drop", {"owner": self.owner} if self.owner else {},
                                             self.session)
        except (ServiceError, TimeoutError) as err:
            self.gw.log.warning("agent_session_not_dropped", session=self.session, error=str(err))


class Runs:
    """The runs waiting for their caller's tool result, by the id of the response that handed out the call."""

    def __init__(self, gw: Gateway):
        self.gw = gw
        self._waiting: dict[str, tuple[AgentRun, asyncio.TimerHandle]] = {}

    def park(self, response_id: str, run: AgentRun) -> None:
        wait_s = self.gw.config.gateway.agent_wait_s
        self._waiting[response_id] = (run, asyncio.get_running_loop().call_later(wait_s, self._expire, response_id))

    def take(self, response_id: str, owner: str | None, call_id: str) -> AgentRun:
        """The run that response left waiting, for the output of ``call_id`` (404 for another caller's run)."""
        entry = self._waiting.get(response_id)
        if entry is None or entry[0].owner != owner:
            raise ApiError(404, "not_found_error", "response_not_found",
                           f"no run waits under {response_id!r}: unknown, finished, or dropped after "
                           "gateway.agent_wait_s", "previous_response_id")
        run, timer = entry
        if call_id != run.waiting.call_id:
            raise bad_request(f"the run waits for the output of call {run.waiting.call_id!r}, not {call_id!r}",
                              "input")
        del self._waiting[response_id]
        timer.cancel()
        return run

    def _expire(self, response_id: str) -> None:
        run, _ = self._waiting.pop(response_id)
        self.gw.log.info("agent_run_expired", response=response_id, session=run.session,
                         waited_s=self.gw.config.gateway.agent_wait_s)
        run.end()


def install(app, gw: Gateway) -> None:
    app.state.runs = Runs(gw)
    app.include_router(router)


@router.post("/v1/responses", response_model=Response, responses={
    200: {"description": "the run's response; with stream: true, server-sent events, one per step's item, then "
                         "the response"}, **documented(400, 401, 404, 413, 429, 503, 504)},
    summary="Run Magnitude's agent: configured tools run here, the caller's come back as function calls")
async def responses(req: ResponseRequest, gw: Context, owner: Caller, http: HttpRequest):
    runs: Runs = http.app.state.runs
    if req.previous_response_id is None:
        run, output = AgentRun(gw, owner, req.model, _goal(req), req.tools or []), None
        gw.log.info("agent_run_started", session=run.session, caller_tools=sorted(run.caller_tools))
    else:
        result = _function_output(req)
        run, output = runs.take(req.previous_response_id, owner, result.call_id), result.output
    response_id, created = _id("resp"), int(time.time())
    items = run.items(output)
    try:
        if not req.stream:
            made = await unless_disconnected(http, _all(items))
            return _finish(runs, run, run.response(response_id, created, req.previous_response_id, made))
        first = await anext(items, None)  # failures before the first step answer with their status
    except BaseException:  # refused, or the client went away: the run ends here
        run.end()
        raise
    return EventSourceResponse(_events(runs, run, response_id, created, req.previous_response_id, first, items),
                               ping=gw.config.gateway.sse_ping_s, sep="\n")


def _goal(req: ResponseRequest) -> str:
    if req.tools and len({t.name for t in req.tools}) < len(req.tools):
        raise bad_request("two tools share a name", "tools")
    if isinstance(req.input, str):
        return req.input
    if req.input[0].type != "message":
        raise bad_request("a function_call_output resumes a run: send it with previous_response_id", "input")
    return req.input[0].content


def _function_output(req: ResponseRequest) -> FunctionCallOutput:
    """The output that resumes a run (its model and tools are the run's own: ones sent again are not read)."""
    if isinstance(req.input, str) or req.input[0].type != "function_call_output":
        raise bad_request("a run is resumed with the function_call_output of the call it waits for", "input")
    return req.input[0]


async def _all(items: AsyncIterator[OutputItem]) -> list[OutputItem]:
    return [item async for item in items]


def _finish(runs: Runs, run: AgentRun, response: Response) -> Response:
    """Park a run that waits for its caller, end one that is done; log either way."""
    if response.status == "requires_action":
        runs.park(response.id, run)
    else:
        run.end()
    runs.gw.log.info("agent_response", id=response.id, session=run.session, status=response.status,
                     items=len(response.output), steps=len(run.loop.trace.steps),
                     waiting_for=run.waiting.name if run.waiting else None)
    return response


async def _events(runs: Runs, run: AgentRun, response_id: str, created: int, previous: str | None,
                  first: OutputItem | None, items: AsyncIterator[OutputItem]):
    """response.created, each item as it is made, then the response (its status names the event). A client
    that goes away cancels this, and with it the step in flight: the run ends there."""
    sequence, output = itertools.count(), []

    def event(kind: str, **fields) -> ServerSentEvent:
        data = ResponseEvent(type=kind, sequence_number=next(sequence), **fields)
        return ServerSentEvent(data=data.model_dump_json(exclude_none=True), event=kind)

    finished = False
    try:
        yield event("response.created", response=run.response(response_id, created, previous, []).model_copy(
            update={"status": "in_progress"}))
        async for item in _chain(first, items):
            output.append(item)
            yield event("response.output_item.done", output_index=len(output) - 1, item=item)
        response = _finish(runs, run, run.response(response_id, created, previous, output))
        finished = True
        yield event(f"response.{response.status}", response=response)
    finally:
        if not finished:
            run.end()


async def _chain(first: OutputItem | None, rest: AsyncIterator[OutputItem]) -> AsyncIterator[OutputItem]:
    if first is not None:
        yield first
    async for item in rest:
        yield item
