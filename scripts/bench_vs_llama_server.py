#!/usr/bin/env python3
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

    .venv/bin/python scripts/bench_vs_llama_server.py                # everything (~10 minutes on 2 cores)
    .venv/bin/python scripts/bench_vs_llama_server.py --workloads B C --reps 3
    .venv/bin/python scripts/bench_vs_llama_server.py --only magnitude --workloads B   # while iterating
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil

from _bench import BENCH_MODEL, PLANNER_SYSTEM, PLANNER_TASKS, start_inference, stop, stop_services_on_sigterm
from shared.client import Client, GenerateResult
from scripts._prompts import gemma_prompt

REPO = Path(__file__).resolve().parent.parent

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


def agent_history(agent: int) -> list[tuple[str, str]]:
    return [("user", f"{PLANNER_SYSTEM * 3}\nTask: {PLANNER_TASKS[agent % len(PLANNER_TASKS)]}.")]


def next_turn(history: list[tuple[str, str]], step: int) -> list[tuple[str, str]]:
    return history + [("user", f"Step {step} done: the robot reports success. Continue.")]


@dataclass
class Sample:
    ttft_s: float
    total_s: float
    tokens: int
    text: str
    decode_tps: float | None  # (tokens - 1) / (last text - first text)


class Timer:
    """Client-side timing of one streamed completion."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None

    def piece(self) -> None:
        now = time.perf_counter()
        self.first = self.first or now
        self.last = now

    def sample(self, text: str, tokens: int) -> Sample:
        end = time.perf_counter()
        first, last = self.first or end, self.last or end
        tps = (tokens - 1) / (last - first) if tokens > 1 and last > first else None
        return Sample(first - self.t0, end - self.t0, tokens, text, tps)


class CpuWatch:
    """CPU used during a run by everything except this benchmark and the service under test (other processes,
    and in a VM the time its host took: steal).

    On a shared box other people's jobs slow one side down and make its ratio meaningless; each run reports
    this, and a run above ``--max-foreign`` cores is repeated."""

    def __init__(self, service_pid: int):
        self.procs = [psutil.Process(), psutil.Process(service_pid)]
        self.t0, self.busy0, self.own0 = time.monotonic(), self._busy(), self._own()

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return t.user + t.nice + t.system + t.irq + t.softirq + t.steal  # steal: taken by the VM's host

    def _own(self) -> float:
        return sum(sum(p.cpu_times()[:2]) for p in self.procs)

    def foreign_cores(self) -> float:
        wall = time.monotonic() - self.t0
        return max(0.0, (self._busy() - self.busy0) - (self._own() - self.own0)) / wall


class MagnitudeBackend:
    name = "magnitude"

    def __init__(self, model: Path, home: Path, threads: int, n_ctx: int, engine: dict | None = None):
        """``engine``: more engine settings (e.g. drafting) on top of the side-by-side ones."""
        self.model, self.home, self.threads, self.n_ctx = model, home, threads, n_ctx
        self.engine = engine or {}
        self.config = None
        self.local = threading.local()
        self.clients: list[Client] = []

    def start(self, slots: int) -> None:
        tag = f"m{time.monotonic_ns()}"
        home = self.home / tag  # its own data folder: no sessions saved by an earlier run
        home.mkdir()
        self.config, client = start_inference(home, tag, {
            "model_path": str(self.model), "session_slots": slots, "n_ctx": self.n_ctx, "n_threads": self.threads, "self_optimize": False,
            **self.engine})
        self.pid = client.health()["pid"]
        client.close()
        self.local = threading.local()

    def _client(self) -> Client:
        if not hasattr(self.local, "client"):
            self.local.client = Client.for_service("inference", self.config, timeout_s=600)
            self.clients.append(self.local.client)
        return self.local.client

    def complete(self, agent: int, prompt: str, max_tokens: int, session: str | None = None, **params) -> Sample:
        """``session``: the session id (default: one per agent); ``params``: more request fields (priority)."""
        timer = Timer()
        result = None
        for piece in self._client().generate_stream(prompt, session or f"agent-{agent}", max_tokens=max_tokens,
                                                    temperature=0, **params):
            if isinstance(piece, GenerateResult):
                result = piece
            elif piece:
                timer.piece()
        return timer.sample(result.text, result.stats.completion_tokens)

    def stop(self) -> None:
        for client in self.clients:
            client.close()
        self.clients.clear()
        stop(self.config, Client.for_service("inference", self.config))


class ServerBackend:
    name = "llama-server"

    def __init__(self, binary: str, model: Path, home: Path, threads: int, n_ctx: int, extra: list[str] = ()):
        """``extra``: more command-line arguments (e.g. a speculative decoding mode)."""
        self.binary, self.model, self.home, self.threads, self.n_ctx = binary, model, home, threads, n_ctx
        self.extra = list(extra)
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.pid = 0

    def start(self, slots: int) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        log = open(self.home / f"llama-server-{self.port}.log", "wb")
        self.proc = subprocess.Popen(
            [self.binary, "-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
             "-t", str(self.threads), "-tb", str(self.threads), "-np", str(slots), "-c", str(self.n_ctx * slots),
             "--no-webui", *self.extra], stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_healthy(log.name)
        except BaseException:  # SIGTERM (SystemExit) or no health while it loads: stop it, callers never will
            self.stop()
            raise
        self.pid = self.proc.pid

    def _wait_healthy(self, log_name: str) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"llama-server exited with {self.proc.returncode}; see {log_name}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    conn.close()
                    return
            except OSError:
                pass
            time.sleep(0.2)
        sys.exit("llama-server did not become healthy in 120 s")

    def complete(self, agent: int, prompt: str, max_tokens: int, session: str | None = None, **params) -> Sample:
        """``session`` is Magnitude's business: here the agent's slot keeps its cache; ``params`` (priority,
        owner) too: llama-server has no priorities, so it serves without them."""
        body = json.dumps({"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "stream": True,
                           "cache_prompt": True, "id_slot": agent})
        timer = Timer()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)  # it closes a stream's connection
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            sys.exit(f"llama-server answered {response.status}: {response.read()[:300]!r}")
        text, tokens = "", 0
        for line in response:
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if event.get("content"):
                timer.piece()
                text += event["content"]
            if event.get("stop"):
                tokens = event.get("tokens_predicted", 0)
                break
        conn.close()
        return timer.sample(text, tokens)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(30)


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


def measured(backend, slots: int, work) -> dict:
    """Start ``backend`` with ``slots`` slots, run ``work()`` (its metrics) and stop it; adds ``foreign``."""
    backend.start(slots)
    try:
        watch = CpuWatch(backend.pid)
        metrics = work()
        metrics["foreign"] = watch.foreign_cores()
    finally:
        backend.stop()
    return metrics


def workload_a(backend, args) -> dict:
    def work() -> dict:
        wall, samples = run_agents(backend, 4, args.steps, args.max_tokens, concurrent=False)
        return {f"A step-{args.steps} TTFT s": statistics.median(agent[-1].ttft_s for agent in samples),
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
        return {"C median TTFT s": statistics.median(s.ttft_s for s in samples),
                "C tokens": sum(s.tokens for s in samples)}
    return measured(backend, 8, work)


def workload_d(backend, args) -> dict:
    prompt = gemma_prompt([("user", "Write a long, detailed story about a robot that learns to cook.")])

    def work() -> dict:
        backend.complete(0, "warm up", 4)
        sample = backend.complete(1, prompt, 256)
        return {"D decode tok/s": sample.decode_tps, "D tokens": sample.tokens}
    return measured(backend, 2, work)


def build_server() -> str:
    print("llama-server: building once (cached) with native/build_llama_server.sh ...", file=sys.stderr, flush=True)
    out = subprocess.run(["bash", str(REPO / "native" / "build_llama_server.sh")], check=True,
                         stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHON=sys.executable))
    return out.stdout.strip().splitlines()[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["A", "B", "C", "D"], choices=["A", "B", "C", "D"])
    parser.add_argument("--b-agents", type=int, nargs="+", default=[4, 8], help="agent counts of workload B")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per agent step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=4096, help="context tokens per agent (slot)")
    parser.add_argument("--reps", type=int, default=1, help="alternating runs per workload; medians are printed")
    parser.add_argument("--only", choices=["magnitude", "llama-server"], help="run one side (no ratios)")
    parser.add_argument("--server", help="llama-server binary (default: build/cached by native/build_llama_server.sh)")
    parser.add_argument("--model", default=str(BENCH_MODEL))
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
            engine = {}
            for item in args.engine:
                knob, _, value = item.partition("=")
                engine[knob] = json.loads(value) if value[:1].isdigit() or value in ("true", "false") else value
            backends.append(MagnitudeBackend(Path(args.model), home, args.threads, args.n_ctx, engine))
        if args.only != "magnitude":
            binary = args.server or build_server()
            version = subprocess.run([binary, "--version"], capture_output=True, text=True)
            print("llama-server:", binary, "|", " ".join((version.stdout + version.stderr).split()[:6]))
            backends.append(ServerBackend(binary, Path(args.model), home, args.threads, args.n_ctx))
        runs = []
        if "A" in args.workloads:
            runs.append(("A", lambda b: workload_a(b, args)))
        if "B" in args.workloads:
            runs += [(f"B{n}", lambda b, n=n: workload_b(b, args, n)) for n in args.b_agents]
        if "C" in args.workloads:
            runs.append(("C", lambda b: workload_c(b, args)))
        if "D" in args.workloads:
            runs.append(("D", lambda b: workload_d(b, args)))
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
        values = [statistics.median(v for v in results[n][metric] if v is not None) for n in names]
        row = f"{metric:<22}" + "".join(f"{v:>14.3f}" if isinstance(v, float) else f"{v:>14}" for v in values)
        if len(values) == 2 and values[1]:
            row += f"{values[0] / values[1]:>8.2f}"
        print(row)
    print("cores used by other processes during the kept runs (max): "
          + ", ".join(f"{label} {max(v):.2f}" for label, v in foreign.items()))
    print("\nreproduce: .venv/bin/python scripts/bench_vs_llama_server.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
