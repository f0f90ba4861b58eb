"""The agent benchmark's three systems, each running a list of tasks in one session (Magnitude) or one slot
(llama-server), so all reuse the shared prompt prefix: Magnitude's agent over ZeroMQ, the same loop behind the
gateway's ``/v1/responses`` read with urllib, and the loop a user writes with the ``openai`` client against
llama-server. Each returns a ``Phase`` of graded ``Outcome``s."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from magnitude import launcher
from magnitude.agent import SYSTEM_PROMPT, Agent, tool_output, tool_specs
from scripts.bench import REPO
from scripts.bench.agent.grader import correct
from scripts.bench.agent.tasks import KINDS, Task
from shared import process
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
                 policy: dict | None = None) -> Config:
    """The stack the agent bench runs; ``policy``: settings of ``agent.policy`` (the ablation's switches)."""
    return parse_config({
        "engine": {"model_path": str(model_path), "n_ctx": n_ctx, "session_slots": 2, "self_optimize": False},
        "agent": {"tools": [{"name": "calculator"}, {"name": "file_reader"}, {"name": "memory_search"}],
                  "mcp_servers": [MCP_SERVER] if mcp else [],
                  "file_roots": [str(home / "files")], "max_iterations": max_steps, "max_step_tokens": max_tokens,
                  "policy": policy or {}},
        "runtime": {"runtime_dir": str(home / "run"), "data_dir": str(home / "data")},
        "metrics": {"enabled": False}, "watchdog": {"enabled": False},
    })



def start(config: Config, path: Path, names: tuple[str, ...]) -> None:
    for name in names:
        status = launcher.start(config, name, str(path), progress=lambda m: print(m, file=sys.stderr))
        if not status.healthy:
            raise SystemExit(f"{name} did not start: {status.error}")


def run_magnitude(config: Config, tasks: list[Task], tag: str) -> Phase:
    phase, agent = Phase("magnitude"), Agent(config, timeout_s=600)
    try:
        for i, task in enumerate(tasks, 1):
            t0 = time.monotonic()
            trace = agent.run(task.goal, session_id=f"bench-{tag}")
            calls = [c for s in trace.steps for c in s.calls]
            outcome = Outcome(task, trace.answer, len(trace.steps), len(calls), sum(c.valid for c in calls),
                              time.monotonic() - t0, trace.error, trace.to_dict()["steps"])
            phase.outcomes.append(outcome)
            progress("magnitude", i, len(tasks), outcome)
    finally:
        agent.close()
    return phase


def run_http(config: Config, home: Path, tasks: list[Task]) -> Phase:
    """Each task through the gateway's ``POST /v1/responses`` (started here on an ephemeral port), read with
    urllib; a call counts as valid when the gateway reports no error for it."""
    config = config.model_copy(update={"gateway": config.gateway.model_copy(update={"port": 0})})
    path = home / "gateway.yaml"
    path.write_text(dump_config(config))
    start(config, path, ("gateway",))
    phase = Phase("http")
    try:
        with Client.for_service("gateway", config, timeout_s=10) as gateway:
            url = gateway.health()["url"]
        for i, task in enumerate(tasks, 1):
            t0 = time.monotonic()
            request = urllib.request.Request(f"{url}/v1/responses", data=json.dumps({"input": task.goal}).encode(),
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=600) as reply:
                    response = json.load(reply)
                items = response["output"]
                calls = [item for item in items if item["type"] == "tool_call"]
                texts = [item["content"][0]["text"] for item in items if item["type"] == "message"]
                outcome = Outcome(task, texts[-1] if texts and response["status"] == "completed" else None,
                                  max((item["step"] for item in items), default=0), len(calls),
                                  sum(c["error"] is None for c in calls), time.monotonic() - t0,
                                  (response.get("error") or {}).get("message"), items)
            except (OSError, ValueError) as err:  # refused or failed: this task failed, the bench goes on
                outcome = Outcome(task, None, 0, 0, 0, time.monotonic() - t0, f"{type(err).__name__}: {err}"[:300])
            phase.outcomes.append(outcome)
            progress("http", i, len(tasks), outcome)
    finally:
        process.stop(config, "gateway")
    return phase


# --- the peer: the ordinary loop on llama-server ------------------------------------------------------
def peer_task(client, tools: Client, specs: list[dict], task: Task, max_steps: int, max_tokens: int,
              model: str = "local") -> Outcome:
    """The loop a user writes against an OpenAI-compatible server (``model``: the name it serves)."""
    t0 = time.monotonic()
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.goal}]
    calls = valid = steps = 0
    answer = error = None
    try:
        for steps in range(1, max_steps + 1):
            reply = client.chat.completions.create(model=model, messages=messages, tools=specs, temperature=0,
                                                   seed=0, max_tokens=max_tokens)
            message = reply.choices[0].message
            if not message.tool_calls:
                answer = message.content
                break
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                calls += 1
                try:
                    result = tool_output(tools.request("tool.call", {"tool": call.function.name,
                                                                     "args": json.loads(call.function.arguments)}))
                    valid += 1
                except (json.JSONDecodeError, TypeError) as err:
                    result = f"Error: the arguments are not valid JSON ({err})"
                except ServiceError as err:
                    valid += err.code not in ("bad_request", "not_found")
                    result = f"Error: {err.code}: {err.message}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    except Exception as err:  # the server refused or failed: this task failed, the bench goes on
        error = f"{type(err).__name__}: {err}"[:300]
    return Outcome(task, answer, steps, calls, valid, time.monotonic() - t0, error)


def run_peer(base_url: str, config: Config, tasks: list[Task], max_steps: int, max_tokens: int) -> Phase:
    import openai
    phase = Phase("peer")
    client = openai.OpenAI(base_url=base_url, api_key="none", timeout=600, max_retries=0)
    with Client.for_service("tools", config, timeout_s=60) as tools:
        specs = tool_specs(tools.request("tool.list")["tools"])
        for i, task in enumerate(tasks, 1):
            outcome = peer_task(client, tools, specs, task, max_steps, max_tokens)
            phase.outcomes.append(outcome)
            progress("peer", i, len(tasks), outcome)
    return phase

