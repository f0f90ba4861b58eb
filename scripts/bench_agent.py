#!/usr/bin/env python3
"""Agent task success: Magnitude's agent vs a plain OpenAI-style tool loop on llama-server, same model, one run.

The tune set (scripts/bench_data/agent_tune.json; --sets picks others): 69 tasks over
the built-in tools (arithmetic for the calculator, files the bench writes for file_reader,
memories it stores for memory_search, tasks that need two
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
    .venv/bin/python scripts/bench_agent.py --models qwen2.5-coder-1.5b --sets tune,fp --limit 10   # per set/language
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _bench import stop_services_on_sigterm  # noqa: E402
from bench_grader import correct  # noqa: E402
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
    language: str = "en"  # the question's language: how the grader reads the answer's numbers
    set: str = "tune"  # the task set it comes from (scripts/bench_data/agent_<set>.json)


BENCH_DATA = REPO / "scripts" / "bench_data"


def load_set(name: str) -> tuple[list[Task], dict[str, str], list[str]]:
    """A task set from scripts/bench_data/agent_<name>.json: its tasks, the files it writes, the memories it
    stores. Kept as data so a set written for measuring is never edited alongside the agent's code."""
    data = json.loads((BENCH_DATA / f"agent_{name}.json").read_text(encoding="utf-8"))
    tasks = [Task(t["kind"], t["goal"], tuple(t["expected"]), t.get("language", data.get("language", "en")), name)
             for t in data["tasks"]]
    return tasks, data.get("files", {}), data.get("memories", [])


def available_sets() -> list[str]:
    return sorted(p.stem.removeprefix("agent_") for p in BENCH_DATA.glob("agent_*.json"))


def load_sets(names: list[str]) -> tuple[list[Task], dict[str, str], list[str]]:
    """Several sets in one run: their files and memories together, a file
    two sets write differently being an error rather than a silent overwrite."""
    tasks, files, memories = [], {}, []
    for name in names:
        set_tasks, set_files, set_memories = load_set(name)
        tasks += set_tasks
        for path, text in set_files.items():
            if files.setdefault(path, text) != text:
                raise SystemExit(f"sets {', '.join(names)}: {path} has two different contents")
        memories += [m for m in set_memories if m not in memories]
    return tasks, files, memories


#: The tune set: the tasks the agent's steering was developed on.
TASKS, FILES, MEMORIES = load_set("tune")
KINDS = ("arithmetic", "file", "memory", "two_tools", "multi_step", "no_tool", "mcp")
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
                "by_set": {group: [sum(o.ok for o in self.outcomes if f"{o.task.set}/{o.task.language}" == group),
                                   sum(f"{o.task.set}/{o.task.language}" == group for o in self.outcomes)]
                           for group in dict.fromkeys(f"{o.task.set}/{o.task.language}" for o in self.outcomes)}}


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


def write_files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
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


def bench_model(name: str, model_path: Path, tasks: list[Task], memories: list[str], args, home: Path,
                binary: str | None) -> dict:
    print(f"\n=== {name} ({model_path.stat().st_size / 2**20:.0f} MiB) ===", file=sys.stderr, flush=True)
    config = bench_config(home, model_path, args.n_ctx, args.max_steps, args.max_tokens,
                          any(t.kind == "mcp" for t in tasks))
    path = home / "bench.yaml"
    path.write_text(dump_config(config))
    start(config, path, ("embedding", "retrieval", "tools", "optimizer"))
    try:
        with Client.for_service("retrieval", config, timeout_s=120) as retrieval:
            retrieval.request("memory.upsert_many", {"collection": config.agent.memory_collection, "items": [
                {"id": f"m{i}", "text": text} for i, text in enumerate(memories)]})
        result = {"model": name, "size_mib": round(model_path.stat().st_size / 2**20), "decode_tps": None}
        with heavy_lock(not args.no_lock):  # both sides of one model under one hold: the same box load
            if "magnitude" in args.systems or "http" in args.systems:
                start(config, path, ("inference",))
                try:
                    with Client.for_service("inference", config) as inference:
                        result["decode_tps"] = inference.generate("Count from one to twenty in words:", max_tokens=48,
                                                                  temperature=0).stats.decode_tps
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
            print(f"{'':<{width}}{'':<11}by set/language: "
                  + ", ".join(f"{group} {a}/{b}" for group, (a, b) in s["by_set"].items()))
        print(f"{'':<{width}}{r['size_mib']} MiB; Magnitude decode {r['decode_tps']} tok/s (free text)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", help="comma-separated catalog names or GGUF paths (default: every catalog model with a "
                                            "chat template)")
    parser.add_argument("--tasks", help=f"comma-separated kinds to run ({', '.join(KINDS)}; default: all)")
    parser.add_argument("--sets", default="tune", help="comma-separated task sets from scripts/bench_data "
                                                     f"({', '.join(available_sets())}; default: tune)")
    parser.add_argument("--limit", type=int, help="run only the first N tasks of each set (after --tasks), "
                                                  "for quick checks")
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
    if unknown := set(args.sets.split(",")) - set(available_sets()):
        parser.error(f"unknown task sets: {', '.join(sorted(unknown))} (there are {', '.join(available_sets())})")
    set_tasks, files, memories = load_sets(args.sets.split(","))
    tasks = [t for name in args.sets.split(",") for t in
             [t for t in set_tasks if t.set == name and t.kind in kinds][:args.limit]]
    models = catalog_models(args.models.split(",") if args.models else None)
    binary = llama_server_binary() if "peer" in args.systems else None  # built on first use: minutes
    version = peer_version(binary) if binary else None
    results = []
    with tempfile.TemporaryDirectory(prefix="mba", dir="/tmp") as tmp:
        home = Path(tmp)
        for name, path in models:
            write_files(home / name / "files", files)
            results.append(bench_model(name, path, tasks, memories, args, home / name, binary))
            print_table(results, version, len(tasks), args)
    if args.json:
        args.json.write_text(json.dumps([{"model": r["model"], **{
            system: [{"goal": o.task.goal, "kind": o.task.kind, "set": o.task.set,
                      "language": o.task.language, "expected": o.task.expected, "answer": o.answer,
                      "ok": o.ok, "steps": o.steps, "calls": o.calls, "valid_calls": o.valid_calls,
                      "seconds": round(o.seconds, 2), "error": o.error, "trace": o.trace}
                     for o in r[system].outcomes]
            for system in SYSTEMS if system in r}} for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
