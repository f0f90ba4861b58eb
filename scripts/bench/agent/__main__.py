"""Agent task success: Magnitude's agent vs a plain OpenAI-style tool loop on llama-server, same model, one run.

The tune set (scripts/bench/agent/data/agent_tune.json; --sets picks others): tasks over the
built-in tools (arithmetic for the calculator, files the bench writes for file_reader,
memories it stores for memory_search, tasks that need two tools, multi-step tasks that need
two or three dependent calls: a file naming the file that holds the answer, a file's or a
memory's figures to compute with, a unit to convert to, a list to count or sum; tasks that
need none) and tasks that need an MCP server's tool (a home robot's sensors, drives and
doors: examples/mcp/home_robot.py, started by the tool service over stdio only when the run
has mcp tasks). The held-out test set (agent_test.json and agent_test_de/_es/_fr.json, 45 tasks in each
language, never used to choose a change) and the false-positive set (agent_fp.json) have the same kinds.
Each task has an expected answer checked strictly: the final answer must hold the expected number (compared
as a number) or every expected phrase (as whole words), in the question's language (grader.py); an answer
that merely contains a tool call, or a wrong number, fails; no task's question passes its own check
(tests/scripts/test_bench_tasks.py). Each system's score is printed per set and per set/language.

Per model, the systems run one after the other on the same GGUF:
  magnitude  the stack's own services (inference, tools, embedding, retrieval,
             optimizer) and ``magnitude.agent.Agent``;
  http       the same services and loop behind the gateway: each task POSTed to
             ``/v1/responses`` with a plain HTTP client (urllib), as agent
             software in another language would run it;
  chat       the loop a user writes with the official ``openai`` client (send the
             tools, run the returned tool_calls, feed the results back as tool
             messages, stop at a message without tool calls) on the gateway's
             ``/v1/chat/completions``: the raw model;
  chat-agent the same loop with the agent alias (model ``default:agent``): the
             agent's step policy behind each chat completion; no system prompt
             is sent (the alias's loop has its own);
  sdk, langchain, pydantic-ai
             the OpenAI Agents SDK, LangChain's create_agent and pydantic-ai on
             ``/v1/responses``; ``sdk-chat``, ``langchain-chat``,
             ``pydantic-ai-chat``: each on chat completions with the agent
             alias (frameworks.py; needs the ``test`` extra's frameworks);
  peer       ``llama-server --jinja`` (native/build_llama_server.sh) and the
             ``chat`` loop.
Every system gets the same tools (executed by the bench's tool service; the
gateway's clients declare them as their own), temperature 0, the same max
steps, n_ctx and threads; magnitude, chat and peer get the same system prompt
and max tokens per step. The tasks of a system run one after the other: in one
session (magnitude) / one slot (llama-server), so both reuse the shared prompt
prefix; the gateway's clients start each task anew. Every system of a model
runs under one hold of the shared heavy-job lock (/tmp/magnitude-heavy.lock),
so they see the same load on the box.

Needs the ``bench`` extra (``pip install -e .[bench]``: the pinned ``openai`` client) and, for the frameworks,
the ``test`` extra.

    .venv/bin/python -m scripts.bench.agent                           # every catalog model
    .venv/bin/python -m scripts.bench.agent --models qwen2.5-coder-0.5b --limit 10
    .venv/bin/python -m scripts.bench.agent --tasks memory,two_tools --json rows.json
    .venv/bin/python -m scripts.bench.agent --models qwen2.5-coder-1.5b --tasks arithmetic,file,memory,mcp --systems magnitude
    .venv/bin/python -m scripts.bench.agent --models qwen2.5-coder-1.5b --systems magnitude,http,peer
    .venv/bin/python -m scripts.bench.agent --models qwen2.5-coder-1.5b --sets tune,fp --limit 10   # per set/language
    .venv/bin/python -m scripts.bench.agent --models qwen2.5-coder-1.5b --sets tune,test,test_de,test_es,test_fr,fp
    .venv/bin/python -m scripts.bench.agent --models qwen2.5-coder-1.5b --sets test \
        --systems magnitude,http,chat,chat-agent,sdk,sdk-chat,langchain,langchain-chat,pydantic-ai,pydantic-ai-chat
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import get_args

from scripts.bench import llama_server
from scripts.bench.agent.frameworks import FRAMEWORK_SYSTEMS, framework_task
from scripts.bench.agent.runners import (Phase, ToolBox, bench_config, gateway, http_task, peer_task, run_magnitude,
                                         run_peer, run_phase, start)
from scripts.bench.agent.tasks import KINDS, Task, available_sets, load_sets, write_files
from scripts.bench.common import stop_services_on_sigterm
from shared import catalog, process
from shared.client import Client
from shared.config import Config, dump_config
from shared.config.memory import EmbeddingModel

HEAVY_LOCK = "/tmp/magnitude-heavy.lock"
#: the systems behind the gateway, run against one gateway process
GATEWAY_SYSTEMS = ("http", "chat", "chat-agent", *FRAMEWORK_SYSTEMS)
SYSTEMS = ("magnitude", *GATEWAY_SYSTEMS, "peer")


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


# --- main ------------------------------------------------------------------------------------------
def catalog_models(names: list[str] | None) -> list[tuple[str, Path]]:
    """(name, GGUF path) per requested model: a catalog name, or a path to any GGUF (default: every catalog
    model with a chat template; a base model cannot run an agent)."""
    if names and all(name.endswith(".gguf") for name in names):
        return [(Path(name).stem, Path(name)) for name in names]
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
                          any(t.kind == "mcp" for t in tasks), args.policy, args.embedding_model,
                          args.recall_min_score)
    path = home / "bench.yaml"
    path.write_text(dump_config(config))
    start(config, path, ("embedding", "retrieval", "tools", "optimizer"))
    try:
        if memories:  # the false-positive set alone has none, and an empty upsert is a bad request
            with Client.for_service("retrieval", config, timeout_s=120) as retrieval:
                retrieval.request("memory.upsert_many", {"collection": config.agent.memory_collection, "items": [
                    {"id": f"m{i}", "text": text} for i, text in enumerate(memories)]})
        result = {"model": name, "size_mib": round(model_path.stat().st_size / 2**20), "decode_tps": None}
        with heavy_lock(not args.no_lock):  # both sides of one model under one hold: the same box load
            if set(args.systems) - {"peer"}:
                start(config, path, ("inference",))
                try:
                    with Client.for_service("inference", config) as inference:
                        result["decode_tps"] = inference.generate("Count from one to twenty in words:", max_tokens=48,
                                                                  temperature=0).stats.decode_tps
                    if "magnitude" in args.systems:
                        result["magnitude"] = run_magnitude(config, tasks, name)
                    if set(GATEWAY_SYSTEMS) & set(args.systems):
                        result.update(gateway_phases(config, home, tasks, args))
                finally:
                    process.stop(config, "inference")
            if "peer" in args.systems:
                with llama_server.LlamaServer(binary, model_path, [
                        "--jinja", "-c", str(args.n_ctx), "-np", "1", "-t", str(os.cpu_count() or 1)],
                        home / "llama-server.log") as server:
                    result["peer"] = run_peer(f"{server.url}/v1", config, tasks, args.max_steps, args.max_tokens)
    finally:
        for service in ("optimizer", "tools", "retrieval", "embedding"):
            process.stop(config, service)
    return result


def gateway_phases(config, home: Path, tasks: list[Task], args) -> dict[str, Phase]:
    """The systems behind one gateway process: /v1/responses read with urllib, the plain openai chat loop with
    and without the agent alias, and each framework on each API (frameworks.py)."""
    import openai
    with gateway(config, home) as (url, key), Client.for_service("tools", config, timeout_s=60) as tools:
        box, client = ToolBox(tools), openai.OpenAI(base_url=f"{url}/v1", api_key=key, timeout=600, max_retries=0)
        runs = {"http": lambda task: http_task(url, key, task),
                "chat": lambda task: peer_task(client, box, task, args.max_steps, args.max_tokens, model="default"),
                "chat-agent": lambda task: peer_task(client, box, task, args.max_steps, None, model="default:agent",
                                                     system=None)}
        for system in FRAMEWORK_SYSTEMS:
            runs[system] = lambda task, system=system: framework_task(system, url, key, box, task, args.max_steps)
        return {system: run_phase(system, tasks, runs[system]) for system in GATEWAY_SYSTEMS
                if system in args.systems}


def print_table(results: list[dict], version: str | None, n_tasks: int, args) -> None:
    peer = (f"llama-server --jinja ({version}) + openai {__import__('openai').__version__} loop" if version
            else "not run")
    print(f"\nbench_agent: {n_tasks} tasks, max {args.max_steps} steps of {args.max_tokens} tokens, n_ctx {args.n_ctx}, "
          f"temperature 0; agent.policy {args.policy or 'defaults'}; peer: {peer}")
    width = max([len(r["model"]) for r in results] + [20]) + 2
    head = (f"{'model':<{width}}{'system':<18}{'solved':>9}{'valid calls':>13}{'steps/task':>12}{'s/task':>8}  "
            + " ".join(f"{k:>10}" for k in KINDS))
    print(head)
    for r in results:
        for system in [x for x in SYSTEMS if x in r]:
            s = r[system].summary()
            rate = "-" if s["valid_call_rate"] is None else f"{100 * s['valid_call_rate']:.0f}% ({s['calls']})"
            kinds = " ".join(f"{f'{a}/{b}':>10}" for a, b in s["by_kind"].values())
            print(f"{r['model']:<{width}}{system:<18}"
                  f"{str(s['solved']) + '/' + str(s['tasks']):>9}"
                  f"{rate:>13}{s['steps_per_task']:>12.2f}{s['seconds_per_task']:>8.1f}  {kinds}")
            print(f"{'':<{width}}{'':<18}by set: " + ", ".join(f"{g} {a}/{b}" for g, (a, b) in s["by_set"].items())
                  + "; by set/language: " + ", ".join(f"{g} {a}/{b}" for g, (a, b) in s["by_language"].items()))
        if "http" in r:
            http = r["http"].summary()
            print(f"{'':<{width}}beside /v1/responses (http, {http['solved']}/{http['tasks']}): " + ", ".join(
                f"{x} {points(r[x].summary(), http):+.0f} pts ({ratio(r[x].summary(), http)})"
                for x in SYSTEMS if x in r and x != "http"))
        print(f"{'':<{width}}{r['size_mib']} MiB; Magnitude decode {r['decode_tps']} tok/s (free text)")


def points(summary: dict, base: dict) -> float:
    """Percentage points of solved tasks above (or below) ``base``'s."""
    return 100 * (summary["solved"] / max(summary["tasks"], 1) - base["solved"] / max(base["tasks"], 1))


def ratio(summary: dict, base: dict) -> str:
    return f"x{summary['solved'] / base['solved']:.2f}" if base["solved"] else "x n/a"


def policy_settings(text: str) -> dict:
    """``judge=false,english_rules=off`` as settings of ``agent.policy`` (checked when the config is parsed)."""
    settings = {}
    for pair in filter(None, text.split(",")):
        key, sep, value = pair.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{pair!r} is not key=value")
        settings[key.strip()] = {"true": True, "false": False}.get(value.strip().lower(), value.strip())
    return settings


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.agent", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", help="comma-separated catalog names or GGUF paths (default: every catalog model with a "
                                            "chat template)")
    parser.add_argument("--tasks", help=f"comma-separated kinds to run ({', '.join(KINDS)}; default: all)")
    parser.add_argument("--sets", default="tune", help="comma-separated task sets from scripts/bench/agent/data "
                                                     f"({', '.join(available_sets())}; default: tune)")
    parser.add_argument("--limit", type=int, help="run only the first N tasks of each set (after --tasks), "
                                                  "for quick checks")
    parser.add_argument("--goals", type=re.compile, help="run only the tasks whose question this regular expression "
                                                        "finds (after --tasks and --limit); every file and memory of "
                                                        "the sets is still there, so a task runs as in the whole run")
    parser.add_argument("--max-steps", type=int, default=6, help="model turns per task, both systems (default 6)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per model turn (default 256)")
    parser.add_argument("--n-ctx", type=int, default=4096, help="context size, both systems (default 4096)")
    parser.add_argument("--systems", default="magnitude,peer", help=f"which of {', '.join(SYSTEMS)} to run, "
                                                                       "comma-separated (default: magnitude,peer)")
    parser.add_argument("--json", type=Path, help="write every task's outcome to this file")
    parser.add_argument("--policy", type=policy_settings, default={},
                        help="the agent's step policy, as agent.policy settings: judge=false,english_rules=off "
                             "(docs/agents.md, the ablation); default: the configuration's defaults")
    parser.add_argument("--embedding-model", choices=get_args(EmbeddingModel),
                        help="the encoder the memories are recalled with (memory.embedding_model; default: the "
                             f"configuration's, {Config().memory.embedding_model})")
    parser.add_argument("--recall-min-score", type=float, help="the cosine similarity a memory needs to be recalled "
                                                                 "into a run's first prompt (agent.recall_min_score; "
                                                                 f"default: the configuration's, {Config().agent.recall_min_score})")
    parser.add_argument("--no-lock", action="store_true", help=f"do not take {HEAVY_LOCK} (already held)")
    args = parser.parse_args()
    stop_services_on_sigterm()
    kinds = args.tasks.split(",") if args.tasks else list(KINDS)
    if unknown := set(kinds) - set(KINDS):
        parser.error(f"unknown task kinds: {', '.join(sorted(unknown))}")
    args.systems = args.systems.split(",")
    if set(args.systems) - set(SYSTEMS):
        parser.error(f"--systems takes {', '.join(SYSTEMS)} (comma-separated)")
    if unknown := set(args.sets.split(",")) - set(available_sets()):
        parser.error(f"unknown task sets: {', '.join(sorted(unknown))} (there are {', '.join(available_sets())})")
    tasks, files, memories = load_sets(args.sets.split(","), kinds, args.limit)
    if args.goals:
        tasks = [task for task in tasks if args.goals.search(task.goal)]
    models = catalog_models(args.models.split(",") if args.models else None)
    binary = llama_server.build() if "peer" in args.systems else None  # built on first use: minutes
    version = llama_server.version(binary) if binary else None
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
