#!/usr/bin/env python3
"""Agent task success: Magnitude's agent vs a plain OpenAI-style tool loop on llama-server, same model, one run.

69 tasks over the built-in tools (arithmetic for the calculator, files the bench
writes for file_reader, memories it stores for memory_search, tasks that need two
tools, multi-step tasks that need two or three dependent calls: a file naming the
file that holds the answer, a file's or a memory's figures to compute with, a unit
to convert to, a list to count or sum; tasks that need none) and 8 that need an MCP server's tool (a home robot's
sensors, drives and doors: examples/mcp/home_robot.py, started by the tool service
over stdio only when the run has mcp tasks), each with an expected answer checked strictly: the
final answer must hold the expected number (compared as a number) or every
expected phrase (as whole words); an answer that merely contains a tool call, or
a wrong number, fails; no task's question passes its own check (tests/test_bench_tasks.py).

Per model, two phases run one after the other on the same GGUF:
  magnitude  the stack's own services (inference, tools, embedding, retrieval,
             optimizer) and ``magnitude.agent.Agent``;
  http       the same services and loop behind the gateway: each task POSTed to
             ``/v1/responses`` with a plain HTTP client (urllib), as agent
             software in another language would run it;
  peer       ``llama-server --jinja`` (native/build_llama_server.sh) and the loop
             a user writes with the official ``openai`` client: send the tools,
             run the returned tool_calls, feed the results back as tool
             messages, stop at a message without tool calls.
Both get the same system prompt, the same tools (executed by the same tool
service), temperature 0, seed 0, the same max steps and max tokens per step, and
the same n_ctx and threads. The tasks of one phase run one after the other in one
session (Magnitude) / one slot (llama-server), so both reuse the shared prompt
prefix. Both sides of a model run under one hold of the shared heavy-job lock
(/tmp/magnitude-heavy.lock), so they see the same load on the box.

Needs the ``bench`` extra (``pip install -e .[bench]``: the pinned ``openai`` client).

    .venv/bin/python scripts/bench_agent.py                           # every catalog model
    .venv/bin/python scripts/bench_agent.py --models qwen2.5-coder-0.5b --limit 10
    .venv/bin/python scripts/bench_agent.py --tasks memory,two_tools --json rows.json
    .venv/bin/python scripts/bench_agent.py --models qwen2.5-coder-1.5b --tasks arithmetic,file,memory,mcp --systems magnitude
    .venv/bin/python scripts/bench_agent.py --models qwen2.5-coder-1.5b --systems magnitude,http,peer
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _bench import stop_services_on_sigterm  # noqa: E402
from magnitude import launcher  # noqa: E402
from magnitude.agent import SYSTEM_PROMPT, Agent, tool_output, tool_specs  # noqa: E402
from shared import process  # noqa: E402
from shared.client import Client, ServiceError  # noqa: E402
from shared.config import Config, dump_config, parse_config  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
HEAVY_LOCK = "/tmp/magnitude-heavy.lock"
SYSTEMS = ("magnitude", "http", "peer")


@dataclass(frozen=True)
class Task:
    kind: str  # arithmetic | file | memory | two_tools | multi_step | no_tool | mcp
    goal: str
    expected: tuple[str, ...]  # every item must be in the answer; "a|b": either


TASKS = [
    Task("arithmetic", "What is 4738 * 2961?", ("14029218",)),
    Task("arithmetic", "What is 98765 - 43219?", ("55546",)),
    Task("arithmetic", "Compute 1234 * 56 + 789.", ("69893",)),
    Task("arithmetic", "What is 7 to the power of 6?", ("117649",)),
    Task("arithmetic", "How many seconds are there in one week?", ("604800",)),
    Task("arithmetic", "What is 15% of 2480?", ("372",)),
    Task("arithmetic", "What is 987654 divided by 123, rounded down to a whole number?", ("8029",)),
    Task("arithmetic", "What is 2 to the power of 20?", ("1048576",)),
    Task("arithmetic", "Add 1873 and 2291, then multiply the sum by 3.", ("12492",)),
    Task("arithmetic", "What is the square root of 65536?", ("256",)),
    Task("arithmetic", "What is 144 * 37 - 512?", ("4816",)),
    Task("arithmetic", "A box holds 48 cans at 3.75 euros each. What does the box cost in euros?", ("180",)),
    Task("file", "What is the wifi password written in wifi.txt?", ("tulip-4821",)),
    Task("file", "Which herb is on the shopping list in shopping.txt?", ("basil",)),
    Task("file", "According to plan.txt, what is the robot's task on Tuesday?", ("ferns",)),
    Task("file", "What is the garage door code written in door.txt?", ("5093",)),
    Task("file", "Who is the third dinner guest listed in guests.txt?", ("Chiara",)),
    Task("file", "How many charge cycles does battery.txt report?", ("412",)),
    Task("file", "Which firmware version is written in notes/robot.txt?", ("2.4.1",)),
    Task("file", "What is the dog called according to pets.txt?", ("Rocket",)),
    Task("file", "In which room is the charging dock, according to rooms.txt?", ("laundry",)),
    Task("file", "What time does the alarm in alarm.txt ring?", ("6:45",)),
    Task("memory", "Search my memories: where are the spare house keys?", ("blue bowl",)),
    Task("memory", "Search my memories: in which month is Lena's birthday?", ("March",)),
    Task("memory", "Search my memories: where is the wifi router?", ("attic",)),
    Task("memory", "Search my memories: what is grandma allergic to?", ("peanuts",)),
    Task("memory", "Search my memories: what is the plumber's phone number?", ("555-0142",)),
    Task("memory", "Search my memories: on which level of the garage is the car parked?", ("3",)),
    Task("memory", "Search my memories: what is my favourite colour?", ("teal",)),
    Task("memory", "Search my memories: where are the vacuum bags stored?", ("sink",)),
    Task("memory", "Search my memories: who feeds the fish?", ("Tom",)),
    Task("memory", "Search my memories: on which day do the bins go out?", ("Wednesday",)),
    Task("two_tools", "Look up the monthly rent in my memories and compute what a year of rent costs.", ("22080",)),
    Task("two_tools", "Read prices.txt and compute what 24 apples cost.", ("8.4",)),
    Task("two_tools", "Read distances.txt. The robot drives from the kitchen to the garage and back 7 times. "
                      "How many metres is that in total?", ("532",)),
    Task("two_tools", "Search my memories for how long the robot's battery lasts, then compute how many minutes "
                      "6 full charges give.", ("570",)),
    Task("two_tools", "Read stock.txt and add up the tins of soup and the tins of beans.", ("40",)),
    Task("two_tools", "Search my memories for the size of the garden, then compute its area in square metres.",
         ("108",)),
    Task("two_tools", "Read usage.txt, search my memories for the electricity price, and compute last month's "
                      "electricity cost in euros.", ("98",)),
    Task("two_tools", "Read the speed in robot_speed.txt and compute how many metres the robot covers in "
                      "15 minutes.", ("630",)),
    Task("multi_step", "My bike lock code is in the file that todo.txt points to. What is the code?", ("3817",)),
    Task("multi_step", "index.txt says which file has this week's menu. What is for dinner on Friday?", ("lasagne",)),
    Task("multi_step", "contacts.txt tells where the babysitter's details are. What is her phone number?",
         ("555-0178",)),
    Task("multi_step", "The dishwasher's manual is listed in manuals.txt. Which program does it recommend for "
                       "glasses?", ("Delicate",)),
    Task("multi_step", "recipe.txt is for 4 people. How many grams of flour do I need to make it for 10?",
         ("625",)),
    Task("multi_step", "What did the shopping on receipt.txt cost in total, in euros?", ("12.5",)),
    Task("multi_step", "According to cleaning_log.txt, how many minutes did the robot clean in total?", ("156",)),
    Task("multi_step", "readings.csv has the water meter readings. How many litres did we use from the first "
                       "reading to the last?", ("1662",)),
    Task("multi_step", "Each plant in plants.txt gets its amount of water twice a week. How many millilitres is "
                       "that per week for all of them?", ("800",)),
    Task("multi_step", "How many things are on the packing list in packing.txt?", ("11|eleven",)),
    Task("multi_step", "How many people have said yes in rsvp.txt?", ("4|four",)),
    Task("multi_step", "How long is the hallway in centimetres? It is in my memories.", ("720",)),
    Task("multi_step", "My memories say how much the robot's mopping tank holds. How many millilitres is that?",
         ("1800",)),
    Task("multi_step", "How many minutes does the drive to grandma's take? Check my memories.", ("160",)),
    Task("multi_step", "How many litres of heating oil are left in the tank? My memories have the tank's size "
                       "and how full it is.", ("525",)),
    Task("multi_step", "What does our dog Max weigh in pounds, rounded to a whole number? His weight is in my "
                       "memories.", ("51",)),
    Task("multi_step", "car_log.txt has the fuel for the trip to the coast, and my memories have the price per "
                       "litre. What did the fuel for that trip cost?", ("114.56",)),
    Task("multi_step", "How many days will the cat food in pantry.txt last? My memories say how long one bag "
                       "lasts.", ("60",)),
    Task("multi_step", "windows.txt lists our windows, and my memories have the window cleaner's price per "
                       "window. What will cleaning all of them cost?", ("63",)),
    Task("multi_step", "savings.txt has what Lena has saved for her bike, and my memories have her weekly pocket "
                       "money. How many more weeks does she need to save?", ("18",)),
    Task("multi_step", "How many hours does the roast in oven.txt need?", ("1.5|one and a half|1 hour and 30",)),
    Task("multi_step", "How wide is the shelf in shelf.txt, in centimetres?", ("91.44",)),
    Task("multi_step", "thermostat.txt has the settings in Fahrenheit. What is the night setting in Celsius?",
         ("15",)),
    Task("no_tool", "What is the capital of France?", ("Paris",)),
    Task("no_tool", "How many legs does a spider have?", ("8|eight",)),
    Task("no_tool", "What colour do you get by mixing blue and yellow?", ("green",)),
    Task("no_tool", "Which planet is closest to the sun?", ("Mercury",)),
    Task("no_tool", "What is the opposite of hot?", ("cold",)),
    Task("no_tool", "What is the chemical symbol of gold?", ("Au",)),
    Task("mcp", "What temperature does the kitchen sensor read right now?", ("21.5",)),
    Task("mcp", "What is the humidity in the bathroom at the moment?", ("64",)),
    Task("mcp", "How high is the CO2 level in the bedroom, in ppm?", ("812",)),
    Task("mcp", "What is the temperature in the garage?", ("11.5",)),
    Task("mcp", "Send the robot to the garage. How many metres did it drive?", ("38",)),
    Task("mcp", "Drive the robot to the laundry room and tell me its battery level when it arrives.", ("76",)),
    Task("mcp", "Is the back door locked?", ("unlocked",)),
    Task("mcp", "What is the robot's battery level at its dock right now?", ("97",)),
]
KINDS = ("arithmetic", "file", "memory", "two_tools", "multi_step", "no_tool", "mcp")
#: The MCP server the mcp tasks need, as a robot program would configure it.
MCP_SERVER = {"name": "home", "command": [sys.executable, str(REPO / "examples" / "mcp" / "home_robot.py")],
              "roots": [str(REPO / "examples" / "mcp")]}

FILES = {
    "wifi.txt": "Home network: RobotNet\nPassword: tulip-4821\n",
    "shopping.txt": "milk\neggs\nbasil\ncoffee beans\n",
    "plan.txt": "Monday: vacuum the hallway\nTuesday: water the ferns\nWednesday: clean the windows\n",
    "door.txt": "The garage door code is 5093.\n",
    "guests.txt": "Dinner guests on Saturday, in order of arrival: Ana, Bruno and Chiara.\n",
    "battery.txt": "Battery health: 87%\nCharge cycles: 412\n",
    "notes/robot.txt": "Robot name: Pixel\nFirmware: 2.4.1\n",
    "pets.txt": "The cat is called Miso and the dog is called Rocket.\n",
    "rooms.txt": "The robot's charging dock is in the laundry room.\n",
    "alarm.txt": "Weekday alarm: 6:45\n",
    "prices.txt": "apple: 0.35 euros each\npear: 0.50 euros each\n",
    "distances.txt": "kitchen to garage: 38 m\nkitchen to bedroom: 12 m\n",
    "stock.txt": "tins of soup: 23\ntins of beans: 17\n",
    "usage.txt": "Electricity used last month: 350 kWh\n",
    "robot_speed.txt": "Cruising speed: 42 metres per minute\n",
    "todo.txt": "Buy stamps\nThe bike lock code is in notes/bike.txt\nCall the dentist\n",
    "notes/bike.txt": "Bike lock code: 3817\n",
    "index.txt": "This week's menu: menus/week49.txt\nCleaning rota: rota.txt\n",
    "menus/week49.txt": "Monday: tomato soup\nWednesday: risotto\nFriday: lasagne\n",
    "contacts.txt": "Babysitter: details in people/babysitter.txt\nNeighbour: Mr Okafor, flat 2\n",
    "people/babysitter.txt": "Name: Ines\nPhone: 555-0178\n",
    "manuals.txt": "Dishwasher: manuals/dishwasher.txt\nWashing machine: manuals/washer.txt\n",
    "manuals/dishwasher.txt": "Pots and pans: Intensive 70\nEveryday dishes: Eco 50\nGlasses: Delicate 40\n",
    "recipe.txt": "Pancakes for 4 people\nflour: 250 g\nmilk: 500 ml\neggs: 2\n",
    "receipt.txt": "bread 2.40\ncheese 5.85\napples 3.10\nmilk 1.15\n",
    "cleaning_log.txt": "Monday: 35 minutes\nTuesday: 42 minutes\nWednesday: 28 minutes\nThursday: 51 minutes\n",
    "readings.csv": "date,litres\n2026-11-01,48210\n2026-11-15,49035\n2026-11-30,49872\n",
    "plants.txt": "fern: 200 ml\ncactus: 50 ml\nbasil: 150 ml\n",
    "packing.txt": "passports\ntickets\nsun cream\ntoothbrushes\nphone chargers\nswimsuits\ntowels\n"
                   "hats\nbooks\nsnacks\nfirst aid kit\n",
    "rsvp.txt": "Ana: yes\nBruno: no\nChiara: yes\nDavid: yes\nEmma: maybe\nFelix: yes\nGreta: no\n",
    "car_log.txt": "Trip to the coast: 64 litres of fuel\nTrip to the city: 12 litres of fuel\n",
    "pantry.txt": "rice: 2 packs\ncat food: 5 bags\npasta: 3 packs\n",
    "windows.txt": "ground floor: 8 windows\nfirst floor: 6 windows\n",
    "savings.txt": "Lena wants a bike that costs 150 euros. She has saved 42 euros so far.\n",
    "oven.txt": "Roast: 180 degrees Celsius for 90 minutes\n",
    "shelf.txt": "Bookshelf: 36 inches wide, 72 inches tall\n",
    "thermostat.txt": "Day: 70 F\nNight: 59 F\n",
}
MEMORIES = [
    "The spare house keys are in the blue bowl by the front door.",
    "Lena's birthday is on the 14th of March.",
    "The wifi router is in the attic next to the old suitcase.",
    "Grandma is allergic to peanuts.",
    "The plumber's phone number is 555-0142.",
    "The car is parked on level 3 of the station garage.",
    "My favourite colour is teal.",
    "The robot's vacuum bags are stored under the kitchen sink.",
    "Tom feeds the fish every Thursday.",
    "The bins go out on Wednesday evening.",
    "The monthly rent is 1840 euros.",
    "The robot's battery lasts 95 minutes on a full charge.",
    "The garden is 12 metres long and 9 metres wide.",
    "The electricity price is 0.28 euros per kWh.",
    "The hallway is 7.2 metres long.",
    "The robot's mopping tank holds 1.8 litres of water.",
    "The drive to grandma's takes 2 hours and 40 minutes.",
    "The heating oil tank holds 1500 litres and is 35% full.",
    "Max the dog weighs 23 kilograms.",
    "Fuel costs 1.79 euros per litre.",
    "One bag of cat food lasts 12 days.",
    "The window cleaner charges 4.50 euros per window.",
    "Lena gets 6 euros of pocket money a week.",
]

_NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?")


def _numbers(text: str) -> list[float]:
    out = []
    for match in _NUMBER.findall(text):
        with contextlib.suppress(ValueError):
            out.append(float(match.replace(",", "")))
    return out


def _holds(answer: str, item: str) -> bool:
    if re.fullmatch(r"-?\d+(?:\.\d+)?", item):  # a number: compared as a number, not as text
        return any(math.isclose(n, float(item), abs_tol=1e-9) for n in _numbers(answer))
    return re.search(rf"(?<!\w){re.escape(item)}(?!\w)", answer, re.IGNORECASE) is not None


def correct(answer: str | None, expected: tuple[str, ...]) -> bool:
    """Every expected item (one of its ``|`` alternatives) is in the final answer."""
    return bool(answer) and all(any(_holds(answer, alt) for alt in item.split("|")) for item in expected)


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
        return correct(self.answer, self.task.expected)


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
                                sum(o.task.kind == k for o in self.outcomes)] for k in KINDS}}


def progress(phase: str, i: int, n: int, o: Outcome) -> None:
    mark = "ok  " if o.ok else "FAIL"
    print(f"  [{phase} {i}/{n}] {mark} {o.seconds:5.1f}s {o.steps} step(s) {o.valid_calls}/{o.calls} valid calls  "
          f"{o.task.goal[:48]!r} -> {(o.answer or o.error or '')[:70]!r}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def heavy_lock(enabled: bool):
    """The shared lock that keeps heavy jobs on this box one at a time (see CONVENTIONS)."""
    if not enabled:
        yield
        return
    with open(HEAVY_LOCK, "a") as handle:
        print(f"waiting for {HEAVY_LOCK} ...", file=sys.stderr, flush=True)
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --- the stack -------------------------------------------------------------------------------------
def bench_config(home: Path, model_path: Path, n_ctx: int, max_steps: int, max_tokens: int, mcp: bool) -> Config:
    return parse_config({
        "engine": {"model_path": str(model_path), "n_ctx": n_ctx, "session_slots": 2, "self_optimize": False},
        "agent": {"tools": [{"name": "calculator"}, {"name": "file_reader"}, {"name": "memory_search"}],
                  "mcp_servers": [MCP_SERVER] if mcp else [],
                  "file_roots": [str(home / "files")], "max_iterations": max_steps, "max_step_tokens": max_tokens},
        "runtime": {"runtime_dir": str(home / "run"), "data_dir": str(home / "data")},
        "metrics": {"enabled": False}, "watchdog": {"enabled": False},
    })


def write_files(root: Path) -> None:
    for name, text in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


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
    import urllib.error
    import urllib.request
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


# --- the peer: llama-server and the ordinary loop -------------------------------------------------
def llama_server_binary() -> str:
    out = subprocess.run(["bash", str(REPO / "native" / "build_llama_server.sh")], check=True, capture_output=True,
                         text=True, env=dict(os.environ, PYTHON=sys.executable))
    return out.stdout.strip().splitlines()[-1]


def peer_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("version")]
    return lines[0] if lines else "unknown"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llama_server(binary: str, model_path: Path, n_ctx: int, home: Path):
    port = free_port()
    log = open(home / "llama-server.log", "ab")
    proc = subprocess.Popen([binary, "-m", str(model_path), "--jinja", "-c", str(n_ctx), "-np", "1",
                             "-t", str(os.cpu_count() or 1), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        import urllib.request
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"llama-server exited ({proc.returncode}); see {home / 'llama-server.log'}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            if time.monotonic() > deadline:
                raise SystemExit("llama-server not healthy in 300 s")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


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


# --- main ------------------------------------------------------------------------------------------
def catalog_models(names: list[str] | None) -> list[tuple[str, Path]]:
    """(name, GGUF path) per requested model: a catalog name, or a path to any GGUF (default: every catalog
    model with a chat template; a base model cannot run an agent)."""
    if names and all(name.endswith(".gguf") for name in names):
        return [(Path(name).stem, Path(name)) for name in names]
    from shared import catalog
    chosen = []
    for name in names or [m.name for m in catalog.CATALOG.values() if m.chat_template != "none"]:
        if name.endswith(".gguf"):
            chosen.append((Path(name).stem, Path(name)))
            continue
        try:
            model = catalog.get(name)
        except catalog.CatalogError as err:
            raise SystemExit(str(err)) from None
        if not model.path().is_file():
            raise SystemExit(f"model {name} is not pulled yet: run `magnitude models pull {name}`")
        chosen.append((name, model.path()))
    return chosen


def bench_model(name: str, model_path: Path, tasks: list[Task], args, home: Path, binary: str | None) -> dict:
    print(f"\n=== {name} ({model_path.stat().st_size / 2**20:.0f} MiB) ===", file=sys.stderr, flush=True)
    config = bench_config(home, model_path, args.n_ctx, args.max_steps, args.max_tokens,
                          any(t.kind == "mcp" for t in tasks))
    path = home / "bench.yaml"
    path.write_text(dump_config(config))
    start(config, path, ("embedding", "retrieval", "tools", "optimizer"))
    try:
        with Client.for_service("retrieval", config, timeout_s=120) as retrieval:
            retrieval.request("memory.upsert_many", {"collection": config.agent.memory_collection, "items": [
                {"id": f"m{i}", "text": text} for i, text in enumerate(MEMORIES)]})
        result = {"model": name, "size_mib": round(model_path.stat().st_size / 2**20), "decode_tps": None}
        with heavy_lock(not args.no_lock):  # both sides of one model under one hold: the same box load
            if "magnitude" in args.systems or "http" in args.systems:
                start(config, path, ("inference",))
                try:
                    with Client.for_service("inference", config) as inference:
                        result["decode_tps"] = inference.generate("Count from one to twenty in words:", max_tokens=48,
                                                                  temperature=0).stats.get("decode_tps")
                    if "magnitude" in args.systems:
                        result["magnitude"] = run_magnitude(config, tasks, name)
                    if "http" in args.systems:
                        result["http"] = run_http(config, home, tasks)
                finally:
                    process.stop(config, "inference")
            if "peer" in args.systems:
                with llama_server(binary, model_path, args.n_ctx, home) as url:
                    result["peer"] = run_peer(url, config, tasks, args.max_steps, args.max_tokens)
    finally:
        for service in ("optimizer", "tools", "retrieval", "embedding"):
            process.stop(config, service)
    return result


def print_table(results: list[dict], version: str | None, n_tasks: int, args) -> None:
    peer = (f"llama-server --jinja ({version}) + openai {__import__('openai').__version__} loop" if version
            else "not run")
    print(f"\nbench_agent: {n_tasks} tasks, max {args.max_steps} steps of {args.max_tokens} tokens, n_ctx {args.n_ctx}, "
          f"temperature 0; peer: {peer}")
    width = max([len(r["model"]) for r in results] + [20]) + 2
    head = (f"{'model':<{width}}{'system':<11}{'solved':>9}{'valid calls':>13}{'steps/task':>12}{'s/task':>8}  "
            + " ".join(f"{k:>10}" for k in KINDS))
    print(head)
    for r in results:
        for system in [x for x in SYSTEMS if x in r]:
            s = r[system].summary()
            rate = "-" if s["valid_call_rate"] is None else f"{100 * s['valid_call_rate']:.0f}% ({s['calls']})"
            kinds = " ".join(f"{f'{a}/{b}':>10}" for a, b in s["by_kind"].values())
            print(f"{r['model']:<{width}}{system:<11}"
                  f"{str(s['solved']) + '/' + str(s['tasks']):>9}"
                  f"{rate:>13}{s['steps_per_task']:>12.2f}{s['seconds_per_task']:>8.1f}  {kinds}")
        print(f"{'':<{width}}{r['size_mib']} MiB; Magnitude decode {r['decode_tps']} tok/s (free text)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", help="comma-separated catalog names or GGUF paths (default: every catalog model with a "
                                            "chat template)")
    parser.add_argument("--tasks", help=f"comma-separated kinds to run ({', '.join(KINDS)}; default: all)")
    parser.add_argument("--limit", type=int, help="run only the first N tasks (after --tasks), for quick checks")
    parser.add_argument("--max-steps", type=int, default=6, help="model turns per task, both systems (default 6)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per model turn (default 256)")
    parser.add_argument("--n-ctx", type=int, default=4096, help="context size, both systems (default 4096)")
    parser.add_argument("--systems", default="magnitude,peer", help=f"which of {', '.join(SYSTEMS)} to run, "
                                                                       "comma-separated (default: magnitude,peer)")
    parser.add_argument("--json", type=Path, help="write every task's outcome to this file")
    parser.add_argument("--no-lock", action="store_true", help=f"do not take {HEAVY_LOCK} (already held)")
    args = parser.parse_args()
    stop_services_on_sigterm()
    kinds = args.tasks.split(",") if args.tasks else list(KINDS)
    if unknown := set(kinds) - set(KINDS):
        parser.error(f"unknown task kinds: {', '.join(sorted(unknown))}")
    if set(args.systems.split(",")) - set(SYSTEMS):
        parser.error(f"--systems takes {', '.join(SYSTEMS)} (comma-separated)")
    tasks = [t for t in TASKS if t.kind in kinds][:args.limit]
    models = catalog_models(args.models.split(",") if args.models else None)
    binary = llama_server_binary() if "peer" in args.systems else None  # built on first use: minutes
    version = peer_version(binary) if binary else None
    results = []
    with tempfile.TemporaryDirectory(prefix="mba", dir="/tmp") as tmp:
        home = Path(tmp)
        for name, path in models:
            write_files(home / name / "files")
            results.append(bench_model(name, path, tasks, args, home / name, binary))
            print_table(results, version, len(tasks), args)
    if args.json:
        args.json.write_text(json.dumps([{"model": r["model"], **{
            system: [{"goal": o.task.goal, "kind": o.task.kind, "expected": o.task.expected, "answer": o.answer,
                      "ok": o.ok, "steps": o.steps, "calls": o.calls, "valid_calls": o.valid_calls,
                      "seconds": round(o.seconds, 2), "error": o.error, "trace": o.trace}
                     for o in r[system].outcomes]
            for system in SYSTEMS if system in r}} for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
