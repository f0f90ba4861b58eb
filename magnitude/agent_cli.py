"""``magnitude run "goal"`` (the agent loop), ``magnitude tools`` and ``magnitude feedback``."""

from __future__ import annotations

import json
import sys

from magnitude.agent import Agent, Trace, submit_feedback
from shared import catalog
from shared.client import Client, ServiceError
from shared.config import FINAL_ANSWER


def print_trace(trace: Trace) -> None:
    if trace.memories:
        print("recalled: " + " | ".join(trace.memories))
    for s in trace.steps:
        note = f" (history: {s.summarized_turns} turn(s) summarized{', compressed' if s.compressed else ''})" \
            if s.summarized_turns else ""
        print(f"[{s.index}] {s.content or '(no text)'}{note}")
        for call in s.calls:
            print(f"    {call.name}({call.arguments}) -> {call.output if call.error is None else 'Error: ' + call.error}")
    print(f"stopped: {trace.stopped} after {len(trace.steps)} step(s) in {trace.elapsed_s}s "
          f"(session {trace.session_id}, prefilled {trace.prompt_tokens}, reused {trace.cached_tokens} tokens)")
    for warning in trace.warnings:
        print(f"warning: {warning}")
    if trace.error:
        print(f"error: {trace.error}")
        if "no chat template" in trace.error:
            print(f"hint: the agent needs an instruct model: `magnitude models pull {catalog.DEFAULT_AGENT_MODEL}` "
                  "(the engine's default when engine.model_path is unset), or add one to engine.models and set "
                  "agent.model (docs/agents.md)")
    if trace.answer is not None:
        print(f"answer: {trace.answer}")


def cmd_run(args, config) -> int:
    agent = Agent(config, timeout_s=args.timeout)
    try:
        trace = agent.run(args.goal, session_id=args.session, max_iterations=args.max_iterations)
    except ServiceError as err:
        print(f"error: {err} (is the stack up? `magnitude up`)", file=sys.stderr)
        return 1
    finally:
        agent.close()
    if args.json:
        print(json.dumps(trace.to_dict(), indent=2))
    else:
        print_trace(trace)
    return 0 if trace.stopped == FINAL_ANSWER else 1


def cmd_tools(args, config) -> int:
    try:
        with Client.for_service("tools", config, timeout_s=10) as client:
            tools = client.request("tool.list")["tools"]
            servers = client.health().get("mcp", {})
    except ServiceError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for t in tools:
        kind = f"mcp:{t['server']}" if t["kind"] == "mcp" else t["kind"]
        note = "" if t.get("available", True) else " (unavailable: its server is down)"
        print(f"{t['name']:<16} {kind:<12} {t['description']}{note}  {json.dumps(t['parameters'])}")
    for name, s in servers.items():
        if s["state"] != "up":
            print(f"MCP server {name} is {s['state']}: {s['last_error'] or 'starting'}"
                  + (f"; next start in {s['next_start_s']} s" if "next_start_s" in s else ""))
    return 0


def cmd_feedback(args, config) -> int:
    try:
        ack = submit_feedback(args.session, not args.failed, args.reason, config=config)
    except ServiceError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(ack))
    return 0


def register(sub) -> None:
    p = sub.add_parser("run", help="run the agent loop on a goal and print its trace")
    p.add_argument("goal")
    p.add_argument("--max-iterations", type=int, help="default: agent.max_iterations")
    p.add_argument("--session", help="session id for the run (default: a new one)")
    p.add_argument("--json", action="store_true", help="print the trace as JSON")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per service call")
    p.set_defaults(fn=cmd_run)
    sub.add_parser("tools", help="list the tools the tool service offers").set_defaults(fn=cmd_tools)
    p = sub.add_parser("feedback", help="report a run's outcome to the optimizer")
    p.add_argument("session")
    p.add_argument("--failed", action="store_true", help="the run failed (default: it succeeded)")
    p.add_argument("--reason", help="why it failed")
    p.set_defaults(fn=cmd_feedback)
