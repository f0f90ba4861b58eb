"""Magnitude against llama.cpp's own llama-server, identical agent workloads side by side in one run.

The peer is ``llama-server`` built from the llama.cpp vendored in the pinned
llama-cpp-python (``native/build_llama_server.sh``, cached), so both run the same
kernels on the same model with the same thread count. Prompts are identical
text (both tokenize with BOS and special tokens), sampling is greedy
(temperature 0), the server gets ``cache_prompt`` and one slot per agent
(``-np N``, each agent pinned to its slot with ``id_slot``) with ``n_ctx`` tokens
per slot, Magnitude one session per agent and as many session slots.
Each workload starts a fresh process of each, so no cache carries over.

  A  4 agents interleaved A,B,C,D,A,... x 10 steps (one request at a time):
     TTFT at the last step (median over agents) and wall time
  B  4 and 8 agents concurrently x 10 steps (one thread per agent): wall time
  C  8 new agents sharing a 600-token system prompt, first step, all at once:
     median TTFT
  D  one stream decoding 256 tokens: decode tokens/s

An agent step is the conversation so far (system prompt and task, then each
model reply and a short user turn "Step N done ..."), rendered in Gemma's chat
format, completed with ``--max-tokens`` new tokens. Times are measured by the
client: TTFT from sending the request to the first streamed text, decode rate
from the first to the last streamed text. Ratios are magnitude / llama-server
(below 1: Magnitude is faster, except for decode tok/s where above 1 is).

    .venv/bin/python -m scripts.bench.vs_llama_server                # everything
    .venv/bin/python -m scripts.bench.vs_llama_server --workloads B C --reps 3
    .venv/bin/python -m scripts.bench.vs_llama_server --only magnitude --workloads B   # while iterating
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from scripts.bench import llama_server
from scripts.bench.backends import MagnitudeBackend, Sample, ServerBackend, measured
from scripts.bench.common import add_side_by_side_arguments, stop_services_on_sigterm
from scripts.bench.prompts import PLANNER_TASKS, agent_history, gemma_prompt, next_turn
from scripts.bench.stats import median, ratio


#: Workload C's system prompt: tool definitions and few-shot lines, about 600 tokens, used nowhere else.
SHARED_SYSTEM = "You are a warehouse robot's planner. Tools, one JSON object per call:\n" + "".join(
    f'{{"tool": "{name}", "description": "{what}", "args": {{"target": "string", "speed": "slow|fast"}}}}\n'
    for name, what in [("drive", "drive to a shelf or dock"), ("scan", "read the barcode in front of the camera"),
                       ("lift", "lift the pallet on the forks"), ("lower", "lower the forks to the floor"),
                       ("report", "send a status line to the operator"), ("charge", "dock at the charger"),
                       ("wait", "pause until the aisle is clear"), ("inspect", "photograph a shelf for damage")]
) + "Examples:\n" + "".join(
    f"Task: move pallet {i} from shelf A{i} to dock {i % 3 + 1}. Plan: drive A{i}; scan; lift; drive dock "
    f"{i % 3 + 1}; lower; report done.\n" for i in range(1, 10))


# --- workloads: each returns {metric: value} -------------------------------------------------------------
def in_parallel(calls: list) -> None:
    """Run each call in its own thread, all at once; an exception in any is raised here."""
    with ThreadPoolExecutor(len(calls)) as pool:
        for future in [pool.submit(call) for call in calls]:
            future.result()


def run_agents(backend, agents: int, steps: int, max_tokens: int, concurrent: bool) -> tuple[float, list[list[Sample]]]:
    """``agents`` conversations of ``steps`` steps each; returns the wall time and samples[agent][step]."""
    samples: list[list[Sample]] = [[] for _ in range(agents)]
    histories = [agent_history(a) for a in range(agents)]

    def step(agent: int, n: int) -> None:
        if n:
            histories[agent] = next_turn(histories[agent], n)
        sample = backend.complete(agent, gemma_prompt(histories[agent]), max_tokens)
        histories[agent] = histories[agent] + [("model", sample.text)]
        samples[agent].append(sample)

    t0 = time.perf_counter()
    if concurrent:
        in_parallel([lambda a=a: [step(a, n) for n in range(steps)] for a in range(agents)])
    else:
        for n in range(steps):
            for a in range(agents):
                step(a, n)
    return time.perf_counter() - t0, samples


def tokens_of(samples: list[list[Sample]]) -> int:
    return sum(s.tokens for agent in samples for s in agent)


def workload_a(backend, args) -> dict:
    def work() -> dict:
        wall, samples = run_agents(backend, 4, args.steps, args.max_tokens, concurrent=False)
        return {f"A step-{args.steps} TTFT s": median(agent[-1].ttft_s for agent in samples),
                "A wall s": wall, "A tokens": tokens_of(samples)}
    return measured(backend, 4, work)


def workload_b(backend, args, agents: int) -> dict:
    def work() -> dict:
        wall, samples = run_agents(backend, agents, args.steps, args.max_tokens, concurrent=True)
        return {f"B{agents} wall s": wall, f"B{agents} tokens": tokens_of(samples)}
    return measured(backend, agents, work)


def workload_c(backend, args) -> dict:
    prompts = [gemma_prompt([("user", f"{SHARED_SYSTEM}\nTask: {PLANNER_TASKS[a]}.")]) for a in range(8)]

    def work() -> dict:
        samples: list[Sample | None] = [None] * 8

        def first_step(agent: int) -> None:
            samples[agent] = backend.complete(agent, prompts[agent], args.max_tokens)

        in_parallel([lambda a=a: first_step(a) for a in range(8)])
        return {"C median TTFT s": median(s.ttft_s for s in samples),
                "C tokens": sum(s.tokens for s in samples)}
    return measured(backend, 8, work)


def workload_d(backend, args) -> dict:
    prompt = gemma_prompt([("user", "Write a long, detailed story about a robot that learns to cook.")])

    def work() -> dict:
        backend.complete(0, "warm up", 4)
        sample = backend.complete(1, prompt, 256)
        return {"D decode tok/s": sample.decode_tps, "D tokens": sample.tokens}
    return measured(backend, 2, work)


def engine_settings(args) -> dict:
    """``--engine KNOB=VALUE ...`` as settings: numbers and booleans as JSON, anything else as a string."""
    engine = {}
    for item in args.engine:
        knob, _, value = item.partition("=")
        engine[knob] = json.loads(value) if value[:1].isdigit() or value in ("true", "false") else value
    return engine


def workload_runs(args) -> list[tuple[str, Callable[..., dict]]]:
    """(label, run(backend) -> metrics) for each workload asked for, B once per agent count."""
    runs = []
    if "A" in args.workloads:
        runs.append(("A", lambda b: workload_a(b, args)))
    if "B" in args.workloads:
        runs += [(f"B{n}", lambda b, n=n: workload_b(b, args, n)) for n in args.b_agents]
    if "C" in args.workloads:
        runs.append(("C", lambda b: workload_c(b, args)))
    if "D" in args.workloads:
        runs.append(("D", lambda b: workload_d(b, args)))
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["A", "B", "C", "D"], choices=["A", "B", "C", "D"])
    parser.add_argument("--b-agents", type=int, nargs="+", default=[4, 8], help="agent counts of workload B")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per agent step")
    add_side_by_side_arguments(parser, n_ctx_help="context tokens per agent (slot)")
    parser.add_argument("--engine", nargs="+", default=[], metavar="KNOB=VALUE",
                        help="Magnitude engine settings other than its defaults, e.g. spec_draft_tokens=8")
    parser.add_argument("--keep", metavar="DIR", help="keep both sides' logs in DIR (default: a temporary folder)")
    parser.add_argument("--max-foreign", type=float, default=0.25,
                        help="a run during which other processes used more CPU cores than this is repeated")
    parser.add_argument("--retries", type=int, default=3, help="repeats of a disturbed run before it is kept anyway")
    args = parser.parse_args()
    stop_services_on_sigterm()

    backends = []
    with tempfile.TemporaryDirectory(prefix="magvs", dir="/tmp") as tmp:
        home = Path(args.keep or tmp)
        home.mkdir(parents=True, exist_ok=True)
        if args.only != "llama-server":
            backends.append(MagnitudeBackend(Path(args.model), home, args.threads, args.n_ctx, engine_settings(args)))
        if args.only != "magnitude":
            binary = args.server or llama_server.build()
            print("llama-server:", binary, "|", llama_server.version(binary))
            backends.append(ServerBackend(binary, Path(args.model), home, args.threads, args.n_ctx))
        runs = workload_runs(args)
        results: dict[str, dict[str, list[float]]] = {b.name: {} for b in backends}
        foreign: dict[str, list[float]] = {}
        for label, run in runs:
            for rep in range(args.reps):
                # Alternate which side goes first, so a drift in the machine's load hits both alike.
                for backend in (backends if rep % 2 == 0 else backends[::-1]):
                    for attempt in range(args.retries + 1):
                        print(f"workload {label}, run {rep + 1}/{args.reps}: {backend.name} ...", file=sys.stderr,
                              flush=True)
                        metrics = run(backend)
                        load = metrics.pop("foreign")
                        if load <= args.max_foreign or attempt == args.retries:
                            break
                        print(f"  other processes used {load:.2f} cores meanwhile: run again", file=sys.stderr)
                    foreign.setdefault(label, []).append(load)
                    for metric, value in metrics.items():
                        results[backend.name].setdefault(metric, []).append(value)

    print(f"\nmodel {Path(args.model).name}, {args.threads} threads, n_ctx {args.n_ctx} per agent, "
          f"max_tokens {args.max_tokens}, {args.steps} steps, temperature 0, median of {args.reps} run(s) per side")
    names = [b.name for b in backends]
    print(f"{'metric':<22}" + "".join(f"{n:>14}" for n in names) + (f"{'ratio':>8}" if len(names) == 2 else ""))
    for metric in results[names[0]]:
        values = [median(v for v in results[n][metric] if v is not None) for n in names]
        row = f"{metric:<22}" + "".join(f"{v:>14.3f}" if isinstance(v, float) else f"{v:>14}" for v in values)
        if len(values) == 2 and values[1]:
            row += f"{ratio(*values):>8.2f}"
        print(row)
    print("cores used by other processes during the kept runs (max): "
          + ", ".join(f"{label} {max(v):.2f}" for label, v in foreign.items()))
    print("\nreproduce: .venv/bin/python -m scripts.bench.vs_llama_server " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
