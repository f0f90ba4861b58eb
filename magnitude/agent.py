"""The agent loop: ``Agent(config).run(goal)`` / ``await AsyncAgent(config).run(goal)`` return a ``Trace``.

One run is one session: the whole run is a single growing Gemma prompt sent
with one ``session_id``, so each step prefills only what is new. A step is a
free ``Thought:`` line, then an ``Action:`` whose JSON is grammar-constrained
(or parsed and repaired with one retry when ``agent.grammar`` is off), then the
tool's ``Observation:``. The loop stops at ``final_answer`` or after
``max_iterations``. The loop itself is a generator of operations, so the sync
and asyncio drivers share every line of logic.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Generator

from shared.client import AsyncClient, Client, Retry, ServiceError
from magnitude.prompts import gemma_turn
from magnitude.toolcall import ActionError, ActionParser, action_grammar
from shared import shm
from shared.config import FINAL_ANSWER, Config, load_config

#: Observations longer than this are cut before they enter the prompt (the context is small).
MAX_OBSERVATION_CHARS = 1200
_THOUGHT_TOKENS = 64


@dataclass
class Step:
    index: int
    thought: str
    action: dict | None
    observation: str
    error: str | None = None  # why the action failed to parse or the tool failed
    retried: bool = False  # the repair layer asked the model again
    ms: float = 0.0


@dataclass
class Trace:
    goal: str
    session_id: str
    steps: list[Step] = field(default_factory=list)
    answer: str | None = None
    stopped: str = "max_iterations"  # final_answer | max_iterations | error
    error: str | None = None
    elapsed_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def _signature(schema: dict) -> str:
    props = schema.get("properties", {})
    return json.dumps({k: v.get("enum", v.get("type", "any")) for k, v in props.items()})


#: Few-shot runs for the built-ins, shown when the tool is configured: (task, thought, args, observation, answer).
_EXAMPLES = {
    "calculator": ("What is 12 * 9?", "This is arithmetic, so I use calculator.", {"expression": "12 * 9"},
                   "108", "108"),
    "file_reader": ("What does the file plan.txt say?", "This is about a file, so I use file_reader.",
                    {"path": "plan.txt"}, "Water the plants.", "It says: Water the plants."),
    "memory_search": ("Where did I park the car?", "I must remember something, so I use memory_search.",
                      {"query": "where I parked the car"}, "- parked on level 2 (score 0.81)", "On level 2."),
}


def _example(tool: str) -> list[str]:
    task, thought, args, observation, answer = _EXAMPLES[tool]
    return [f"Task: {task}", f"Thought: {thought}", f"Action: {json.dumps({'tool': tool, 'args': args})}",
            f"Observation: {observation}", "Thought: Now I know the answer.",
            f"Action: {json.dumps({'tool': FINAL_ANSWER, 'args': {'answer': answer}})}", ""]


def _instructions(tools: list[dict], goal: str) -> str:
    lines = ["You solve tasks step by step using tools. Tools:"]
    lines += [f"- {t['name']}: {t['description']} Args: {_signature(t['parameters'])}" for t in tools]
    lines += [f'- {FINAL_ANSWER}: Give the final answer to the task. Args: {{"answer": "string"}}',
              "", "Each step is one line 'Thought: ...' and one line 'Action: ' with a JSON object "
              '{"tool": ..., "args": {...}}. You then get an Observation. When you know the answer, '
              f"use {FINAL_ANSWER}. Pick the tool whose description fits the task.", "", "Examples:"]
    for t in tools:
        if t["name"] in _EXAMPLES:
            lines += _example(t["name"])
    lines.append(f"Task: {goal}")
    return "\n".join(lines)


class _Loop:
    """The run's state and logic; yields ("generate", prompt, params) and ("tool", name, args) operations."""

    def __init__(self, config: Config, tools: list[dict], max_iterations: int | None, grammar: bool | None):
        self.config = config
        self.tools = tools
        self.max_iterations = max_iterations or config.agent.max_iterations
        self.use_grammar = config.agent.grammar if grammar is None else grammar
        self.parser = ActionParser(tools)
        self.grammar = action_grammar(tools) if self.use_grammar else None

    def _params(self, max_tokens: int, stop: list[str], grammar: str | None = None) -> dict:
        return {"max_tokens": max_tokens, "temperature": self.config.agent.temperature, "seed": 0,
                "stop": stop, "grammar": grammar}

    def _action(self, trace: Trace, prompt: str) -> Generator:
        """Generate and parse one Action; with grammar off, one retry with the error fed back."""
        result = yield ("generate", prompt, self._params(self.config.agent.max_step_tokens,
                                                         ["\n", "<end_of_turn>"], self.grammar))
        self._count(trace, result)
        try:
            return result.text, self.parser.parse(result.text), None, False
        except ActionError as err:
            if self.use_grammar:
                return result.text, None, f"invalid action under grammar: {err}", False
            first_error = str(err)
        retry = (f"{prompt}{result.text}\nObservation: Invalid Action ({first_error}). "
                 "Write the Action again as one JSON object.\nAction: ")
        again = yield ("generate", retry, self._params(self.config.agent.max_step_tokens, ["\n", "<end_of_turn>"]))
        self._count(trace, again)
        try:
            return again.text, self.parser.parse(again.text), None, True
        except ActionError as err:
            return again.text, None, f"invalid action after retry: {err}", True

    @staticmethod
    def _count(trace: Trace, result) -> None:
        trace.prompt_tokens += result.stats.get("prefill_tokens", 0)
        trace.cached_tokens += result.stats.get("cached_tokens", 0)

    def run(self, goal: str, session_id: str) -> Generator[tuple, Any, Trace]:
        trace = Trace(goal, session_id)
        started = time.monotonic()
        prompt = gemma_turn("user", _instructions(self.tools, goal)) + "<start_of_turn>model\nThought:"
        try:
            for index in range(1, self.max_iterations + 1):
                t0 = time.monotonic()
                thought = yield ("generate", prompt, self._params(_THOUGHT_TOKENS, ["\n", "Action:"]))
                self._count(trace, thought)
                prompt += thought.text.rstrip() + "\nAction: "
                text, action, error, retried = yield from self._action(trace, prompt)
                prompt += text.strip()
                step = Step(index, thought.text.strip(), action, "", error, retried)
                trace.steps.append(step)
                if action is not None and action["tool"] == FINAL_ANSWER:
                    trace.answer, trace.stopped = action["args"]["answer"], "final_answer"
                    step.ms = round((time.monotonic() - t0) * 1000, 1)
                    break
                if action is not None:
                    try:
                        reply = yield ("tool", action["tool"], action["args"])
                        step.observation = reply
                    except ServiceError as err:
                        step.error = f"{err.code}: {err.message}"
                step.observation = step.observation or f"Error: {step.error}"
                if len(step.observation) > MAX_OBSERVATION_CHARS:
                    step.observation = step.observation[:MAX_OBSERVATION_CHARS] + " [cut]"
                prompt += f"\nObservation: {step.observation}\nThought:"
                step.ms = round((time.monotonic() - t0) * 1000, 1)
        except ServiceError as err:  # inference itself failed: the run cannot go on
            trace.stopped, trace.error = "error", f"{err.code}: {err.message}"
        trace.elapsed_s = round(time.monotonic() - started, 3)
        return trace


def _advance(gen: Generator, value: Any) -> tuple:
    """Give the loop the last operation's result (a ServiceError is raised inside it); the next operation."""
    try:
        return gen.throw(value) if isinstance(value, ServiceError) else gen.send(value)
    except StopIteration as done:
        return ("done", done.value)


def _tool_output(body: dict) -> str:
    if "output_shm" in body:
        return shm.take_bytes(body["output_shm"]).decode("utf-8", errors="replace")
    return body.get("output", "")


class _AgentBase:
    client_cls: type = Client

    def __init__(self, config: Config | None = None, timeout_s: float = 300.0, retry: Retry | None = None):
        """``retry``: re-send each generate and tool call on transient failures (e.g. a service restart)."""
        self.config = config or load_config()
        self.retry = retry
        self.inference = self.client_cls.for_service("inference", self.config, timeout_s=timeout_s)
        self.tools = self.client_cls.for_service("tools", self.config, timeout_s=timeout_s)

    def _start(self, tools: list[dict], goal: str, session_id: str | None, max_iterations: int | None,
               grammar: bool | None) -> tuple[Generator, str, tuple]:
        session_id = session_id or f"agent-{uuid.uuid4().hex[:12]}"
        gen = _Loop(self.config, tools, max_iterations, grammar).run(goal, session_id)
        return gen, session_id, _advance(gen, None)

    def close(self) -> None:
        self.inference.close()
        self.tools.close()


class Agent(_AgentBase):
    """Blocking agent over the inference and tool services."""

    def run(self, goal: str, session_id: str | None = None, max_iterations: int | None = None,
            grammar: bool | None = None) -> Trace:
        tools = self.tools.request("tool.list", retry=self.retry)["tools"]
        gen, session_id, op = self._start(tools, goal, session_id, max_iterations, grammar)
        while op[0] != "done":
            try:
                if op[0] == "generate":
                    value = self.inference.generate(op[1], session_id, retry=self.retry, **op[2])
                else:
                    value = _tool_output(self.tools.request("tool.call", {"tool": op[1], "args": op[2]}, session_id,
                                                            retry=self.retry))
            except ServiceError as err:
                value = err
            op = _advance(gen, value)
        return op[1]


class AsyncAgent(_AgentBase):
    """asyncio agent for robot software: same as ``Agent``, awaitable."""

    client_cls = AsyncClient

    async def run(self, goal: str, session_id: str | None = None, max_iterations: int | None = None,
                  grammar: bool | None = None) -> Trace:
        tools = (await self.tools.request("tool.list", retry=self.retry))["tools"]
        gen, session_id, op = self._start(tools, goal, session_id, max_iterations, grammar)
        while op[0] != "done":
            try:
                if op[0] == "generate":
                    value = await self.inference.generate(op[1], session_id, retry=self.retry, **op[2])
                else:
                    body = await self.tools.request("tool.call", {"tool": op[1], "args": op[2]}, session_id,
                                                    retry=self.retry)
                    value = _tool_output(body)
            except ServiceError as err:
                value = err
            op = _advance(gen, value)
        return op[1]


def submit_feedback(session_id: str, success: bool, error_reason: str | None = None,
                    details: dict | None = None, config: Config | None = None) -> dict:
    """Tell the optimizer how a run went; returns its ack once the record is on disk."""
    with Client.for_service("optimizer", config or load_config(), timeout_s=10.0) as client:
        return client.request("feedback", {"session_id": session_id, "success": success,
                                           "error_reason": error_reason, "details": details})
