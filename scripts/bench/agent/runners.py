"""The agent benchmark's systems, each running a list of tasks one after the other: Magnitude's agent over ZeroMQ
(in one session, so the shared prompt prefix is reused), the same loop behind the gateway's ``/v1/responses``
read with urllib, and the loop a user writes with the ``openai`` client (against llama-server in one slot, or the
gateway's chat completions). Each returns a ``Phase`` of graded ``Outcome``s; the frameworks are in
frameworks.py."""

from __future__ import annotations

import contextlib
import json
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from magnitude import launcher
from magnitude.agent import SYSTEM_PROMPT, Agent, tool_output, tool_specs
from scripts.bench import REPO
from scripts.bench.agent.grader import correct
from scripts.bench.agent.tasks import KINDS, Task
from shared import process
from services.gateway.keys import read_local_key
from shared.client import Client, ServiceError
from shared.config import Config, dump_config, parse_config

#: The MCP server the mcp tasks need, as a robot program would configure it.
MCP_SERVER = {"name": "home", "command": [sys.executable, str(REPO / "examples" / "mcp" / "home_robot.py")],
              "roots": [str(REPO / "examples" / "mcp")]}


# --- results ---------------------------------------------------------------------------------------
@dataclass
class Outcome:
    task: Task
    answer: str | None
    steps: int
    calls: int
    valid_calls: int
    seconds: float
    error: str | None = None
    trace: list[dict] | None = None  # Magnitude's steps (text, calls, outputs), for reading why a task failed

    @property
    def ok(self) -> bool:
        return correct(self.answer, self.task.expected, self.task.language)


@dataclass
class Phase:
    system: str
    outcomes: list[Outcome] = field(default_factory=list)

    def summary(self) -> dict:
        n = len(self.outcomes) or 1
        calls = sum(o.calls for o in self.outcomes)
        return {"solved": sum(o.ok for o in self.outcomes), "tasks": len(self.outcomes),
                "valid_call_rate": sum(o.valid_calls for o in self.outcomes) / calls if calls else None,
                "calls": calls, "steps_per_task": sum(o.steps for o in self.outcomes) / n,
                "seconds_per_task": sum(o.seconds for o in self.outcomes) / n,
                "by_kind": {k: [sum(o.ok for o in self.outcomes if o.task.kind == k),
                                sum(o.task.kind == k for o in self.outcomes)] for k in KINDS},
                "by_set": _scores(self.outcomes, lambda t: t.set),
                "by_language": _scores(self.outcomes, lambda t: f"{t.set}/{t.language}")}


def _scores(outcomes: list[Outcome], group) -> dict[str, list[int]]:
    """[solved, tasks] per group of tasks, in the order the groups first appear."""
    return {g: [sum(o.ok for o in outcomes if group(o.task) == g), sum(group(o.task) == g for o in outcomes)]
            for g in dict.fromkeys(group(o.task) for o in outcomes)}


def progress(phase: str, i: int, n: int, o: Outcome) -> None:
    mark = "ok  " if o.ok else "FAIL"
    print(f"  [{phase} {i}/{n}] {mark} {o.seconds:5.1f}s {o.steps} step(s) {o.valid_calls}/{o.calls} valid calls  "
          f"{o.task.goal[:48]!r} -> {(o.answer or o.error or '')[:70]!r}", file=sys.stderr, flush=True)



# --- the stack -------------------------------------------------------------------------------------
def bench_config(home: Path, model_path: Path, n_ctx: int, max_steps: int, max_tokens: int, mcp: bool,
                 policy: dict | None = None, embedding_model: str | None = None,
                 recall_min_score: float | None = None) -> Config:
    """The stack the agent bench runs; ``policy``: settings of ``agent.policy`` (the ablation's switches);
    ``embedding_model``: the encoder memories are recalled with; ``recall_min_score``: the score a recalled
    memory needs (None: the configuration's default, for either; each encoder has its own scale)."""
    return parse_config({
        "engine": {"model_path": str(model_path), "n_ctx": n_ctx, "session_slots": 2, "self_optimize": False},
        "agent": {"tools": [{"name": "calculator"}, {"name": "file_reader"}, {"name": "memory_search"}],
                  "mcp_servers": [MCP_SERVER] if mcp else [],
                  "file_roots": [str(home / "files")], "max_iterations": max_steps, "max_step_tokens": max_tokens,
                  "policy": policy or {},
                  **({} if recall_min_score is None else {"recall_min_score": recall_min_score})},
        "memory": {} if embedding_model is None else {"embedding_model": embedding_model},
        "runtime": {"runtime_dir": str(home / "run"), "data_dir": str(home / "data")},
        "metrics": {"enabled": False}, "watchdog": {"enabled": False},
    })



def start(config: Config, path: Path, names: tuple[str, ...]) -> None:
    for name in names:
        status = launcher.start(config, name, str(path), progress=lambda m: print(m, file=sys.stderr))
        if not status.healthy:
            raise SystemExit(f"{name} did not start: {status.error}")


def run_phase(system: str, tasks: list[Task], run_task: Callable[[Task], Outcome]) -> Phase:
    """Every task through one system, one after the other, with a progress line each."""
    phase = Phase(system)
    for i, task in enumerate(tasks, 1):
        phase.outcomes.append(run_task(task))
        progress(system, i, len(tasks), phase.outcomes[-1])
    return phase


def run_magnitude(config: Config, tasks: list[Task], tag: str) -> Phase:
    agent = Agent(config, timeout_s=600)

    def run_task(task: Task) -> Outcome:
        t0 = time.monotonic()
        trace = agent.run(task.goal, session_id=f"bench-{tag}")
        calls = [c for s in trace.steps for c in s.calls]
        return Outcome(task, trace.answer, len(trace.steps), len(calls), sum(c.valid for c in calls),
                       time.monotonic() - t0, trace.error, trace.to_dict()["steps"])
    try:
        return run_phase("magnitude", tasks, run_task)
    finally:
        agent.close()


@contextlib.contextmanager
def gateway(config: Config, home: Path):
    """The stack's gateway on an ephemeral loopback port: (its URL, the key its first start made)."""
    config = config.model_copy(update={"gateway": config.gateway.model_copy(update={"port": 0})})
    path = home / "gateway.yaml"
    path.write_text(dump_config(config))
    start(config, path, ("gateway",))
    try:
        with Client.for_service("gateway", config, timeout_s=10) as client:
            yield client.health()["url"], read_local_key(config)
    finally:
        process.stop(config, "gateway")


def http_task(url: str, key: str, task: Task) -> Outcome:
    """One task POSTed to ``/v1/responses`` with urllib, as agent software in any language would; a call counts
    as valid when the gateway reports no error for it."""
    t0 = time.monotonic()
    request = urllib.request.Request(f"{url}/v1/responses", data=json.dumps({"input": task.goal}).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=600) as reply:
            response = json.load(reply)
    except (OSError, ValueError) as err:  # refused or failed: this task failed, the bench goes on
        return Outcome(task, None, 0, 0, 0, time.monotonic() - t0, f"{type(err).__name__}: {err}"[:300])
    items = response["output"]
    calls = [item for item in items if item["type"] == "tool_call"]
    texts = [item["content"][0]["text"] for item in items if item["type"] == "message"]
    return Outcome(task, texts[-1] if texts and response["status"] == "completed" else None,
                   max((item["step"] for item in items), default=0), len(calls),
                   sum(c["error"] is None for c in calls), time.monotonic() - t0,
                   (response.get("error") or {}).get("message"), items)


# --- the plain tool loop a user writes with the openai client (llama-server, or the gateway's chat path) -----
class ToolBox:
    """The stack's tools as a client's own function tools: every call runs through the bench's tool service,
    counted per task (a call is valid unless its arguments are refused)."""

    def __init__(self, tools: Client):
        self.tools = tools
        self.specs = [spec["function"] for spec in tool_specs(tools.request("tool.list")["tools"])]
        self.start_task()

    def start_task(self) -> None:
        self.calls = self.valid = 0
        self.log: list[dict] = []

    def call(self, name: str, arguments: str | dict) -> str:
        """The tool's output, or its error as text the model reads (as a framework hands a failing tool's)."""
        self.calls += 1
        try:
            args = json.loads(arguments) if isinstance(arguments, str) else arguments
            output = tool_output(self.tools.request("tool.call", {"tool": name, "args": args}))
            self.valid += 1
        except (json.JSONDecodeError, TypeError) as err:
            output = f"Error: the arguments are not valid JSON ({err})"
        except ServiceError as err:
            self.valid += err.code not in ("bad_request", "not_found")
            output = f"Error: {err.code}: {err.message}"
        self.log.append({"name": name, "arguments": arguments, "output": output[:300]})
        return output


def peer_task(client, box: ToolBox, task: Task, max_steps: int, max_tokens: int | None, model: str = "local",
              system: str | None = SYSTEM_PROMPT) -> Outcome:
    """The loop a user writes against an OpenAI-compatible server (``model``: the name it serves; ``system``: the
    system prompt it sends, none for the agent alias, whose loop has its own)."""
    t0 = time.monotonic()
    box.start_task()
    messages = [{"role": "system", "content": system}] * bool(system) + [{"role": "user", "content": task.goal}]
    specs = [{"type": "function", "function": spec} for spec in box.specs]
    steps, answer, error = 0, None, None
    try:
        for steps in range(1, max_steps + 1):
            reply = client.chat.completions.create(model=model, messages=messages, tools=specs, temperature=0,
                                                   seed=0, **({"max_tokens": max_tokens} if max_tokens else {}))
            message = reply.choices[0].message
            if not message.tool_calls:
                answer = message.content
                break
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": box.call(call.function.name, call.function.arguments)})
    except Exception as err:  # the server refused or failed: this task failed, the bench goes on
        error = f"{type(err).__name__}: {err}"[:300]
    return Outcome(task, answer, steps, box.calls, box.valid, time.monotonic() - t0, error, box.log)


def run_peer(base_url: str, config: Config, tasks: list[Task], max_steps: int, max_tokens: int) -> Phase:
    import openai
    client = openai.OpenAI(base_url=base_url, api_key="none", timeout=600, max_retries=0)
    with Client.for_service("tools", config, timeout_s=60) as tools:
        box = ToolBox(tools)
        return run_phase("peer", tasks, lambda task: peer_task(client, box, task, max_steps, max_tokens))
