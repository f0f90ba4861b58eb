"""Fixtures: an isolated MAGNITUDE_HOME per test session, and a real inference service process."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from shared import catalog  # noqa: E402
from shared.config import Config, parse_config  # noqa: E402
from shared.cores import UNLEASED_SPIN_COUNT, share_cores_with_openmp  # noqa: E402

# Tests run llama.cpp in-process (without the services' core lease) beside the services they start, which
# inherit this: a short spin, so that two computations at once share the cores instead of starving.
share_cores_with_openmp(UNLEASED_SPIN_COUNT)

#: Inputs tried per fuzz target, printed in the test summary.
FUZZ_COUNTS: dict[str, int] = {}
#: Measured figures tests want in the CI log (recall, similarities, ...), printed in the summary.
REPORT: list[str] = []


def pytest_terminal_summary(terminalreporter):
    if FUZZ_COUNTS:
        terminalreporter.write_line("fuzz inputs tried: " + ", ".join(f"{k}={v}" for k, v in FUZZ_COUNTS.items()))
    for line in REPORT:
        terminalreporter.write_line(line)


# The model lives in the user's MAGNITUDE_HOME (assembled by scripts/setup); everything else per run.
MODEL_PATH = catalog.get(catalog.BASE_MODEL).path()
#: The smallest instruct model whose template renders tools (pulled by scripts/setup): chat tests load it.
CHAT_MODEL_PATH = catalog.get(catalog.TEST_CHAT_MODEL).path()


@pytest.fixture(scope="session")
def run_home():
    # Short path: ipc socket paths must stay under ~100 bytes.
    home = Path(tempfile.mkdtemp(prefix="mag", dir="/tmp"))
    yield home
    shutil.rmtree(home, ignore_errors=True)


def make_config(home: Path, **engine) -> Config:
    return parse_config({
        "engine": {"model_path": str(MODEL_PATH), "n_ctx": 2048, "session_slots": 2, **engine},
        "runtime": {"runtime_dir": str(home / "run"), "data_dir": str(home / "data"), "queue_size": 4},
        "metrics": {"base_port": 0},  # ephemeral /metrics ports: parallel test runs never collide
        "gateway": {"port": 0},  # and an ephemeral HTTP port for the gateway
    })


def write_config(home: Path, config: Config) -> Path:
    from shared.config import dump_config
    path = home / f"config-{time.monotonic_ns()}.yaml"
    path.write_text(dump_config(config))
    return path


def stream_event_classes() -> dict[str, type]:
    """The official openai client's class for each Responses stream event type it knows."""
    from typing import get_args

    from openai.types.responses import ResponseStreamEvent
    union = get_args(ResponseStreamEvent)[0]
    return {get_args(cls.model_fields["type"].annotation)[0]: cls for cls in get_args(union)}


#: Root may give a file to another uid, and its tools run as nobody (65534).
AS_ROOT = os.geteuid() == 0


def dead_pid() -> int:
    """A pid that was just used and has exited (reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (for a server a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mcp_http_command(run_home: Path, name: str) -> tuple[Config, list[str], int]:
    """A fresh home under ``run_home`` and the command that serves it as MCP over HTTP on a free port."""
    home = run_home / name
    home.mkdir()
    config = make_config(home)
    port = free_port()
    return config, [sys.executable, "-m", "magnitude.cli", "--config", str(write_config(home, config)), "mcp",
                    "serve", "--http", str(port)], port


def wait_listening(proc: subprocess.Popen, port: int, what: str) -> None:
    """Wait until ``proc`` (started with ``stderr=PIPE``) listens on ``port`` of loopback; its stderr if it exits."""
    def listening():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0
    wait_for(listening, 30, what)


def wait_for(predicate, timeout_s: float = 10.0, what: str = "condition"):
    """Poll ``predicate`` until it returns something truthy (returned), or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s:g}s: {what}")


def gaps_while(stream, after: int, work) -> list[float]:
    """Seconds between a stream's pieces while ``work()`` runs on another thread: it starts once ``after``
    pieces came, and the stream is read until it is done (another client unaffected by it: the gaps say)."""
    stamps: list[float] = []
    worker = threading.Thread(target=work)
    for _ in stream:
        stamps.append(time.monotonic())
        if len(stamps) == after:
            worker.start()
        if len(stamps) > after and not worker.is_alive():
            break
    assert worker.ident is not None, f"the stream ended after {len(stamps)} pieces, before the work started"
    worker.join(60)
    return [b - a for a, b in zip(stamps[after:], stamps[after + 1:])]


def require_model(path: Path = MODEL_PATH) -> None:
    if not path.is_file():
        pytest.fail(f"model not assembled at {path}; run scripts/setup")


class ServiceProcess:
    """A service started as its own process, the way the launcher does (``module``: a stand-in's module;
    ``cwd``: its working directory, default this one)."""

    def __init__(self, name: str, config_path: Path, config: Config, curve=None, module: str | None = None,
                 cwd: Path | None = None):
        self.name, self.config_path, self.config, self.curve, self.cwd = name, config_path, config, curve, cwd
        self.module = module or f"services.{name}"
        self.endpoint = config.runtime.endpoint(name)
        self.log = config_path.with_suffix(f".{name}.log")
        self.proc: subprocess.Popen | None = None

    def start(self, wait_s: float = 60) -> "ServiceProcess":
        from shared.client import Client, ServiceError
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen([sys.executable, "-m", self.module, "--config", str(self.config_path)],
                                     stdout=subprocess.DEVNULL, stderr=open(self.log, "ab"), env=env, cwd=self.cwd)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"{self.name} exited: {self.log.read_text()[-2000:]}"
            try:
                with Client(self.endpoint, timeout_s=1, curve=self.curve) as c:
                    if c.health()["ok"]:
                        return self
            except ServiceError:
                time.sleep(0.2)
        raise TimeoutError(f"{self.name} not healthy in {wait_s}s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextmanager
def running_inference(home: Path, **engine) -> Iterator[ServiceProcess]:
    """A real inference service process with these engine settings (over ``make_config``'s), stopped after."""
    require_model()
    config = make_config(home, **engine)
    svc = ServiceProcess("inference", write_config(home, config), config).start()
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture(scope="session")
def inference_service(run_home):
    require_model()
    config = make_config(run_home)
    svc = ServiceProcess("inference", write_config(run_home, config), config).start()
    yield svc
    svc.stop()


class MemoryServices:
    """The embedding and retrieval processes, started in launcher order."""

    def __init__(self, home: Path):
        if not make_config(home).memory.resolved_embedding_model_path().is_file():
            pytest.fail("embedding model not assembled; run scripts/setup")
        self.config = make_config(home)
        path = write_config(home, self.config)
        self.embedding = ServiceProcess("embedding", path, self.config).start()
        self.retrieval = ServiceProcess("retrieval", path, self.config).start()

    def stop(self) -> None:
        self.retrieval.stop()
        self.embedding.stop()


@pytest.fixture(scope="session")
def memory_services(run_home):
    services = MemoryServices(run_home)
    yield services
    services.stop()


def chat_reply(message: dict, **stats) -> dict:
    """A ``chat`` reply body (``shared.protocol.ChatResult``) of an assistant message as a test scripts it."""
    return {"message": {"content": None, **message}, "finish_reason": "tool_calls" if message.get("tool_calls")
            else "stop", "stats": stats}
