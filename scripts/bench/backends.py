"""Magnitude and llama-server behind one interface: start with N slots, stream one completion and time it on the
client, stop; and the CPU other processes took meanwhile. The side-by-side benchmarks run both through it, so
each side is timed the same way."""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from scripts.bench.common import start_inference, stop
from scripts.bench.llama_server import LlamaServer
from shared.client import Client, GenerateResult


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
    """An inference service of its own per start (no cache carries over), one client per thread."""

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
    """llama-server with one slot per agent (``id_slot``) and ``cache_prompt``: how a user runs it for agents."""

    name = "llama-server"

    def __init__(self, binary: str, model: Path, home: Path, threads: int, n_ctx: int, extra: list[str] = ()):
        """``extra``: more command-line arguments (e.g. a speculative decoding mode)."""
        self.binary, self.model, self.home, self.threads, self.n_ctx = binary, model, home, threads, n_ctx
        self.extra = list(extra)
        self.server: LlamaServer | None = None

    @property
    def pid(self) -> int:
        return self.server.pid

    def start(self, slots: int) -> None:
        self.server = LlamaServer(self.binary, self.model, [
            "-t", str(self.threads), "-tb", str(self.threads), "-np", str(slots), "-c", str(self.n_ctx * slots),
            "--no-webui", *self.extra], self.home / f"llama-server-{time.monotonic_ns()}.log", timeout_s=120).start()

    def complete(self, agent: int, prompt: str, max_tokens: int, session: str | None = None, **params) -> Sample:
        """``session`` is Magnitude's business: here the agent's slot keeps its cache; ``params`` (priority,
        owner) too: llama-server has no priorities, so it serves without them."""
        body = json.dumps({"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "stream": True,
                           "cache_prompt": True, "id_slot": agent})
        timer = Timer()
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=600)  # it closes a stream's connection
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
        if self.server is not None:
            self.server.stop()


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
