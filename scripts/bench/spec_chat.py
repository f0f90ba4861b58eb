"""Speculative decoding on agent chat traces: off vs prompt lookup vs a draft model, side by side in one run.

Agents echo their context: a file read in one step is written back with one change in the
next, readings from a log become a calculator expression. Each trace here is a scripted
chat session with tools (canned, deterministic tool results) on the target model
(default: the catalog's default agent model, Qwen2.5-Coder-1.5B-Instruct), and each
mode runs every trace: drafting off, prompt lookup (``spec_drafter: lookup``), and the
draft model (``spec_drafter: model``, ``engine.draft_model_path``: Qwen2.5-Coder-0.5B,
the same vocabulary). Modes alternate per repetition on one service (``engine.configure``
switches them hot); temperature 0, so each mode must write the same text.

    .venv/bin/python -m scripts.bench.spec_chat [--model qwen2.5-coder-1.5b] [--draft qwen2.5-coder-0.5b]
        [--reps 2] [--lookup-tokens 8] [--model-tokens 4]
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import statistics
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench.common import start_inference, stop
from shared import catalog

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a text file.", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "write_file", "description": "Write a whole text file.",
                                      "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string"}, "text": {"type": "string"}},
                                          "required": ["path", "text"]}}},
    {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}},
]
FILES = {
    "geometry.py": '''"""Shapes for the floor planner."""

import math


def circle_area(r):
    """Area of a circle of radius r."""
    return math.pi * r * 2


def rectangle_area(w, h):
    """Area of a w by h rectangle."""
    return w * h


def room_area(shapes):
    """Total area of a room made of shapes."""
    return sum(shape.area() for shape in shapes)
''',
    "config.json": json.dumps({"robot": {"name": "rover-7", "max_speed": 0.5, "battery_min": 0.2,
                                         "rooms": ["kitchen", "hallway", "bedroom", "office"],
                                         "camera": {"fps": 15, "resolution": "640x480"}}}, indent=2),
    "battery.log": "\n".join(f"08:{m:02d} battery {v}%" for m, v in ((0, 97), (15, 91), (30, 84), (45, 80))),
}
TASKS = [
    "Fix the bug in geometry.py (circle_area is wrong) and save the fixed file.",
    "Set the robot's max_speed to 0.8 in config.json and save it.",
    "Read battery.log, add up the four battery readings with the calculator, and tell me the total.",
]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _calculate(expression: str) -> str:
    def walk(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError("only + - * / on numbers")
    try:
        return str(walk(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as err:
        return f"error: {err}"


def run_tool(name: str, args: dict) -> str:
    if name == "read_file":
        return FILES.get(str(args.get("path")), "error: no such file")
    if name == "write_file":
        return f"wrote {len(str(args.get('text', '')))} characters to {args.get('path')}"
    return _calculate(str(args.get("expression", "")))


def run_trace(client, task: str, session: str, max_steps: int) -> list[dict]:
    """One agent session: the model calls tools until it answers; every step's result (stats) in order."""
    messages = [{"role": "system", "content": "You are a careful assistant with tools. Use them."},
                {"role": "user", "content": task}]
    steps = []
    for _ in range(max_steps):
        reply = client.request("chat", {"messages": messages, "tools": TOOLS, "max_tokens": 400,
                                        "temperature": 0}, session_id=session)
        steps.append(reply["stats"])
        messages.append(reply["message"])
        if not reply["message"]["tool_calls"]:
            break
        for call in reply["message"]["tool_calls"]:
            try:
                args = json.loads(call["function"]["arguments"])
            except ValueError:
                args = {}
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": call.get("error") or run_tool(call["function"]["name"], args)})
    client.request("session.drop", session_id=session)
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=catalog.DEFAULT_AGENT_MODEL, help="catalog name of the target model")
    parser.add_argument("--draft", default=catalog.TEST_CHAT_MODEL, help="catalog name of the draft model")
    parser.add_argument("--reps", type=int, default=2, help="runs of every trace per mode (modes alternate)")
    parser.add_argument("--lookup-tokens", type=int, default=8, help="spec_draft_tokens for prompt lookup")
    parser.add_argument("--model-tokens", type=int, default=4, help="spec_draft_tokens for the draft model")
    parser.add_argument("--max-steps", type=int, default=4)
    args = parser.parse_args()
    target, draft = catalog.get(args.model).path(), catalog.get(args.draft).path()
    for path, name in ((target, args.model), (draft, args.draft)):
        if not path.is_file():
            sys.exit(f"{path} is missing: magnitude models pull {name}")
    modes = {"off": {"spec_draft_tokens": 0, "spec_drafter": "lookup"},
             "lookup": {"spec_draft_tokens": args.lookup_tokens, "spec_drafter": "lookup"},
             "draft model": {"spec_draft_tokens": args.model_tokens, "spec_drafter": "model"}}
    totals = {m: {"tokens": 0, "decode_s": 0.0, "drafted": 0, "accepted": 0, "wall": []} for m in modes}
    texts: dict[str, dict[str, str]] = {m: {} for m in modes}
    with tempfile.TemporaryDirectory(prefix="magspecchat", dir="/tmp") as tmp:
        config, client = start_inference(Path(tmp), "specchat", {
            "model_path": str(target), "draft_model_path": str(draft), "n_ctx": 4096, "session_slots": 1})
        try:
            for rep in range(args.reps):
                for mode, settings in modes.items():
                    client.request("engine.configure", {"settings": settings})
                    for i, task in enumerate(TASKS):
                        t0 = time.perf_counter()
                        steps = run_trace(client, task, f"bench-{rep}-{mode}-{i}", args.max_steps)
                        totals[mode]["wall"].append(time.perf_counter() - t0)
                        for s in steps:
                            totals[mode]["tokens"] += s["completion_tokens"]
                            totals[mode]["decode_s"] += s["completion_tokens"] / s["decode_tps"] if s["decode_tps"] \
                                else 0.0
                            totals[mode]["drafted"] += s["draft_tokens"]
                            totals[mode]["accepted"] += s["accepted_tokens"]
                        texts[mode][task] = json.dumps([(s["message"]["content"], [
                            (c["function"]["name"], c["function"]["arguments"]) for c in s["message"]["tool_calls"]])
                            for s in steps])  # call ids are random: the replies themselves are compared
                        print(f"rep {rep} {mode:<11} task {i}: {len(steps)} steps, "
                              f"{sum(s['completion_tokens'] for s in steps)} tokens, "
                              f"{totals[mode]['wall'][-1]:.1f} s", file=sys.stderr, flush=True)
        finally:
            stop(config, client)
    off = totals["off"]
    print(f"\ntarget {target.name}, draft {draft.name}; {len(TASKS)} traces x {args.reps} reps per mode; "
          f"temperature 0")
    print("| mode | decode tok/s | vs off | drafts accepted | median s per trace | same replies as off |")
    print("|---|---:|---:|---:|---:|---|")
    for mode, t in totals.items():
        tps = t["tokens"] / t["decode_s"] if t["decode_s"] else 0.0
        base = off["tokens"] / off["decode_s"] if off["decode_s"] else 0.0
        same = sum(texts[mode][task] == texts["off"][task] for task in TASKS)
        print(f"| {mode} | {tps:.1f} | {tps / base:.2f}x | {t['accepted']}/{t['drafted']} | "
              f"{statistics.median(t['wall']):.1f} | {same}/{len(TASKS)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
