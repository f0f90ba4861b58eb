"""What the HTTP gateway costs per request: one multi-step agent workload through the gateway (the openai
SDK, as agent frameworks call it) and through the ZeroMQ client, side by side in one run.

An agent run is one session of ``--steps`` steps: each step adds an observation to the conversation and
asks for ``--max-tokens`` tokens at temperature 0, so both paths do the same work (the script checks that
they produce the same text). Runs alternate between the paths (A B B A ...) so a slow spell on a shared
machine hits both alike. A request's overhead is its latency at the client minus the time inference
itself reports (``total_s``: from taking the request to its last token); that leaves what the path adds:
encoding, sockets, queueing, and for the gateway HTTP, FastAPI and one more ZeroMQ hop.

    .venv/bin/python -m scripts.bench.gateway [--runs 8] [--steps 6] [--max-tokens 16] [--api chat|completions]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import tempfile
import time
from pathlib import Path

from openai import OpenAI

from magnitude import launcher
from scripts.bench.prompts import gemma_prompt
from scripts.bench.stats import pct
from services.gateway.keys import read_local_key
from shared import process
from shared.client import Client
from shared.config import Config, dump_config, parse_config

SYSTEM = ("You are the planner of a household robot with the tools move_to(room), pick(object), "
          "place(object, location) and say(text). Plan one step at a time and check each result.")
TASKS = ["bring a glass of water to the living room", "find the red book", "water the plants",
         "close every window"]
SERVICES = ("inference", "gateway")


def start(home: Path, engine: dict) -> Config:
    config = parse_config({"engine": engine, "metrics": {"base_port": 0}, "gateway": {"port": 0},
                           "runtime": {"runtime_dir": str(home / "run"), "data_dir": str(home / "data")}})
    path = home / "bench.yaml"
    path.write_text(dump_config(config))
    for name in SERVICES:
        status = launcher.start(config, name, str(path), progress=lambda m: print(m, file=sys.stderr))
        if not status.healthy:
            stop(config)
            sys.exit(f"{name} did not start: {status.error}")
    return config


def stop(config: Config) -> None:
    for name in reversed(SERVICES):
        process.stop(config, name)


class Paths:
    """One agent step over either path; returns (latency_s, inference's total_s, reply text)."""

    def __init__(self, config: Config, api: str, model: str, max_tokens: int):
        self.api, self.model, self.max_tokens = api, model, max_tokens
        self.zmq = Client.for_service("inference", config, timeout_s=300)
        with Client.for_service("gateway", config, timeout_s=5) as c:
            url = c.health()["url"]
        self.sdk = OpenAI(base_url=f"{url}/v1", api_key=read_local_key(config), max_retries=0, timeout=300)

    def zeromq(self, messages: list[dict], session: str) -> tuple[float, float, str]:
        t0 = time.perf_counter()
        if self.api == "chat":
            body = self.zmq.request("chat", {"messages": messages, "model": self.model, "max_tokens": self.max_tokens,
                                             "temperature": 0}, session)
            text, total_s = body["message"]["content"] or "", body["stats"]["total_s"]
        else:
            result = self.zmq.generate(_prompt(messages), session, model=self.model, max_tokens=self.max_tokens,
                                       temperature=0)
            text, total_s = result.text, result.stats.total_s
        return time.perf_counter() - t0, total_s, text

    def gateway(self, messages: list[dict], session: str) -> tuple[float, float, str]:
        headers = {"X-Session-Id": session}
        t0 = time.perf_counter()
        if self.api == "chat":
            reply = self.sdk.chat.completions.create(model=self.model, messages=messages, max_tokens=self.max_tokens,
                                                     temperature=0, seed=0, extra_headers=headers)
            text = reply.choices[0].message.content or ""
        else:
            reply = self.sdk.completions.create(model=self.model, prompt=_prompt(messages), max_tokens=self.max_tokens,
                                                temperature=0, seed=0, extra_headers=headers)
            text = reply.choices[0].text
        latency = time.perf_counter() - t0
        return latency, reply.model_extra["timings"]["prompt_ms"] / 1000 + \
            reply.model_extra["timings"]["predicted_ms"] / 1000, text

    def close(self) -> None:
        self.zmq.close()
        self.sdk.close()


def _prompt(messages: list[dict]) -> str:
    return gemma_prompt([("model" if m["role"] == "assistant" else "user", m["content"]) for m in messages])


def agent_run(step, task: str, steps: int, session: str) -> tuple[list[tuple[float, float]], list[str]]:
    """One session: ``steps`` steps of a growing conversation; (latency, inference time) and text per step."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Task: {task}. First step?"}]
    timings, texts = [], []
    for i in range(steps):
        latency, inference_s, text = step(messages, session)
        timings.append((latency, inference_s))
        texts.append(text)
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": f"Observation {i + 1}: done, the robot reports success. Next step?"}]
    return timings, texts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=8, help="agent runs per path (default 8)")
    parser.add_argument("--steps", type=int, default=6, help="steps per run (default 6)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--api", choices=("chat", "completions"), default="chat",
                        help="chat (messages, the model's template) or completions (a Gemma-format prompt)")
    parser.add_argument("--model-path", help="GGUF of the model (default: the engine's default model)")
    parser.add_argument("--n-ctx", type=int, default=2048)
    args = parser.parse_args()

    engine = {"n_ctx": args.n_ctx, "session_slots": 2, **({"model_path": args.model_path} if args.model_path else {})}
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in ("openai", "fastapi", "uvicorn"))
    print(f"bench_gateway: {args.runs} runs x {args.steps} steps per path, {args.max_tokens} tokens per step, "
          f"api {args.api} ({versions})", flush=True)
    with tempfile.TemporaryDirectory(prefix="magg", dir="/tmp") as tmp:
        config = start(Path(tmp), engine)
        paths = Paths(config, args.api, "default", args.max_tokens)
        try:
            agent_run(paths.zeromq, TASKS[0], 1, "warm-zmq")  # load pages, open sockets
            agent_run(paths.gateway, TASKS[0], 1, "warm-http")
            results: dict[str, list[tuple[float, float]]] = {"zeromq client": [], "gateway (openai SDK)": []}
            same_text = True
            for run in range(args.runs):
                order = [("zeromq client", paths.zeromq), ("gateway (openai SDK)", paths.gateway)]
                texts = {}
                for name, step in order if run % 2 == 0 else order[::-1]:
                    timings, texts[name] = agent_run(step, TASKS[run % len(TASKS)], args.steps, f"{name[:4]}-{run}")
                    results[name] += timings
                same_text &= len(set(map(tuple, texts.values()))) == 1
                print(f"  run {run + 1}/{args.runs} done", file=sys.stderr, flush=True)
        finally:
            paths.close()
            stop(config)
    print(f"{'path':<22} {'requests':>8} {'latency p50 ms':>15} {'overhead p50 ms':>16} {'overhead p99 ms':>16}")
    overhead = {}
    for name, timings in results.items():
        overhead[name] = [(latency - inference) * 1000 for latency, inference in timings]
        latency_p50 = pct([t[0] * 1000 for t in timings], 50)
        print(f"{name:<22} {len(timings):>8} {latency_p50:>15.1f} {pct(overhead[name], 50):>16.2f} "
              f"{pct(overhead[name], 99):>16.2f}")
    zmq, http = overhead["zeromq client"], overhead["gateway (openai SDK)"]
    print(f"the gateway adds {pct(http, 50) - pct(zmq, 50):.2f} ms at p50 and {pct(http, 99) - pct(zmq, 99):.2f} ms "
          f"at p99 per request; same text on both paths: {'yes' if same_text else 'NO'}")
    return 0 if same_text else 1


if __name__ == "__main__":
    sys.exit(main())
