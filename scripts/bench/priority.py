#!/usr/bin/env python3
"""Priorities side by side (issue 35): an interactive agent beside background work, and two API keys, on
Magnitude and on llama-server (which has no priorities), in one run. A benchmark, not a test.

  alone        one interactive agent of --steps short steps (--max-tokens each), nothing else running:
               its median step TTFT and decode tok/s
  background   3 background agents, one long generation each (--long-tokens): their total tok/s
  together     both at once (the agent starts once the 3 decode): the agent's TTFT and decode tok/s
               against alone, the background's tok/s against background alone
  two keys     key A runs 4 generations of --key-a-tokens (every slot), then key B sends a 4-token request:
               B's latency against B alone

Both sides get 4 slots (Magnitude ``session_slots``, llama-server ``-np 4``), greedy decoding, the same
prompts; the backends and their timing are ``bench_vs_llama_server.py``'s. The interactive agent's requests
are ``priority: interactive`` and the background ones ``background`` (Magnitude only: llama-server ignores
them). Ratios below 1 for TTFT and latency, above 1 for tok/s, favour priorities.

    .venv/bin/python -m scripts.bench.priority --reps 3
    .venv/bin/python -m scripts.bench.priority --only magnitude --steps 4 --long-tokens 128   # quick
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from scripts.bench.backends import MagnitudeBackend, Sample, ServerBackend, measured
from scripts.bench.common import add_side_by_side_arguments, stop_services_on_sigterm
from scripts.bench.llama_server import build as build_server
from scripts.bench.prompts import agent_history, gemma_prompt, next_turn

SLOTS = 4
#: Plain text to continue, not a chat turn: any model goes on with a story for a long while, where a chat turn
#: in a format that is not the model's own may end early (docs/benchmarks.md).
STORIES = [f"The following is a long, detailed story in many chapters about a robot that {task}.\n\nChapter 1\n\n"
           for task in ("cleans a library at night", "learns to bake bread", "guards a lighthouse",
                        "explores an old mine")]
HELLO = gemma_prompt([("user", "Say hello.")])


def interactive_agent(backend, args) -> list[Sample]:
    """One agent's steps, one after another, each its conversation so far (agent 3: the fourth slot)."""
    history, samples = agent_history(3), []
    for n in range(args.steps):
        if n:
            history = next_turn(history, n)
        sample = backend.complete(3, gemma_prompt(history), args.max_tokens, priority="interactive")
        history, samples = history + [("model", sample.text)], samples + [sample]
    return samples


class Long(threading.Thread):
    """One long generation in its own thread; ``started`` once it has its first token (llama-server and
    Magnitude both stream)."""

    def __init__(self, backend, agent: int, tokens: int, **params):
        super().__init__(daemon=True)
        self.backend, self.agent, self.tokens, self.params = backend, agent, tokens, params
        self.sample: Sample | None = None
        self.ended = 0.0

    def run(self) -> None:
        self.sample = self.backend.complete(self.agent, STORIES[self.agent], self.tokens, **self.params)
        self.ended = time.perf_counter()


def run_long(backend, count: int, tokens: int, **params) -> tuple[list[Long], float]:
    """``count`` long generations, started together; returns them (running) and when they started."""
    runs = [Long(backend, agent, tokens, **params) for agent in range(count)]
    t0 = time.perf_counter()
    for run in runs:
        run.start()
    return runs, t0


def throughput(runs: list[Long], t0: float) -> tuple[float, int]:
    """Tokens per second of ``runs`` together, and how many tokens they wrote (each should write them all)."""
    for run in runs:
        run.join()
    tokens = sum(run.sample.tokens for run in runs)
    return tokens / (max(run.ended for run in runs) - t0), tokens


def medians(samples: list[Sample]) -> tuple[float, float]:
    return (statistics.median(s.ttft_s for s in samples),
            statistics.median(s.decode_tps for s in samples if s.decode_tps))


def scenarios(backend, args) -> dict:
    def work() -> dict:
        ttft, tps = medians(interactive_agent(backend, args))
        runs, t0 = run_long(backend, 3, args.long_tokens, priority="background")
        alone_bg, _ = throughput(runs, t0)
        runs, t0 = run_long(backend, 3, args.long_tokens, priority="background")
        time.sleep(args.settle_s)  # the three are decoding
        with_ttft, with_tps = medians(interactive_agent(backend, args))
        with_bg, bg_tokens = throughput(runs, t0)
        sent = time.perf_counter()
        backend.complete(0, HELLO, 4, session="key-b-alone", owner="key-b")
        b_alone = time.perf_counter() - sent
        runs, t0 = run_long(backend, SLOTS, args.key_a_tokens, owner="key-a")
        time.sleep(args.settle_s)  # every slot decodes
        sent = time.perf_counter()
        backend.complete(0, HELLO, 4, session="key-b", owner="key-b")  # llama-server: waits for slot 0
        b_beside = time.perf_counter() - sent
        _, a_tokens = throughput(runs, t0)
        return {"interactive TTFT s alone": ttft, "interactive TTFT s beside 3": with_ttft,
                "  ratio TTFT": with_ttft / ttft, "interactive tok/s alone": tps, "interactive tok/s beside 3": with_tps,
                "  ratio decode": with_tps / tps, "background tok/s alone": alone_bg,
                "background tok/s beside": with_bg, "  ratio background": with_bg / alone_bg,
                "key B 4 tokens s alone": b_alone, "key B 4 tokens s beside A": b_beside,
                "  ratio key B": b_beside / b_alone, "background tokens": bg_tokens, "key A tokens": a_tokens}
    return measured(backend, SLOTS, work)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="steps of the interactive agent")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per interactive step")
    parser.add_argument("--long-tokens", type=int, default=250, help="new tokens per background generation")
    parser.add_argument("--key-a-tokens", type=int, default=250, help="new tokens per generation of key A")
    parser.add_argument("--settle-s", type=float, default=1.0, help="wait before the interactive agent starts")
    add_side_by_side_arguments(parser, n_ctx_help="context tokens per slot")
    args = parser.parse_args()
    stop_services_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="magprio", dir="/tmp") as tmp:
        backends = []
        if args.only != "llama-server":
            backends.append(MagnitudeBackend(Path(args.model), Path(tmp), args.threads, args.n_ctx))
        if args.only != "magnitude":
            binary = args.server or build_server()
            print("llama-server:", binary, subprocess.run([binary, "--version"], capture_output=True,
                                                          text=True).stderr.split("\n")[0])
            backends.append(ServerBackend(binary, Path(args.model), Path(tmp), args.threads, args.n_ctx))
        results: dict[str, dict[str, list[float]]] = {b.name: {} for b in backends}
        for rep in range(args.reps):
            for backend in (backends if rep % 2 == 0 else backends[::-1]):
                print(f"run {rep + 1}/{args.reps}: {backend.name} ...", file=sys.stderr, flush=True)
                for metric, value in scenarios(backend, args).items():
                    results[backend.name].setdefault(metric, []).append(value)
    print(f"\nmodel {Path(args.model).name}, {args.threads} threads, {SLOTS} slots, {args.steps} interactive steps "
          f"of {args.max_tokens} tokens, background {args.long_tokens} tokens, median of {args.reps} run(s)")
    names = [b.name for b in backends]
    print(f"{'metric':<28}" + "".join(f"{n:>14}" for n in names))
    for metric in results[names[0]]:
        print(f"{metric:<28}" + "".join(f"{statistics.median(results[n][metric]):>14.3f}" for n in names))
    print("cores used by other processes (max): " + ", ".join(
        f"{n} {max(results[n]['foreign']):.2f}" for n in names))
    print("\nreproduce: .venv/bin/python -m scripts.bench.priority " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
