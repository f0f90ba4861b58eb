#!/usr/bin/env python3
"""Tool-call validity with grammar on vs off, on the real model, side by side in one run.

Starts an inference and a tool service (calculator, file_reader, memory_search
and four shell tools with enum, integer, number and string arguments), then runs
the agent's first step on each of 32 tasks twice: Action generated under the
GBNF grammar built from the tools' schemas, and unconstrained. It counts the
Actions that parse as JSON and validate against their tool's schema, first try,
and after the repair layer's one retry (grammar off only).

    .venv/bin/python scripts/bench_toolcalls.py [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from magnitude import launcher  # noqa: E402
from shared import process  # noqa: E402
from magnitude.agent import Agent  # noqa: E402
from shared.config import dump_config, parse_config  # noqa: E402

_ROOMS = ["kitchen", "living_room", "bedroom", "bathroom", "hallway"]
_UNITS = ["m", "km", "ft", "mi", "kg", "lb", "c", "f"]
SHELL_TOOLS = [
    {"name": "move_to", "kind": "shell", "description": "Drive the robot to a room.",
     "target": "echo arrived in {room}",
     "parameters": {"type": "object", "properties": {"room": {"enum": _ROOMS}}, "required": ["room"],
                    "additionalProperties": False}},
    {"name": "set_timer", "kind": "shell", "description": "Start a countdown timer.",
     "target": "echo timer {label} set for {minutes} minutes",
     "parameters": {"type": "object", "properties": {"minutes": {"type": "integer", "minimum": 1, "maximum": 240},
                                                     "label": {"type": "string", "maxLength": 40}},
                    "required": ["minutes", "label"], "additionalProperties": False}},
    {"name": "convert_units", "kind": "shell", "description": "Convert a quantity between units.",
     "target": "echo converted {value} {from_unit} to {to_unit}",
     "parameters": {"type": "object", "properties": {"value": {"type": "number"},
                                                     "from_unit": {"enum": _UNITS}, "to_unit": {"enum": _UNITS}},
                    "required": ["value", "from_unit", "to_unit"], "additionalProperties": False}},
    {"name": "send_message", "kind": "shell", "description": "Send a text message to a person.",
     "target": "echo sent to {to}",
     "parameters": {"type": "object", "properties": {"to": {"type": "string", "maxLength": 40},
                                                     "text": {"type": "string", "maxLength": 160}},
                    "required": ["to", "text"], "additionalProperties": False}},
]
TASKS = [
    "What is 23 * 47?", "What is 1234 + 5678?", "Compute (17 + 5) * 3.", "What is 2 to the power of 16?",
    "What is the square root of 144?", "How much is 987 - 654?", "Divide 1000 by 8.", "What is 15% of 240?",
    "Read the file notes.txt and tell me what it says.", "Open shopping.txt and list what I need to buy.",
    "What is written in the file todo.txt?", "Show me the contents of config/robot.txt.",
    "Search your memory for where I left my keys.", "Do you remember my favourite colour?",
    "Look up in memory what the wifi password is.", "Recall what I said about the dentist appointment.",
    "Go to the kitchen.", "Drive to the bedroom please.", "Move to the bathroom.", "Navigate to the hallway.",
    "Set a timer for 10 minutes for the pasta.", "Remind me in 45 minutes to call mum with a timer.",
    "Start a 3 minute timer called tea.", "Set a timer of 90 minutes labelled laundry.",
    "Convert 5 km to miles.", "How many pounds is 70 kg?", "Convert 100 f to c.", "Turn 12 feet into meters.",
    "Send a message to Anna saying I will be late.", "Text Bob that dinner is ready.",
    "Tell Maria by message that the package arrived.", "Message Tom: the meeting moved to 3 pm.",
]


#: The tool each task calls for, in TASKS order (8 calculator tasks, then 4 per other tool).
EXPECTED = ["calculator"] * 8 + [t for t in ("file_reader", "memory_search", "move_to", "set_timer", "convert_units",
                                             "send_message") for _ in range(4)]


def start_stack(home: Path):
    config = parse_config({
        "engine": {"n_ctx": 2048, "session_slots": 2},
        "agent": {"tools": [{"name": "calculator"}, {"name": "file_reader"}, {"name": "memory_search"}, *SHELL_TOOLS],
                  "file_roots": [str(home)]},
        "runtime": {"runtime_dir": str(home / "run"), "data_dir": str(home / "data")},
    })
    path = home / "config.yaml"
    path.write_text(dump_config(config))
    for name in ("inference", "tools"):
        status = launcher.start(config, name, str(path), progress=lambda m: print(m, file=sys.stderr))
        if not status.healthy:
            raise SystemExit(f"{name} did not start: {status.error}")
    return config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the per-task rows as JSON too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="magt", dir="/tmp") as tmp:
        home = Path(tmp)
        config = start_stack(home)
        agent = Agent(config)
        rows = []
        try:
            for i, task in enumerate(TASKS):
                row = {"task": task, "expected": EXPECTED[i]}
                for mode, grammar in (("on", True), ("off", False)):
                    # One session per mode: the shared instructions stay cached from task to task.
                    trace = agent.run(task, session_id=f"bench-{mode}", max_iterations=1, grammar=grammar)
                    step = trace.steps[0] if trace.steps else None
                    row[mode] = {"valid_first": bool(step and step.action and not step.retried),
                                 "valid_repaired": bool(step and step.action),
                                 "action": step.action if step else None,
                                 "error": (step.error if step else trace.error)}
                rows.append(row)
                print(f"{i + 1:2d}. grammar on: {json.dumps(row['on']['action'])[:70]:<72} "
                      f"off: {'ok' if row['off']['valid_first'] else 'ERR ' + str(row['off']['error'])[:50]}",
                      file=sys.stderr)
        finally:
            agent.close()
            for name in ("tools", "inference"):
                process.stop(config, name)
    n = len(rows)

    def pct(mode: str, key: str) -> str:
        return f"{100 * sum(r[mode][key] for r in rows) / n:5.1f}%"

    tools_used = {r["on"]["action"]["tool"] for r in rows if r["on"]["action"]}
    right = sum(bool(r["on"]["action"]) and r["on"]["action"]["tool"] == want for r, want in zip(rows, EXPECTED))
    print(f"\nTool-call validity over {n} tasks ({len(tools_used)} distinct actions chosen under grammar), "
          "Gemma 3 270M Q4_K_M, temperature 0")
    print(f"{'':28}{'grammar on':>12}{'grammar off':>13}")
    print(f"{'valid on first try':28}{pct('on', 'valid_first'):>12}{pct('off', 'valid_first'):>13}")
    print(f"{'valid after one repair':28}{'-':>12}{pct('off', 'valid_repaired'):>13}")
    print(f"{'intended tool chosen':28}{f'{100 * right / n:5.1f}%':>12}{'-':>13}")
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0 if all(r["on"]["valid_first"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
