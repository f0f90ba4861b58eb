"""The agent loop: ``Agent(config).run(goal)`` / ``await AsyncAgent(config).run(goal)`` return a ``Trace``.

A run is one session of the inference service's ``chat`` message, so any model
with a chat template works: the tools go to the model in its own template, it
calls them in its own format (parsed, and constrained once a call opens, by the
service), and each result comes back to it in the template's tool role. A reply
without tool calls is the answer; ``max_iterations`` bounds the run.

Around each step: the run starts by recalling the long-term memories relevant
to its goal into the system prompt; every prompt is fitted to the model's
``n_ctx`` by the context budget, which summarizes old turns and writes them
verbatim to long-term memory; and when the optimizer advises it (the session's
decode speed has halved), the history is compressed at once.

The loop does no I/O (the sans-I/O pattern of h11): ``Run`` is a generator of
``ServiceCall`` operations that receives each reply (or the ``ServiceError``), and its
drivers only carry requests to the services: ``Agent`` / ``AsyncAgent``
(``magnitude.agent``) over ZeroMQ, and the gateway's ``POST /v1/responses``
(``services.gateway.responses``). Tools a caller declares (``caller_tools``) are
called with requests to the service ``caller``: the gateway hands each one to
its HTTP client as a function call and resumes the run with the output posted.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Generator, Sequence

import msgspec
import structlog

from services.agent.context import (BuiltPrompt, ContextManager, Count, Operation, Summarize, Turn, transcript,
                                    translate, turn_text)
from services.agent.policy import COMPUTE_TOOL, AskModel, StepPolicy, named
from services.agent.working_memory import WorkingMemory
from shared import shm
from shared.client import ServiceError, chat_request
from shared.config import FINAL_ANSWER, Config
from shared.protocol import ChatRequest, ChatResult, ErrorCode, read_result
from shared.security import session_ref

log = structlog.get_logger("agent")

#: What the model is told; bench_agent.py gives the plain tool loop it compares with the same text.
SYSTEM_PROMPT = ("You are an assistant that completes the user's task. Call a tool only when the task needs what "
                 "it does; otherwise answer directly from what you know. Once the tool results give you what "
                 "you need, reply with the answer in one short sentence and call no more tools.")
#: (The answer's language is said in the working-memory note, not here: ", in the language of the task," in this
#: prompt made the default model write a conversion's formula instead of calling the calculator.)
#: After tool results, below the working memory (the task, what the tools gave, what is still missing): small
#: models otherwise go on calling tools after they have what they need, or answer with an intermediate result.
_NEXT = ("{note}\nIf a step of the task is still missing (arithmetic: never in your head; another file or "
         "memory), call the tool for it. Otherwise reply with the answer now.")
#: A candidate answer that the working memory does not back: it is sent back once or twice, with why.
_NOT_YET = "{note}\nYour last reply did not answer the task yet: {reasons}. {then}"
#: When a run must answer (its last step, or after repeated calls) and its tools found something: a prompt of
#: the working memory alone, without tools, so no call can be written (under ``tool_choice: "none"`` with the
#: tools and the history of calls still in the prompt, the default model wrote the next call as JSON text instead).
_ANSWER_SYSTEM = "You answer a task from what was found for it, in one short sentence."
_ANSWER_NOW = "{note}\nAnswer the task now from what was found, in one short sentence."
#: A repeated call's result, the first time: small models repeat a lookup instead of taking the next step.
_REPEATED = "{output}\n(This call was made before; this is its result again. Do not repeat it.)"
_SUMMARY_PROMPT = ("Summarize the conversation above in a few sentences. Keep every name, number, file name and "
                   "tool result that the task may still need.")
#: A question the step policy asks the model (the task's language, a judgment of a candidate answer): a short JSON
#: object.
_ASK_TOKENS = 64
#: Tokens a template's tool section adds beyond the tools' JSON, before the first reply tells the real figure.
_TEMPLATE_GUESS = 128
#: After an advised compression, steps before the next one is honoured (decode speed needs time to show).
_COMPRESS_EVERY = 3


@dataclass(frozen=True)
class ServiceCall:
    """One operation of the loop: a request to a service (``session`` None: outside the run's session).

    ``optional``: the run goes on without it (recall, advice, remembering), so it is never retried: a
    service that is not running must not hold a run up for the retry deadline.
    """
    service: str
    type: str
    body: dict | ChatRequest  # a chat's is typed
    session: str | None = None
    optional: bool = False


@dataclass
class CallRecord:
    """A tool call a step made, as the trace keeps it: what was asked and what came back."""

    name: str
    arguments: str  # as the model wrote them (a JSON string)
    output: str = ""
    error: str | None = None
    valid: bool = False  # JSON naming a real tool with schema-valid arguments (the tool itself may still fail)


@dataclass
class Step:
    index: int
    content: str  # the model's text: beside its tool calls, or the answer
    calls: list[CallRecord] = field(default_factory=list)
    prompt_tokens: int = 0
    summarized_turns: int = 0  # history turns the context budget held as a summary at this step
    compressed: bool = False  # the optimizer's advice made this step compress the history
    repeated: bool = False  # the model repeated calls it had made; they were not run, the next step must answer
    intended: str | None = None  # the model wrote about calling this tool without a call; the next step names it
    rejected: str | None = None  # why this reply was not taken as the answer (an unread file, an invented number)
    ms: float = 0.0


@dataclass
class Trace:
    goal: str
    session_id: str
    steps: list[Step] = field(default_factory=list)
    answer: str | None = None
    stopped: str = "max_iterations"  # final_answer | max_iterations | max_output_tokens | error
    error: str | None = None
    memories: list[str] = field(default_factory=list)  # recalled into the first prompt
    language: str | None = None  # the task's, as the model named it (agent.policy.answer_language)
    warnings: list[str] = field(default_factory=list)  # what failed but did not stop the run
    elapsed_s: float = 0.0
    prompt_tokens: int = 0  # prefilled
    cached_tokens: int = 0  # reused from the session's KV
    output_tokens: int = 0  # generated

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Steering:
    """What the Responses API lets a caller set for one run; None: the agent's configuration (``agent:``)."""

    temperature: float | None = None  # of every step
    top_p: float | None = None
    max_output_tokens: int | None = None  # the run's generated tokens in all; reached: stopped "max_output_tokens"
    tool_choice: str | dict = "auto"  # the first step's, as the chat message takes it; "none": no tools offered
    parallel_tool_calls: bool = True  # False: a step's first call is taken, the others are dropped


@dataclass
class Conversation:
    """What came before a run in its conversation: an earlier run's (``Run.conversation``, the Responses API's
    ``previous_response_id``) or a client's re-sent history. The run's prompt starts with it, so a conversation
    kept in one session reuses that session's KV, and its facts back the run's answer like the run's own."""

    opening: str  # the conversation's first user message: the prompt's first user turn, kept verbatim
    turns: list[Turn] = field(default_factory=list)  # everything said after it, the run's own question included
    memories: list[str] = field(default_factory=list)  # recalled when the conversation began
    facts: list[tuple[str, str, str]] = field(default_factory=list)  # (tool, arguments, result) found so far
    #: Of ``facts``, how many the last question has found already (a client re-sending a run under way, such as
    #: a chat-completions tool loop): a repeat of one of their calls is answered from its result, not made again.
    answering: int = 0


def _canonical(arguments: Any) -> str:
    """Tool-call arguments in one spelling, so a repeated call is recognised however it was written."""
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return str(arguments)
    return json.dumps(value, sort_keys=True)


def _result(call: CallRecord) -> str:
    """What a call gives back to the model: its output, or its error."""
    return call.output if call.error is None else f"Error: {call.error}"


def _written_call(text: str, tools: list[str], call_id: str) -> dict | None:
    """The call a reply means when it ends in a tool call written as JSON text (in a fence, in tags such as
    ``<tool_response>`` that no parser takes for a call, or bare; alone or after a line of prose); None for any
    other reply."""
    body = re.sub(r"^(?:```(?:json)?|<\w+>)\s*|\s*(?:```|</\w+>)$", "", text.strip())
    start = re.search(r'(?:^|\n)\s*(?:```(?:json)?\s*|<\w+>\s*)?(\{\s*"name")', body)
    try:
        value = json.loads(body[start.start(1):] if start else body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("name") not in tools or not isinstance(value.get("arguments"), dict):
        return None
    return {"id": call_id, "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(value["arguments"])}}


def tool_specs(tools: list[dict]) -> list[dict]:
    """The tool service's ``tool.list`` entries in the OpenAI shape the ``chat`` message takes (not the tools
    of an MCP server that is down: a call would only fail)."""
    return [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                              "parameters": t["parameters"]}}
            for t in tools if t.get("available", True)]


def tool_output(body: dict) -> str:
    """The text of a ``tool.call`` reply (large outputs come through shared memory)."""
    if "output_shm" in body:
        return shm.take_bytes(body["output_shm"]).decode("utf-8", errors="replace")
    return body.get("output", "")


def _parsed(call: dict) -> tuple[CallRecord, dict | None]:
    """A call as the model made it, with its arguments as an object (None, and the call's error, when they are
    not one)."""
    fn = call.get("function") or {}
    raw = fn.get("arguments")
    done = CallRecord(str(fn.get("name")), raw if isinstance(raw, str) else json.dumps(raw))
    try:
        args = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError as err:
        done.error = f"the arguments are not valid JSON ({err.msg}); call the tool again with a JSON object"
        return done, None
    if not isinstance(args, dict):
        done.error = "the arguments must be a JSON object"
        return done, None
    return done, args


class Run:
    """One run's state and logic; ``pending`` is the request to carry next (None once ``trace`` is final)."""

    def __init__(self, config: Config, goal: str, session_id: str, max_iterations: int | None,
                 caller_tools: Sequence[dict] = (), instructions: str | None = None, earlier: Conversation | None = None,
                 steering: Steering = Steering(), priority: str | None = None, configured_tools: bool = True):
        """``caller_tools``: OpenAI tool specs whose calls go to the service ``caller`` (the run's own client);
        ``instructions``: the caller's system text, after the agent's own (which carries its tool policy);
        ``earlier``: the conversation this run goes on (``goal`` is then its last question); ``steering``: the
        caller's sampling and tool choice; ``priority``: the scheduling class of every model step
        (``shared.protocol.PRIORITIES``; None: the service's default); ``configured_tools``: offer the tool
        service's tools beside the caller's (a chat-completions client runs every call itself)."""
        self.config = config
        self.steering = steering
        self.priority = priority
        self.system = f"{SYSTEM_PROMPT}\n\n{instructions}" if instructions else SYSTEM_PROMPT
        self.caller_tools = list(caller_tools)
        self._caller_names = {t["function"]["name"] for t in self.caller_tools}
        self.configured_tools = configured_tools
        self.earlier = earlier
        self.history: list[Turn] = list(earlier.turns) if earlier else []  # the prompt's turns after the opening
        self.memory: WorkingMemory | None = None  # made at the run's start
        self.trace = Trace(goal, session_id)
        self.max_iterations = max_iterations or config.agent.max_iterations
        self._steps = self._loop()
        self.pending: ServiceCall | None = None
        self.advance(None)

    def advance(self, reply: Any) -> None:
        """Give the loop the pending request's reply (a ServiceError is raised inside it)."""
        try:
            self.pending = self._steps.throw(reply) if isinstance(reply, ServiceError) else self._steps.send(reply)
        except StopIteration:
            self.pending = None

    def _ask(self, service: str, msg_type: str, body: dict | None = None, in_session: bool = True,
             optional: bool = False) -> ServiceCall:
        return ServiceCall(service, msg_type, body or {}, self.trace.session_id if in_session else None, optional)

    # One generator whose state (history, calls made, the tool it insists on) lives across steps: splitting it
    # needs that state in an object first (issue 36), so it is the one function past ruff's complexity limit.
    def _loop(self) -> Generator[ServiceCall, Any, None]:  # noqa: C901
        trace = self.trace
        started = time.monotonic()
        try:
            steering = self.steering
            specs = [] if steering.tool_choice == "none" else (
                (tool_specs((yield self._ask("tools", "tool.list"))["tools"]) if self.configured_tools else [])
                + self.caller_tools)
            n_ctx = (yield self._ask("inference", "health")).get("n_ctx") or self.config.engine.n_ctx
            context = ContextManager(n_ctx, self.config.memory.budget, self.config.memory.summary_max_tokens)
            context.overhead = (yield from self._budgeted(context.count(json.dumps(specs)))) + _TEMPLATE_GUESS
            earlier = self.earlier
            trace.memories = list(earlier.memories) if earlier else (yield from self._recall())
            opening = earlier.opening if earlier else trace.goal
            tool_names = [t["function"]["name"] for t in specs]
            memory = self.memory = WorkingMemory(trace.goal, trace.memories, list(earlier.facts) if earlier else [],
                                                 compute_tool=COMPUTE_TOOL if COMPUTE_TOOL in tool_names else None)
            policy = StepPolicy(self.config.agent.policy, memory, specs)
            yield from self._asked(policy.begin())
            trace.language = policy.language
            checks = self.config.agent.answer_checks
            history = self.history
            made: dict[tuple[str, str], CallRecord] = {  # (tool, arguments) of each call already run for this question
                (tool, _canonical(arguments)): CallRecord(tool, arguments, result, valid=True)
                for tool, arguments, result in (memory.facts[len(memory.facts) - earlier.answering:] if earlier else [])}
            last_compressed, answer_now, forced, insist = -_COMPRESS_EVERY, False, None, None
            if earlier and earlier.answering:  # a run under way, re-sent by its client after its calls' results:
                history.append(Turn("user", _NEXT.format(note=policy.note()), note=True))  # told as its own run is
                answer_now = policy.answer_now()
            told: tuple[int, int] | None = None  # (history length, step) where a repeated call was answered
            for index in range(1, self.max_iterations + 1):
                t0 = time.monotonic()
                # The last step, and the step after a repeated call, must answer: no tool call can open.
                must_answer = answer_now or index == self.max_iterations
                if self._budget_left() == 0:
                    trace.stopped = "max_output_tokens"
                    break
                if must_answer and memory.facts:
                    step = yield from self._answer_from(policy.note(), index)
                    trace.answer, trace.stopped = step.content, FINAL_ANSWER
                    step.ms = round((time.monotonic() - t0) * 1000, 1)
                    break
                compress = index - last_compressed >= _COMPRESS_EVERY and (yield from self._advised_to_compress())
                built = yield from self._budgeted(context.build(self.system, opening, history,
                                                               memories=trace.memories, compress=compress))
                choice: str | dict = "none" if must_answer or not specs else "auto"
                if index == 1 and choice == "auto" and steering.tool_choice != "auto":  # the caller's, first step
                    choice = steering.tool_choice
                elif forced and choice == "auto":
                    choice = named(forced)
                elif insist and choice == "auto":  # after an answer sent back: the reader, or the calculator
                    choice = insist
                elif choice == "auto":
                    choice = policy.first_choice() or choice
                insist = None
                reply = yield from self._step_chat(built.messages, tools=specs or None, tool_choice=choice)
                context.observe(built, reply.stats.prompt_tokens)
                step = self._record(index, built, reply, compress)
                step.ms = round((time.monotonic() - t0) * 1000, 1)
                if reply.finish_reason == "length" and self._budget_left() == 0:  # cut by the run's cap
                    trace.stopped = "max_output_tokens"
                    break
                if compress and built.summarized_turns:
                    last_compressed = index
                message = msgspec.to_builtins(reply.message)  # the history holds plain maps (context.Turn)
                calls = message.get("tool_calls") or []
                if len(calls) > 1 and not steering.parallel_tool_calls:
                    calls = calls[:1]
                    message = {**message, "tool_calls": calls}
                written = (_written_call(step.content, tool_names, f"written-{index}")
                           if not calls and index < self.max_iterations else None)
                if written:  # a call written as the reply's text, not an answer: made as the model means it
                    calls, message = [written], {"role": "assistant", "content": "", "tool_calls": [written]}
                intended = (policy.intended_tool(step.content)
                            if specs and not made and forced is None and choice == "auto" else None)
                if not calls and intended and index < self.max_iterations:
                    # Before any tool ran, it wrote about a call (in prose, or as JSON no parser takes) instead of
                    # making it: once per run, ask again with that tool named, so the call comes out in the model's
                    # own format. (Once tools have run, a tool's name in a reply is a report of what was done.)
                    forced = step.intended = intended
                    continue
                forced = forced and ""  # a named call is asked for once
                verdict = ((yield from self._asked(policy.review(step.content), built, specs))
                           if not calls and step.content and checks and choice != "none" else None)
                if verdict and verdict.reasons:  # a candidate answer that does not stand: asked again, with why
                    checks -= 1  # (the answer itself stays out of the history: the model would copy it next time)
                    step.rejected = "; ".join(verdict.reasons)
                    history.append(Turn("user", _NOT_YET.format(note=policy.note(), reasons=step.rejected,
                                                                then=verdict.then), note=True))
                    insist = verdict.tool_choice
                    continue
                if not calls and not step.content:  # nothing said: not an answer; the next step answers from memory
                    answer_now = True
                    continue
                if not calls:
                    trace.answer, trace.stopped = step.content, FINAL_ANSWER
                    break
                keys = [(c["function"]["name"], _canonical(c["function"]["arguments"])) for c in calls]
                if len(keys) == 1 and memory.iterates(*keys[0]):  # a calculation run again on its own result
                    step.repeated = answer_now = True  # (the model had the answer one call ago): not run; answer
                    continue
                step.repeated = all(key in made for key in keys)  # it asks again for what it has: not run again
                if step.repeated and told is not None:  # told once already: the next step must answer
                    if told[1] == index - 1:  # right after being told: that did not help, so it is taken back
                        del history[told[0]:]  # (the prompt is then a prefix of the last: its KV stays)
                    answer_now = True
                    continue
                if step.repeated:  # once per run: the result again, with a note, in the call's place
                    told = (len(history), index)
                history.append(Turn("assistant", turn_text(message), message=message,  # as sent: the KV matches
                                    note=step.repeated))
                outcomes = [] if step.repeated else (yield from self._call_tools(calls, policy))
                for i, (call, key) in enumerate(zip(calls, keys)):
                    if step.repeated:
                        result = _REPEATED.format(output=_result(made[key]))
                    else:
                        done = made[key] = outcomes[i]
                        step.calls.append(done)
                        result = _result(done)
                        memory.add(done.name, done.arguments, result)
                    history.append(Turn("tool", result, message={"role": "tool", "tool_call_id": call.get("id"),
                                                                 "name": key[0], "content": result}, note=step.repeated))
                history.append(Turn("user", _NEXT.format(note=policy.note()), note=True))
                answer_now = policy.answer_now()
                step.ms = round((time.monotonic() - t0) * 1000, 1)
        except ServiceError as err:  # inference itself failed: the run cannot go on
            trace.stopped, trace.error = "error", f"{err.code}: {err.message}"
        trace.elapsed_s = round(time.monotonic() - started, 3)

    def conversation(self) -> Conversation:
        """The conversation as this run leaves it, its answer included: what its next user turn goes on. The
        agent's notes are left out, so a turn that goes on from it sees what a client re-sending the whole
        conversation sends, and answers as that client's run would."""
        said = [turn for turn in self.history if not turn.note]
        answer = [Turn("assistant", self.trace.answer)] if self.trace.answer else []
        return Conversation(self.earlier.opening if self.earlier else self.trace.goal, [*said, *answer],
                            list(self.trace.memories), list(self.memory.facts) if self.memory else [])

    def _chat(self, messages: list[dict], in_session: bool = True,
              **params: Any) -> Generator[ServiceCall, Any, ChatResult]:
        """A ``chat`` turn of this run, its request built as ``Client.chat`` builds one (the client that sends it
        moves a long conversation to shared memory); the configured model, seed 0, the run's priority."""
        session = self.trace.session_id if in_session else None
        body = chat_request(messages, model=self.config.agent.model, seed=0, priority=self.priority, **params)
        return read_result(ChatResult, (yield ServiceCall("inference", "chat", body, session)))

    def _step_chat(self, messages: list[dict], in_session: bool = True,
                   **params: Any) -> Generator[ServiceCall, Any, ChatResult]:
        """A step's ``chat`` turn: the caller's sampling, else the agent's; at most the tokens the run has left."""
        agent, steering = self.config.agent, self.steering
        temperature = agent.temperature if steering.temperature is None else steering.temperature
        left = self._budget_left()
        max_tokens = agent.max_step_tokens if left is None else min(agent.max_step_tokens, left)
        return (yield from self._chat(messages, in_session, max_tokens=max_tokens, temperature=temperature,
                                      top_p=steering.top_p, **params))

    def _budget_left(self) -> int | None:
        """Tokens the run may still generate (None: no cap but each step's)."""
        cap = self.steering.max_output_tokens
        return None if cap is None else max(0, cap - self.trace.output_tokens)

    def _answer_from(self, note: str, index: int) -> Generator[ServiceCall, Any, Step]:
        """The step that answers from the working memory's ``note`` alone (outside the session: its prompt is not
        the conversation's)."""
        messages = [{"role": "system", "content": _ANSWER_SYSTEM},
                    {"role": "user", "content": _ANSWER_NOW.format(note=note)}]
        reply = yield from self._step_chat(messages, in_session=False)
        return self._record(index, None, reply, False)

    def _record(self, index: int, built: BuiltPrompt | None, reply: ChatResult, compressed: bool) -> Step:
        step = Step(index, reply.content.strip(), prompt_tokens=reply.stats.prompt_tokens,
                    summarized_turns=built.summarized_turns if built else 0,
                    compressed=compressed and bool(built and built.summarized_turns))
        self.trace.steps.append(step)
        self._count(reply)
        return step

    def _count(self, reply: ChatResult) -> None:
        """Add a model turn's tokens to the trace's (a step's, or a question the policy asked)."""
        self.trace.prompt_tokens += reply.stats.prefill_tokens
        self.trace.cached_tokens += reply.stats.cached_tokens
        self.trace.output_tokens += reply.stats.completion_tokens

    def _call_tools(self, calls: list[dict], policy: StepPolicy) -> Generator[ServiceCall, Any, list[CallRecord]]:
        """Each call's outcome, in the step's order: the configured tools' run one at a time (unless the policy
        computes one itself: a calculator call over a table read), the caller's handed out together (one
        ``tool.calls`` request), as OpenAI's APIs hand a step's calls to their client."""
        parsed = [_parsed(call) for call in calls]
        theirs = [(done, args) for done, args in parsed if args is not None and done.name in self._caller_names]
        for done, args in parsed:
            if args is not None and done.name not in self._caller_names:
                if (computed := policy.computed(done.name, args)) is not None:
                    done.output, done.error, done.valid = computed.output, computed.error, True
                    continue
                try:
                    done.output = tool_output((yield self._ask("tools", "tool.call", {"tool": done.name, "args": args})))
                    done.valid = True
                except ServiceError as err:
                    done.error = f"{err.code}: {err.message}"
                    done.valid = err.code not in (ErrorCode.BAD_REQUEST, ErrorCode.NOT_FOUND)
        if theirs:
            try:
                outputs = (yield self._ask("caller", "tool.calls", {"calls": [
                    {"tool": done.name, "args": args} for done, args in theirs]}))["outputs"]
            except ServiceError as err:  # the caller's request failed as one: each of its calls with it
                for done, _ in theirs:
                    done.error = f"{err.code}: {err.message}"
            else:
                for (done, _), output in zip(theirs, outputs):
                    done.output, done.valid = output, True
        return [done for done, _ in parsed]

    def _recall(self) -> Generator[ServiceCall, Any, list[str]]:
        """Memories relevant to the goal, for the first prompt; none when retrieval is not running."""
        agent = self.config.agent
        if not agent.recall_k:
            return []
        try:
            hits = (yield self._ask("retrieval", "memory.query", {"collection": agent.memory_collection,
                                                                  "text": self.trace.goal, "k": agent.recall_k},
                                    optional=True))["hits"]
        except ServiceError as err:
            self.trace.warnings.append(f"recall: {err.code}: {err.message}")
            return []
        return [h["text"] for h in hits if h["score"] >= agent.recall_min_score]

    def _advised_to_compress(self) -> Generator[ServiceCall, Any, bool]:
        try:
            return bool((yield self._ask("optimizer", "optimizer.advice", optional=True)).get("compress"))
        except ServiceError:  # no optimizer running: nobody advises
            return False

    def _asked(self, questions: Generator[AskModel, Any, Any], built: BuiltPrompt | None = None,
               tools: list[dict] | None = None) -> Generator[ServiceCall, Any, Any]:
        """Carry the step policy's questions to the model; its result. A question about a candidate answer goes
        in the run's session after ``built`` (the prompt that answer replied to, with its ``tools``, so the
        template renders the same prefix) and the answer: only those two turns are prefilled, and the next
        prompt, which leaves them out, still reuses the KV before them. A question the run's token cap
        (``max_output_tokens``) has no room for is not asked: no answer to it."""
        def ask(op: AskModel) -> Generator[ServiceCall, Any, dict | None]:
            left = self._budget_left()
            if left is not None and left < _ASK_TOKENS:  # the caller's cap counts every token: no room to ask
                return None
            turn = [{"role": "user", "content": op.question}]
            params: dict[str, Any] = {}
            if op.about is not None and built is not None:
                messages, in_session = [*built.messages, {"role": "assistant", "content": op.about}, *turn], True
                if tools:
                    params = {"tools": tools, "tool_choice": "none"}
            else:
                messages, in_session = turn, False
            reply = yield from self._chat(messages, in_session, max_tokens=_ASK_TOKENS, temperature=0.0,
                                          response_format={"type": "json_schema",
                                                           "json_schema": {"name": "reply", "schema": op.schema}},
                                          **params)
            self._count(reply)
            try:
                value = json.loads(reply.content)
            except json.JSONDecodeError:  # cut by the token cap: no answer to the question
                return None
            return value if isinstance(value, dict) else None
        return (yield from translate(questions, ask))

    def _budgeted(self, build: Generator[Operation, Any, Any]) -> Generator[ServiceCall, Any, Any]:
        """Carry the context budget's operations out as service requests; its result."""
        return (yield from translate(build, self._answer))

    def _answer(self, op: Operation) -> Generator[ServiceCall, Any, Any]:
        if isinstance(op, Count):
            return len((yield self._ask("inference", "tokenize", {"text": op.text}))["tokens"])
        if isinstance(op, Summarize):
            return (yield from self._summarize(op))
        return (yield from self._remember(op.turns))

    def _summarize(self, op: Summarize) -> Generator[ServiceCall, Any, str]:
        messages = [{"role": "user", "content": f"{transcript(op.turns)}\n\n{_SUMMARY_PROMPT}"}]
        reply = yield from self._chat(messages, in_session=False, max_tokens=op.max_tokens, temperature=0.0)
        return reply.content

    def _remember(self, turns: tuple[Turn, ...]) -> Generator[ServiceCall, Any, None]:
        """Write summarized turns verbatim to long-term memory; a failure is a warning, the run goes on."""
        items = [{"id": f"{self.trace.session_id}-{t.key}", "text": t.text,
                  "metadata": {"role": t.role, "session": self.trace.session_id, "kind": "turn"}}
                 for t in {t.key: t for t in turns}.values()]
        try:
            yield self._ask("retrieval", "memory.upsert_many", {"collection": self.config.agent.memory_collection,
                                                                "items": items}, optional=True)
        except ServiceError as err:
            self.trace.warnings.append(f"remember: {err.code}: {err.message}")
            log.warning("turns_not_remembered", session=session_ref(self.trace.session_id), code=err.code,
                        turns=len(items))
