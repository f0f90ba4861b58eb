"""Chaos: agents keep working while a random service is kill -9'd, and nothing hangs or is lost.

    .venv/bin/python -m scripts.checks.chaos                    # 10 minutes, 8 agents, a kill every 20 s
    .venv/bin/python -m scripts.checks.chaos --minutes 2 --json # what the test suite runs

It starts the whole stack in a fresh home (``magnitude up``: every service and
the real watchdog), then for ``--minutes``:

* ``--agents`` threads each run agent tasks in a loop (``magnitude.agent.Agent`` with
  ``Retry``, through its public ``run()``), on the calculator;
* one writer stores memories (``memory.upsert``, acknowledged after the commit is on
  disk) and remembers each acknowledged id;
* every ``--kill-every`` seconds a random service (never the watchdog) gets SIGKILL,
  and the watchdog has to bring it back.

Then it stops the stack and reads every acknowledged memory back from the database
file. It prints: requests (agent generate and tool calls, tool listings, memory
writes), typed errors by code, hangs (an operation past ``--hang-after`` seconds:
must be 0), acknowledged memory writes lost (must be 0), kills and the watchdog's
restarts by service and reason. Exit status 1 when there was a hang, a lost write
or an error that was not a typed ``ServiceError``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from magnitude import launcher
from magnitude.agent import Agent, Trace
from services.retrieval.store import MemoryStore
from shared import catalog, process
from shared.client import Client, Retry, ServiceError
from shared.config import (DEFAULT_EMBEDDING_MODEL_FILE, SERVICE_NAMES,
                           WATCHDOG_NAME, dump_config, magnitude_home, parse_config)
from shared.protocol import ErrorCode

TASKS = ["What is 17 * 23?", "What is 1024 / 8?", "What is 345 + 678?", "What is 2 ** 10?",
         "What is (12 + 8) * 3?", "What is 999 - 123?", "What is 81 / 9?", "What is 7 * 6 * 5?"]
COLLECTION = "chaos"
_KNOWN_CODES = {v for k, v in vars(ErrorCode).items() if k.isupper()}


class Tally:
    """Counters shared by the worker threads, and the operations in flight (for hang detection)."""

    def __init__(self, hang_after_s: float):
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.errors: Counter = Counter()
        self.acked: list[str] = []
        self.hang_after_s = hang_after_s
        self.in_flight: dict[str, tuple[str, float]] = {}  # thread -> (operation, started)
        self.hung: set[tuple[str, str, float]] = set()  # (thread, operation, started)

    def add(self, **counts: int) -> None:
        with self.lock:
            self.counts.update(counts)

    def error(self, code: str) -> None:
        with self.lock:
            self.errors[code] += 1

    def begin(self, what: str) -> None:
        with self.lock:
            self.in_flight[threading.current_thread().name] = (what, time.monotonic())

    def end(self) -> None:
        with self.lock:
            self.in_flight.pop(threading.current_thread().name, None)

    def check_hangs(self, stuck: set[str] = frozenset()) -> None:
        """Count operations past the limit, and those of ``stuck`` threads (never finished) whatever their age."""
        now = time.monotonic()
        with self.lock:
            for thread, (what, started) in self.in_flight.items():
                if now - started > self.hang_after_s or thread in stuck:
                    self.hung.add((thread, what, started))


def _code(text: str | None) -> str | None:
    """The error code at the start of 'code: message', if it is one of the protocol's codes."""
    head = (text or "").split(":", 1)[0].strip()
    return head if head in _KNOWN_CODES else None


def count_trace(trace: Trace, tally: Tally) -> None:
    steps = trace.steps
    tool_calls = sum(len(s.calls) for s in steps)  # one chat request per step, one tool.call per call
    tally.add(agent_runs=1, **{f"agent_{trace.stopped}": 1}, requests=1 + len(steps) + tool_calls,
              agent_steps=len(steps), tool_calls=tool_calls)
    for text in [trace.error, *(c.error for s in steps for c in s.calls)]:
        code = _code(text)
        if code:
            tally.error(code)


def agent_worker(config, stop: threading.Event, tally: Tally, rng: random.Random) -> None:
    agent = Agent(config, timeout_s=60.0, retry=Retry(deadline_s=120.0, max_backoff_s=2.0))
    try:
        while not stop.is_set():
            tally.begin("agent.run")
            try:
                count_trace(agent.run(rng.choice(TASKS), max_iterations=3), tally)
            except ServiceError as err:  # tool.list failed past its retries
                tally.add(requests=1, agent_runs=1, agent_error=1)
                tally.error(err.code)
            except Exception as exc:  # noqa: BLE001 - counted: a failure that is not typed is a finding
                tally.error(f"untyped:{type(exc).__name__}")
            finally:
                tally.end()
    finally:
        agent.close()


def memory_writer(config, stop: threading.Event, tally: Tally) -> None:
    client = Client.for_service("retrieval", config, timeout_s=30.0)
    retry = Retry(deadline_s=120.0, max_backoff_s=2.0)
    try:
        while not stop.is_set():
            doc_id = f"m-{uuid.uuid4().hex[:12]}"
            tally.begin("memory.upsert")
            try:
                reply = client.request("memory.upsert", {"collection": COLLECTION, "id": doc_id,
                                                         "text": f"chaos note {doc_id}: the robot was here"},
                                       retry=retry)
                if reply.get("committed"):
                    with tally.lock:
                        tally.acked.append(doc_id)
                tally.add(requests=1, memory_writes=1)
            except ServiceError as err:
                tally.add(requests=1, memory_writes=1, memory_writes_failed=1)
                tally.error(err.code)
            except Exception as exc:  # noqa: BLE001
                tally.error(f"untyped:{type(exc).__name__}")
            finally:
                tally.end()
    finally:
        client.close()


def killer(config, stop: threading.Event, every_s: float, rng: random.Random, kills: Counter, log) -> None:
    while not stop.wait(every_s):
        name = rng.choice(SERVICE_NAMES)
        pid = process.read_pid(config, name)
        if pid is None:
            log(f"kill: {name} is not running (still restarting?)")
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            kills[name] += 1
            log(f"kill -9 {name} (pid {pid})")
        except ProcessLookupError:
            pass


def restarts(config) -> dict[str, int]:
    """The watchdog's restart counter, by 'service/reason'."""
    with Client.for_service(WATCHDOG_NAME, config, timeout_s=10.0) as client:
        text = client.request("metrics")["text"]
    return {f"{s.labels['service']}/{s.labels['reason']}": int(s.value)
            for family in text_string_to_metric_families(text) if family.name == "magnitude_restarts"
            for s in family.samples if s.name.endswith("_total")}


def wait_healthy(config, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(s.healthy for s in launcher.health(config, timeout_s=2.0)):
            return True
        time.sleep(1.0)
    return False


def make_config(home: Path):
    models = magnitude_home() / "models"
    return parse_config({
        "engine": {"model_path": str(catalog.get(catalog.TEST_CHAT_MODEL).path(models)), "n_ctx": 2048,
                   "session_slots": 4},
        "memory": {"embedding_model_path": str(models / DEFAULT_EMBEDDING_MODEL_FILE)},
        "agent": {"tools": [{"name": "calculator"}], "max_step_tokens": 96},
        "runtime": {"runtime_dir": str(home / "run"), "data_dir": str(home / "data"), "queue_size": 64},
        "metrics": {"base_port": 0},
        "gateway": {"port": 0},  # the agents use the services; port 8000 may be another stack's
        "watchdog": {"backend": "local", "interval_s": 1.0, "backoff_initial_s": 0.5, "backoff_reset_s": 15.0,
                     "start_timeout_s": 90.0},
    })


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the chaos lasts (default 10)")
    parser.add_argument("--agents", type=int, default=8, help="agent threads (default 8)")
    parser.add_argument("--kill-every", type=float, default=20.0, help="seconds between kills (default 20)")
    parser.add_argument("--hang-after", type=float, default=300.0,
                        help="an operation running longer than this is a hang (default 300 s: the retry "
                             "deadline plus a request timeout, with room)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (tasks, victims)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    home = Path(tempfile.mkdtemp(prefix="magchaos", dir="/tmp"))
    config = make_config(home)
    config_path = home / "config.yaml"
    config_path.write_text(dump_config(config))

    def log(line: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)

    log(f"starting the stack in {home}")
    statuses = launcher.up(config, str(config_path), progress=log)
    if not all(s.healthy for s in statuses):
        log("the stack did not start: " + "; ".join(f"{s.name}: {s.error}" for s in statuses if not s.healthy))
        launcher.down(config)
        return 2
    tally, kills, stop, stop_killer = Tally(args.hang_after), Counter(), threading.Event(), threading.Event()
    workers = [threading.Thread(target=agent_worker, args=(config, stop, tally, random.Random(rng.random())),
                                name=f"agent-{i}", daemon=True) for i in range(args.agents)]
    workers.append(threading.Thread(target=memory_writer, args=(config, stop, tally), name="memory", daemon=True))
    chaos = threading.Thread(target=killer, args=(config, stop_killer, args.kill_every, rng, kills, log),
                             name="killer", daemon=True)
    started = time.monotonic()
    for t in [*workers, chaos]:
        t.start()
    end = started + args.minutes * 60
    while time.monotonic() < end:
        time.sleep(min(15.0, max(0.0, end - time.monotonic())))
        tally.check_hangs()
        log(f"{time.monotonic() - started:.0f}s: {dict(tally.counts)} errors {dict(tally.errors)} "
            f"kills {sum(kills.values())}")
    stop_killer.set()
    stop.set()
    log("stopping: waiting for the operations in flight")
    join_deadline = time.monotonic() + args.hang_after
    for t in workers:
        t.join(timeout=max(0.0, join_deadline - time.monotonic()))
    tally.check_hangs(stuck={t.name for t in workers if t.is_alive()})
    hangs = len(tally.hung)
    healthy = wait_healthy(config, 120.0)
    restarted = restarts(config) if healthy else {}
    launcher.down(config)
    store = MemoryStore(config.runtime.resolved_data_dir() / "memory.db")
    lost = [doc_id for doc_id in tally.acked if store.get(COLLECTION, doc_id) is None]
    store.close()
    result = {
        "minutes": args.minutes, "agents": args.agents, "kill_every_s": args.kill_every,
        "requests": tally.counts["requests"], "counts": dict(sorted(tally.counts.items())),
        "typed_errors": dict(sorted((k, v) for k, v in tally.errors.items() if not k.startswith("untyped"))),
        "untyped_errors": dict(sorted((k, v) for k, v in tally.errors.items() if k.startswith("untyped"))),
        "hangs": hangs, "memory_writes_acked": len(tally.acked), "acked_writes_lost": len(lost),
        "kills": dict(sorted(kills.items())), "restarts": dict(sorted(restarted.items())),
        "healthy_after": healthy, "home": str(home)}
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:20} {value}")
    return 0 if healthy and not hangs and not lost and not result["untyped_errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
